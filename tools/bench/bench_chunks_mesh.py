"""Chunked state on 4 ranks: ZeRO over all 4 (pure data parallelism, mesh 4) vs over 2 with tensor
parallelism on the other 2 (mesh 2 x 2), predicted against measured, on 4 gloo ranks.

For one model and each per-device budget, the solver plans chunked state on mesh 4, and on mesh
2 x 2 with ``offload_axes`` = every axis and = axis 0 alone; on 2 x 2 it also says which it picks by
itself (``offload_axes`` None: the least predicted step time). Each plan then trains under
``torchrun -m cauto.runtime.launch --verify``, which reports the chunk manager's figures and the
step's collectives against the plan's predictions.

    python tools/bench/bench_chunks_mesh.py [--target cauto.profiler.zoo:gpt --budgets 1.2MiB 1.8MiB --steps 6] [--write]

``--write`` replaces the "## Chunked state beside tensor parallelism" section of tools/bench/RESULTS.md.
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


def _train(target: str, plan_path: Path, steps: int) -> tuple[list[float], dict]:
    from cauto.runtime.dist_utils import free_port
    out = plan_path.with_suffix(".measured.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           "-m", "cauto.runtime.launch", target, "--plan", str(plan_path), "--steps", str(steps), "--verify",
           "--measured-out", str(out), "--timeout-s", "120"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        raise RuntimeError(f"training failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    times = [float(t) for t in re.findall(r"^step \d+/\d+ loss \S+ time ([0-9.]+) s", res.stdout, re.M)]
    return times, json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cauto.profiler.zoo:gpt")
    ap.add_argument("--budgets", nargs="+", default=["1.2MiB", "1.8MiB"])
    ap.add_argument("--steps", type=int, default=6, help="training steps per plan; the first (warm-up) is not timed")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    from cauto.profiler import profile
    from cauto.profiler.target import load_target
    from cauto.solver import InfeasibleBudgetError, cluster_for_mesh, plan
    from cauto.solver.cli import parse_bytes

    fn = load_target(args.target)
    graph = profile(fn).to_graph()
    mesh22 = cluster_for_mesh("cpu-gloo", (2, 2), ("dp", "tp"))
    mesh4 = cluster_for_mesh("cpu-gloo", (4,), ("dp",))
    model, _ = fn()
    state_bytes = 16 * sum(p.numel() for p in model.parameters())
    try:
        plan(graph, mesh22, memory_budget=1)
    except InfeasibleBudgetError as exc:
        device_only = exc.needed_bytes
    lines = ["| budget MiB | mesh: chunks ZeRO-sharded over | params split on tp | edges | predicted step (ms) "
             "| measured step (ms) | host link MiB/step pred / meas | non-model peak MiB pred / meas "
             "| arena MiB pred / meas | collectives/step executed = predicted |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    cases = [(mesh4, (0,), "4: dp (pure data parallel)"), (mesh22, (0, 1), "2 x 2: dp, tp (pure data parallel)"),
             (mesh22, (0,), "2 x 2: dp (tensor parallel on tp)")]
    with tempfile.TemporaryDirectory() as tmp:
        for text in args.budgets:
            budget = parse_bytes(text)
            chosen = plan(graph, mesh22, memory_budget=budget, offload="chunked")["offload"]["mesh_axes"]
            for k, (cluster, axes, name) in enumerate(cases):
                try:
                    doc = plan(graph, cluster, memory_budget=budget, offload="chunked", offload_axes=axes)
                except InfeasibleBudgetError as exc:
                    lines.append(f"| {budget / MIB:.2f} | {name} | {str(exc).split(';')[0]} |  |  |  |  |  |  |  |")
                    continue
                path = Path(tmp) / f"plan-{text}-{k}.json"
                path.write_text(json.dumps(doc))
                times, rep = _train(args.target, path, args.steps)
                split = sum(any(p != "R" for p in e["placements"]) for e in doc["params"].values())
                coll = rep["collectives"]

                def pm(key, rep=rep):
                    return f"{rep[key]['predicted'] / MIB:.2f} / {rep[key]['measured'] / MIB:.2f}"
                label = f"**{name}** (solver's pick on 2 x 2)" if cluster is mesh22 and list(axes) == chosen else name
                step_s = statistics.median(times[1:]) if len(times) > 1 else float("nan")
                lines.append(f"| {budget / MIB:.2f} | {label} | {split} | {len(doc['edges'])} | "
                             f"{doc['predictions']['step_time_s']['total'] * 1e3:.1f} | {step_s * 1e3:.0f} | "
                             f"{pm('moved_bytes')} | {pm('nonmodel_peak_bytes')} | {pm('arena_bytes')} | "
                             f"{sum(coll['executed'].values())} {'yes' if coll['predicted'] == coll['executed'] else 'NO'} |")
    head = (f"Target `{args.target}`, 4 gloo ranks; model state (fp32 params, grads, Adam m, v) "
            f"{state_bytes / MIB:.2f} MiB; the least memory of a device-only plan on 2 x 2: {device_only / MIB:.2f} MiB per "
            f"device. Without `offload_axes` the solver picks the plan in bold on 2 x 2 (least predicted step time). "
            f"Step time: median of steps 2-{args.steps} (CPU, 1 thread per rank).")
    body = (f"Command: `python tools/bench/bench_chunks_mesh.py --write`\n\n{head}\n\n" + "\n".join(lines) +
            "\n\nPredicted host link bytes are an upper bound (offload/model.py); the non-model peak and arena are "
            "what the chunk manager measured in its warm-up on the simulated CPU device.")
    print(body)
    if args.write:
        sys.path.insert(0, str(Path(__file__).parent))
        from results_md import replace_section
        replace_section("Chunked state beside tensor parallelism", body)


if __name__ == "__main__":
    main()
