"""Sharding, checkpointing and chunked state in one plan, over a budget sweep, on 4 gloo ranks (issue 22).

For each model and per-device budget the solver plans with every lever (``offload="auto",
checkpoint="auto"``: sharding and checkpointing on the device where that fits, else chunked plans,
the three-lever plan among them) and with each lever switched off:

* no chunks: ``checkpoint="auto"`` (sharding and checkpointing);
* no checkpointing: ``offload="chunked"`` (sharding and chunked state);
* no sharding: ``offload="chunked", offload_axes=<every axis>, checkpoint="auto"`` (every parameter
  replicated and ZeRO-sharded by the chunks, the batch split: data parallelism, with regions).

The all-lever plan then trains for ``--steps`` steps under ``torchrun -m cauto.runtime.launch --verify``
(4 ranks, one thread each), and so does the fastest feasible plan with a lever off, so that the two
measured step times sit side by side. Per row: the solver's choice (chunked parameters, parameters
split on a mesh axis, regions), predicted and measured step time, peak and host-link traffic,
collectives executed = predicted, and parity: the losses of every step against the same model trained
in this process from the same seed (one device, torch's AdamW).

    python tools/bench/bench_three_way.py [--models gpt,llama] [--fractions 1 0.7 0.5] [--steps 6] [--write]

``--write`` replaces the "## Three levers in one plan" section of tools/bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2**20
#: name -> (launch target, batch, seq, mesh); the zoo's other sizes are its defaults (dim 64; Llama 2 layers)
MODELS = {"gpt": (f"{Path(__file__).resolve()}:gpt_4_layers", 16, 64, (4,)),
          "llama": ("cauto.profiler.zoo:llama", 16, 64, (2, 2))}


def gpt_4_layers(batch: int = 16, seq: int = 64):
    """The zoo GPT with 4 layers (launch's target, by this file's path)."""
    from cauto.profiler import zoo
    return zoo.gpt(batch=batch, seq=seq, layers=4)
LR = 1e-3
#: loss parity with one process: relative difference per step
LOSS_TOL = 1e-4


def variants(mesh: tuple[int, ...]) -> dict[str, dict]:
    """Plan options of the all-lever plan and of each lever switched off (module docstring)."""
    return {"all levers": dict(offload="auto", checkpoint="auto"),
            "no chunks": dict(checkpoint="auto"),
            "no checkpointing": dict(offload="chunked"),
            "no sharding": dict(offload="chunked", offload_axes=tuple(range(len(mesh))), checkpoint="auto")}


def _train(target: str, batch: int, seq: int, plan_path: Path, steps: int) -> tuple[list[float], list[float], dict]:
    """(losses, step seconds, --verify report) of ``steps`` steps of the plan on 4 ranks."""
    from cauto.runtime.dist_utils import free_port
    out = plan_path.with_suffix(".measured.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           "-m", "cauto.runtime.launch", target, "--plan", str(plan_path), "--steps", str(steps), "--verify",
           "--batch", str(batch), "--seq", str(seq), "--lr", str(LR), "--seed", "0",
           "--measured-out", str(out), "--timeout-s", "300"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        raise RuntimeError(f"training failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    found = re.findall(r"^step \d+/\d+ loss (\S+) time ([0-9.]+) s", res.stdout, re.M)
    return [float(x) for x, _ in found], [float(t) for _, t in found], json.loads(out.read_text())


def reference_losses(target: str, batch: int, seq: int, steps: int) -> list[float]:
    """The model trained in this process on one device from launch's seed: its loss at every step."""
    import torch

    from cauto.profiler.capture import loss_of, split_inputs
    from cauto.profiler.target import bind_sizes, load_target
    fn = bind_sizes(load_target(target), {"batch": batch, "seq": seq})
    torch.manual_seed(0)
    model, _ = fn()
    torch.manual_seed(0)
    _, example = fn()
    args, kwargs = split_inputs(example)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def describe(doc: dict) -> str:
    """The plan's choice in a few words: chunked parameters, parameters split, regions."""
    params = doc["params"].values()
    chunked = sum(e.get("state") == "chunked" for e in params)
    split = sum(any(p != "R" for p in e["placements"]) for e in params)
    regions = len((doc.get("checkpoint") or {}).get("regions", []))
    over = f" over axes {doc['offload']['mesh_axes']}" if doc.get("offload") else ""
    return f"{chunked}/{len(params)} chunked{over}, {split} split, {regions} regions"


