"""Plan every fixture and zoo case and write the plan JSONs to a directory; compare two such directories.

    python tools/check_plans_identical.py write DIR [--quick]
    python tools/check_plans_identical.py compare BEFORE AFTER

A restructuring must not change a plan: run ``write`` on the tree before and after, then ``compare``,
which checks the files byte for byte after dropping the only volatile field, ``solver.time_s`` (the
wall time of the solve; every plan section, including the nested ones of the joint search, is
scanned for it). A case whose planning raises writes the error's type and message instead, so a
changed error (or a case that starts or stops fitting) shows up as a difference too.

Cases: the solver's synthetic GPT / Llama / MLP graphs, the checkpoint package's synthetic GPT, the
integration fixture graph and the profiled GPT-2 graph of the solver tests, and the profiler zoo's
small models (MLP, CNN, GPT; ``--quick`` leaves the zoo out), unconstrained and at a budget tight
enough to make checkpointing and chunked state matter (a fraction of the unconstrained plan's peak):
on a 1-D mesh with every checkpoint method and offload mode, on a 2x2 mesh with every offload mode
(and chunks over one axis) but no checkpointing. The planning
entry is ``cauto.solver.plan``; the zoo cases also go through the API's ``plan_for`` (profiling, the
budget string parsed by the API), which must give the same plan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _pkg in ("cauto-plan", "cauto-solver", "cauto-profiler", "cauto-runtime", "cauto"):
    sys.path.insert(0, os.path.join(ROOT, "packages", _pkg, "src"))

#: fields that legitimately change between two runs of the same plan (wall time of the solve)
VOLATILE_KEYS = ("time_s",)
#: fractions of the unconstrained plan's peak used as tight budgets (few: the joint search of a
#: checkpointed plan runs the ILP many times, and the check has to run after each refactoring step)
BUDGET_FRACTIONS = (0.6,)
MODES = [("none", "none"), ("auto", "none"), ("rotor", "none"), ("chen", "none"), ("none", "auto"),
         ("none", "chunked"), ("auto", "auto")]
#: on the 2-D mesh only the modes without checkpointing: its joint search takes minutes per case here
DEVICE_MODES = [m for m in MODES if m[0] == "none"]


def _strip(value, under_solver: bool = False):
    if isinstance(value, dict):
        return {k: _strip(v, k == "solver" or under_solver) for k, v in value.items()
                if not (under_solver and k in VOLATILE_KEYS)}
    if isinstance(value, list):
        return [_strip(v, under_solver) for v in value]
    return value


def _graphs(quick: bool):
    from cauto.solver import synthetic
    from cauto.solver.checkpoint import synthetic as ck_synthetic

    yield "syn-gpt", lambda: synthetic.gpt()
    yield "syn-llama", lambda: synthetic.llama()
    yield "syn-mlp", lambda: synthetic.mlp()
    yield "ck-gpt", lambda: ck_synthetic.gpt_graph()
    for name, path in (("fixture-graph-1.0", "integration_tests/fixtures/graph-1.0.json"),
                       ("profiled-gpt", "packages/cauto-solver/tests/data/profiled_gpt_graph.json")):
        yield name, (lambda p=path: json.load(open(os.path.join(ROOT, p))))
    if quick:
        return
    from cauto.profiler import profile, zoo

    for name in ("mlp", "cnn", "gpt"):
        yield f"zoo-{name}", (lambda n=name: profile(getattr(zoo, n)).to_graph())


def _plan(graph, cluster, budget, checkpoint, offload, offload_axes=None):
    from cauto.solver import plan

    try:
        return plan(graph, cluster, memory_budget=budget, checkpoint=checkpoint, offload=offload,
                    offload_axes=offload_axes, time_limit_s=60.0)
    except Exception as exc:  # noqa: BLE001 - the error is the case's result
        return {"error": type(exc).__name__, "message": str(exc)}


def write(out: str, quick: bool) -> int:
    from cauto.plan import dumps
    from cauto.solver.cluster import cluster_for_mesh

    os.makedirs(out, exist_ok=True)
    count = 0

    def put(case: str, result: dict) -> None:
        nonlocal count
        with open(os.path.join(out, case + ".json"), "w") as f:
            f.write(dumps(_strip(result)) if "error" not in result else json.dumps(result, indent=1, sort_keys=True))
        count += 1

    for gname, make in _graphs(quick):
        t0 = time.perf_counter()
        graph = make()
        for mesh, modes in (((2, 2), DEVICE_MODES), ((2,), MODES)):
            cluster = cluster_for_mesh("cpu-gloo", mesh)
            free = _plan(graph, cluster, None, "none", "none")
            peak = free.get("predictions", {}).get("peak_bytes")
            mname = "x".join(map(str, mesh))
            put(f"{gname}.{mname}.free.none.none", free)
            put(f"{gname}.{mname}.free.none.chunked", _plan(graph, cluster, None, "none", "chunked"))
            for frac in BUDGET_FRACTIONS if peak else ():
                budget = int(peak * frac)
                for checkpoint, offload in modes:
                    case = f"{gname}.{mname}.b{frac}.{checkpoint}.{offload}"
                    print(case, file=sys.stderr, flush=True)
                    put(case, _plan(graph, cluster, budget, checkpoint, offload))
                if len(mesh) > 1:
                    put(f"{gname}.{mname}.b{frac}.none.chunked.axes0",
                        _plan(graph, cluster, budget, "none", "chunked", (0,)))
        print(f"{gname}: {time.perf_counter() - t0:.1f} s", flush=True)
    if not quick:
        count += _api_cases(put)
    print(f"wrote {count} cases to {out}")
    return 0


def _api_cases(put) -> int:
    from cauto.api.autoparallel import plan_for
    from cauto.profiler import zoo

    n = 0
    for name, budget, checkpoint, offload in (("gpt", None, "none", "none"), ("gpt", "1.5MB", "none", "none"),
                                              ("llama", "0.5MB", "none", "auto"), ("mlp", 200000, "none", "none")):
        try:
            result = plan_for(getattr(zoo, name), (2, 2), memory_budget=budget, checkpoint=checkpoint,
                              offload=offload)
        except Exception as exc:  # noqa: BLE001
            result = {"error": type(exc).__name__, "message": str(exc)}
        put(f"api-{name}.{budget}.{checkpoint}.{offload}", result)
        n += 1
    return n


def compare(before: str, after: str) -> int:
    a, b = sorted(os.listdir(before)), sorted(os.listdir(after))
    if a != b:
        print(f"case lists differ: only before {sorted(set(a) - set(b))}, only after {sorted(set(b) - set(a))}")
        return 1
    differ = [f for f in a if open(os.path.join(before, f), "rb").read() != open(os.path.join(after, f), "rb").read()]
    for f in differ:
        print(f"DIFFERS: {f}")
    print(f"{len(a) - len(differ)} of {len(a)} cases byte-identical")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir")
    w.add_argument("--quick", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = parser.parse_args(argv)
    return write(args.dir, args.quick) if args.cmd == "write" else compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
