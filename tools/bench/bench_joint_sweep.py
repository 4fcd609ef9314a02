"""The search over a falling budget (issue 22 point 2): the joint search (sharding + checkpointing,
``--checkpoint auto``, the default) or the sharding-only search (``--checkpoint none``).

    python tools/bench/bench_joint_sweep.py [--ratio 0.95] [--models gpt,llama,mistral] [--checkpoint auto|none]
        [--write]

For each model (profiled on fake tensors: the zoo GPT on mesh 4, the zoo Llama on 2x2, a Mistral-style
HF decoder on mesh 4) it plans at budgets falling from the unconstrained peak by ``--ratio`` until two
budgets in a row find nothing, and checks the search's two promises on every row:

* **monotonic**: a plan found at any budget with peak p, every swept budget >= p finds a plan;
* **honest**: every infeasible budget names the same least budget X, the search at X finds a plan and
  at X - 1 it does not.

A row shows the budget, what the search returned (peak, regions, predicted step time) or the least it
names. The speed column need not fall with the budget (the search promises feasibility, not that a
larger budget is never slower: see "larger budget slower" under the table). ``--write`` replaces the
"## Joint search over budgets" section of tools/bench/RESULTS.md ("## Sharding-only search over
budgets" with ``--checkpoint none``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MESHES = {"gpt": (4,), "llama": (2, 2), "mistral": (4,)}


def factory(name: str):
    from cauto.profiler import zoo
    if name == "gpt":
        return zoo.ZOO["gpt"]
    if name == "llama":
        return functools.partial(zoo.llama, batch=4, seq=32, dim=64, layers=2)
    import bench_coverage  # tools/bench/, next to this script
    return getattr(bench_coverage, name)


def sweep(name: str, ratio: float, checkpoint: str = "auto") -> tuple[list[tuple], dict]:
    """Rows (budget, peak or None, regions, step s, least named or None, plan s) and the checks' outcome."""
    from cauto.profiler import profile
    from cauto.solver import InfeasibleBudgetError, plan
    from cauto.solver.cluster import cluster_for_mesh
    graph = profile(factory(name)).to_graph()
    cluster = cluster_for_mesh("cpu-gloo", MESHES[name])
    top = plan(graph, cluster)["predictions"]["peak_bytes"]
    rows, misses, budget = [], 0, top
    while misses < 2:
        t0 = time.perf_counter()
        try:
            doc = plan(graph, cluster, memory_budget=budget, checkpoint=checkpoint)
            pred = doc["predictions"]
            rows.append((budget, pred["peak_bytes"], len(doc.get("checkpoint", {}).get("regions", [])),
                         pred["step_time_s"]["total"], None, time.perf_counter() - t0))
            misses = 0
        except InfeasibleBudgetError as exc:
            rows.append((budget, None, None, None, exc.needed_bytes, time.perf_counter() - t0))
            misses += 1
        print(name, _row(rows[-1]), flush=True)
        budget = int(budget * ratio)
    checks = {"monotonic": all(r[1] is not None for peak in [r[1] for r in rows if r[1] is not None]
                               for r in rows if r[0] >= peak)}
    named = {r[4] for r in rows if r[4] is not None}
    checks["one least named"] = len(named) == 1
    if len(named) == 1:
        (least,) = named
        at = plan(graph, cluster, memory_budget=least, checkpoint=checkpoint)["predictions"]["peak_bytes"]
        try:
            plan(graph, cluster, memory_budget=least - 1, checkpoint=checkpoint)
            below = True
        except InfeasibleBudgetError:
            below = False
        checks["plan at least"] = at <= least
        checks["none at least - 1"] = not below
        checks["least"] = least
    slower = [(a[0], b[0]) for a, b in zip(rows, rows[1:])
              if a[3] is not None and b[3] is not None and a[3] > b[3] * (1 + 1e-9)]
    checks["larger budget slower"] = len(slower)
    return rows, checks


def _row(r: tuple) -> str:
    budget, peak, regions, step_s, least, plan_s = r
    if peak is None:
        return f"| {budget:,} | no plan: least {least:,} | | | {plan_s:.1f} |"
    return f"| {budget:,} | {peak:,} | {regions} | {step_s * 1e3:.2f} | {plan_s:.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=0.95, help="each budget is the previous one times this")
    ap.add_argument("--models", default="gpt,llama,mistral")
    ap.add_argument("--checkpoint", default="auto", choices=("auto", "none"))
    ap.add_argument("--write", action="store_true", help="write the tables to tools/bench/RESULTS.md")
    args = ap.parse_args()
    parts, ok = [], True
    for name in args.models.split(","):
        rows, checks = sweep(name, args.ratio, args.checkpoint)
        mesh = "x".join(map(str, MESHES[name]))
        ok &= all(v for k, v in checks.items() if k not in ("least", "larger budget slower"))
        parts.append(f"### {name}, mesh {mesh}\n\n| budget (B) | plan peak (B) | regions | predicted step (ms) | "
                     "plan (s) |\n|---:|---:|---:|---:|---:|\n" + "\n".join(_row(r) for r in rows) +
                     "\n\n" + ", ".join(f"{k}: {v}" for k, v in checks.items()))
        print(parts[-1], flush=True)
    if args.write:
        from results_md import replace_section
        command = (f"python tools/bench/bench_joint_sweep.py --ratio {args.ratio} --models {args.models} "
                   f"--checkpoint {args.checkpoint} --write")
        title = "Joint search over budgets" if args.checkpoint == "auto" else "Sharding-only search over budgets"
        replace_section(title, f"Command: `{command}` (cpu-gloo cluster, fake tensors; plans only, nothing runs)"
                        "\n\n" + "\n\n".join(parts))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