def _measured_peak(doc: dict, rep: dict) -> tuple[int, int]:
    """(predicted, measured) peak bytes per device of the --verify report (chunked plans: non-model peak
    plus the chunk working set, as the plan predicts it)."""
    if "nonmodel_peak_bytes" in rep:
        ws = int(doc["offload"]["working_set_bytes"])
        return int(doc["predictions"]["peak_bytes"]), int(rep["nonmodel_peak_bytes"]["measured"]) + ws
    return int(rep["peak_bytes"]["predicted"]), int(max(rep["peak_bytes"].get("measured_per_rank")
                                                        or [rep["peak_bytes"]["measured"]]))


def _collectives_equal(rep: dict) -> tuple[bool, int]:
    """(every collective of the step is one the plan predicts, how many ran) of a --verify report: the
    chunk report's per-op counts, or the program's forward and backward counts and gradient buckets' bytes."""
    if "collectives" in rep:
        coll = rep["collectives"]
        return coll["predicted"] == coll["executed"], sum(coll["executed"].values())
    sync = rep["grad_sync"]
    equal = all(rep[ph]["predicted"] == rep[ph]["executed"] for ph in ("forward", "backward")) and \
        sync["predicted_bytes"] == sync["executed_bytes"]
    return equal, sum(sum(rep[ph]["executed"].values()) for ph in ("forward", "backward")) + sync["executed_buckets"]


def _without_options(doc: dict) -> str:
    """The plan as JSON without what records how it was asked for (options, solve time)."""
    return json.dumps({k: v for k, v in doc.items() if k not in ("options", "solver")}, sort_keys=True)


def sweep(name: str, fractions: list[float], steps: int, tmp: Path) -> list[str]:
    """The table rows of one model (module docstring)."""
    from cauto.profiler import profile
    from cauto.profiler.target import bind_sizes, load_target
    from cauto.solver import InfeasibleBudgetError, cluster_for_mesh, plan

    target, batch, seq, mesh = MODELS[name]
    fn = bind_sizes(load_target(target), {"batch": batch, "seq": seq})
    graph = profile(fn).to_graph()
    cluster = cluster_for_mesh("cpu-gloo", mesh)
    top = plan(graph, cluster)["predictions"]["peak_bytes"]  # the unconstrained device-only plan's peak
    leasts = {}
    for label, options in variants(mesh).items():
        try:
            plan(graph, cluster, memory_budget=1, **options)
        except InfeasibleBudgetError as exc:
            leasts[label] = int(exc.needed_bytes)
    two_lever = min(leasts.get("no chunks", top), leasts.get("no checkpointing", top))
    # the fractions, 5% below the least of both two-lever plans, and the all-lever plan's own least
    budgets = sorted({int(top * f) for f in fractions} | {int(0.95 * two_lever), leasts["all levers"]}, reverse=True)
    print(f"{name}: unconstrained peak {top}, least per variant {leasts}", flush=True)
    ref = reference_losses(target, batch, seq, steps)
    rows = []
    for budget in budgets:
        fraction = round(budget / top, 4)
        docs, needs = {}, {}
        for label, options in variants(mesh).items():
            try:
                docs[label] = plan(graph, cluster, memory_budget=budget, **options)
            except InfeasibleBudgetError as exc:
                needs[label] = exc.needed_bytes
        times = {label: d["predictions"]["step_time_s"]["total"] for label, d in docs.items()}
        off = [f"{label}: " + (f"{times[label] * 1e3:.1f} ms" if label in docs else
                               f"needs {needs[label] / MIB:.2f} MiB") for label in variants(mesh) if label != "all levers"]
        if "all levers" not in docs:
            rows.append(f"| {name} {'x'.join(map(str, mesh))} | {budget / MIB:.2f} | none fits (needs "
                        f"{needs['all levers'] / MIB:.2f} MiB) | | | | | | {'; '.join(off)} | |")
            continue
        doc = docs["all levers"]
        path = tmp / f"{name}-{fraction}.json"
        path.write_text(json.dumps(doc))
        losses, secs, rep = _train(target, batch, seq, path, steps)
        parity = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref))
        equal, count = _collectives_equal(rep)
        peak_pred, peak_meas = _measured_peak(doc, rep)
        moved = rep.get("moved_bytes", {})
        traffic = f"{moved['predicted'] / MIB:.2f} / {moved['measured'] / MIB:.2f}" if moved else "0 / 0"
        rival = min((label for label in docs if label != "all levers"), key=times.get, default=None)
        rival_meas = ""
        if rival is not None and _without_options(docs[rival]) != _without_options(doc):
            rpath = tmp / f"{name}-{fraction}-rival.json"
            rpath.write_text(json.dumps(docs[rival]))
            _, rsecs, _ = _train(target, batch, seq, rpath, steps)
            rival_meas = f"{rival}: {statistics.median(rsecs[1:]) * 1e3:.0f} ms measured"
        elif rival is not None:
            rival_meas = f"{rival}: the same plan"
        step_ms = statistics.median(secs[1:]) * 1e3
        rows.append(
            f"| {name} {'x'.join(map(str, mesh))} | {budget / MIB:.2f} | {describe(doc)} | "
            f"{times['all levers'] * 1e3:.1f} / {step_ms:.0f} | {peak_pred / MIB:.3f} / {peak_meas / MIB:.3f} "
            f"({(peak_meas / peak_pred - 1) * 100:+.1f}%) | {traffic} | {count} {'yes' if equal else 'NO'} | "
            f"{parity:.1e} | {'; '.join(off)} | {rival_meas} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--fractions", nargs="+", type=float, default=[1.0, 0.7, 0.5])
    ap.add_argument("--steps", type=int, default=6, help="training steps per plan; the first (warm-up) is not timed")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    lines = ["| model, mesh | budget MiB | solver's choice (every lever) | step ms pred / meas | peak MiB pred / meas "
             "| host link MiB/step pred / meas | collectives/step executed = predicted | loss parity (max rel.) "
             "| predicted with one lever off | fastest with a lever off, measured |",
             "|---|---:|---|---:|---:|---:|---|---:|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            lines += sweep(name, args.fractions, args.steps, Path(tmp))
    head = (f"4 gloo ranks, one thread each; budgets: fractions {args.fractions} of the unconstrained "
            "device-only plan's peak, 5% below the least budget of both two-lever plans (sharding with "
            f"checkpointing, sharding with chunks), and the least the all-lever plan needs. Step time: median of "
            f"steps 2-{args.steps}. Peak: chunked plans' non-model peak (torch.profiler's live bytes, the chunk "
            "manager's own buffers left out) plus the plan's chunk working set. Parity: each step's loss against "
            "the same model trained in one process from the same seed.")
    tail = ("Measured against predicted, the two kinds of plan disagree in both directions. This run (2026-12-06) measured the same plans 1.5-2x slower than the run before it on the same machine with nothing else running, so only rows of one run compare. Chunked plans with checkpoint regions run on the DTensor interpreter (no local-tensor lowering with chunk fetches yet) and measure 7-12x their prediction; the chunked GPT run as written measures about 4-5x its prediction; device-only plans measure 1.4-5.5x theirs (tensor-parallel ones slowest on gloo). So the solver's predicted speed order between a chunked and a device-only plan is not what runs: `offload=\"auto\"` keeps chunks for budgets no device-only plan fits, which costs the GPT rows at 20, 14 and 10 MiB (device-only measured 143-405 ms, the chunked plan 109-128 ms) and is right for the Llama rows (device-only 69-159 ms, chunked 120-240 ms). Peaks: every row is within 3% except the two chunked GPT rows, whose nested rotor regions run on the interpreter: 5.5% over. The walk keeps the whole-region rule for nested regions; its keeper rule, applied to them, predicts that plan 4.5% under, so it is not applied there. Collectives executed = predicted on every row.")
    body = f"Command: `python tools/bench/bench_three_way.py --write`\n\n{head}\n\n" + "\n".join(lines) + f"\n\n{tail}"
    print(body)
    if args.write:
        sys.path.insert(0, str(Path(__file__).parent))
        from results_md import replace_section
        replace_section("Three levers in one plan", body)


if __name__ == "__main__":
    main()
