"""bf16 mixed precision on 4 gloo ranks: parity with single-process eager autocast, and speed.

Parity (default): for each model (the zoo GPT, a Hugging Face GPT-2 LM and a Hugging Face ViT, small
random configs) and mesh (4 and 2x2), a bf16 plan (``PlanOptions(mixed_precision="bf16")``: profiled
under bf16 autocast, budget 60% of the unsharded bf16 peak (75% for the ViT: ``FRACTIONS``) so the
solver shards) is trained for
``--steps`` AdamW steps on 4 gloo ranks from the same initial state as one process running the model
eagerly under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (backward outside autocast, fp32
parameters and AdamW). Reported per run: the largest relative loss difference over the steps, the
distance of the fp32 master weights after the last step (||W - W_ref|| / ||W_ref|| over the whole
model), the same two figures for eager fp32 against eager autocast (what bf16 itself
moves the run by: the scale the tolerance is set against), the dtypes of parameters, gradients and
AdamW state, and ``verify_step``'s predicted against measured peak (every rank) and collectives.

Speed (``--speed``): the zoo GPT at a size where matmuls dominate, one interleaved run on 4 gloo
ranks: cauto's fp32 plan and bf16 plan (each solved without a budget for its own profile), FSDP2
``fully_shard`` per block and at the root in fp32, and with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``. Median step time over the rounds after a warm-up, peak by one measure
(bench_gpt_plans.peak_bytes).

    python tools/bench/bench_mixed_precision.py [--steps 20] [--models gpt,gpt2,vit] [--meshes 4,2x2] [--reduce-dtype bf16] [--json OUT]
    python tools/bench/bench_mixed_precision.py --speed [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORLD = 4
B = 4
MESHES = {"4": (4,), "2x2": (2, 2)}
#: the zoo GPT of --speed: d_model 256, 4 layers, seq 128, global batch 16 (matmuls dominate)
SPEED = dict(batch=16, seq=128, vocab=2048, dim=256, layers=4, heads=8)
MiB = 2**20


def gpt():
    from cauto.profiler.zoo import gpt as zoo_gpt
    return zoo_gpt(batch=B, seq=32, vocab=256, dim=64, layers=2, heads=4)


def gpt2():
    from cauto.profiler.zoo import hf_gpt2
    return hf_gpt2(batch=B, seq=16, vocab=128, dim=32, layers=2, heads=4)


def vit():
    from cauto.profiler.zoo import hf_vit
    return hf_vit(batch=B)


def speed_gpt():
    from cauto.profiler.zoo import gpt as zoo_gpt
    return zoo_gpt(**SPEED)


MODELS = {"gpt": gpt, "gpt2": gpt2, "vit": vit, "speed_gpt": speed_gpt}


#: budget as a fraction of the unsharded peak, per model (default 0.6): the ViT's least plan needs more, since
#: its patch-embedding convolution's backward keeps ~570 KB of oneDNN scratch at any batch split
FRACTIONS = {"vit": 0.75}


def bf16_plan(name: str, mesh: str, fraction: float | None | str = "model", mixed_precision: str = "bf16",
              reduce_dtype: str = "fp32") -> dict:
    """A plan of model ``name`` on ``mesh`` under ``fraction`` of its unsharded peak (None: no budget;
    "model": the model's ``FRACTIONS`` entry, 0.6 without one)."""
    if fraction == "model":
        fraction = FRACTIONS.get(name, 0.6)
    from cauto.api.autoparallel import profiled_autocast
    from cauto.plan.options import PlanOptions
    from cauto.profiler import profile
    from cauto.solver import cluster_for_mesh
    from cauto.solver.planning import plan

    options = PlanOptions(mixed_precision=mixed_precision)
    prof = profile(MODELS[name], autocast=profiled_autocast(options))
    budget = None if fraction is None else int(prof.peak_bytes * fraction)
    shape = MESHES[mesh]
    return plan(prof.to_graph(), cluster_for_mesh("cpu-gloo", shape, ("dp", "tp")[: len(shape)]),
                PlanOptions(mixed_precision=mixed_precision, memory_budget_bytes=budget, reduce_dtype=reduce_dtype))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def eager_run(fn, state: dict, steps: int, autocast: bool) -> tuple[list[float], dict]:
    """Losses and final parameters of ``steps`` AdamW steps of ``fn()``'s model in this process."""
    from cauto.profiler.capture import loss_of, split_inputs

    torch.manual_seed(0)
    model, inputs = fn()
    model.load_state_dict(state)
    model.train()
    args, kwargs = split_inputs(inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(model(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def parity_job(job: dict) -> dict:
    """One rank of a parity run (module docstring)."""
    import torch.distributed as dist

    from cauto.profiler.capture import split_inputs
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh
    from cauto.runtime.verify import verify_step

    fn, steps = MODELS[job["model"]], job["steps"]
    torch.manual_seed(0)
    ref, inputs = fn()
    if getattr(getattr(ref, "config", None), "use_cache", False):
        ref.config.use_cache = False
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    del ref
    mixed = job.get("mixed_precision", "bf16") != "none"
    ref_losses, ref_params = eager_run(fn, state, steps, autocast=mixed)
    out: dict = {}
    if dist.get_rank() == 0 and mixed:
        fp32_losses, fp32_params = eager_run(fn, state, steps, autocast=False)
        out["fp32_vs_autocast"] = {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(fp32_losses, ref_losses)),
                                   "param_rel": _param_rel(fp32_params, ref_params)}
    mesh = make_mesh(job["plan"]["mesh"]["shape"], job["plan"]["mesh"]["axis_names"])
    model = apply(fn, job["plan"], mesh, state_dict=state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args, kwargs = split_inputs(inputs)
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(*args, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    out["loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    out["param_rel"] = _param_rel({k: _full(p).detach() for k, p in model.named_parameters()}, ref_params)
    out["loss_dtype"] = str(loss.dtype)
    out["bf16_casts"] = model.lowered.code().count("torch.bfloat16") if model.lowered is not None else None
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()}
                           | {str(v.dtype) for s in opt.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor) and v.dim()})
    report = verify_step(model, (args, kwargs), opt)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, report["peak_bytes"]["measured"])
    out["peak_predicted"] = report["peak_bytes"]["predicted"]
    out["peak_measured"] = peaks
    out["peak_worst_rel"] = max(abs(p / out["peak_predicted"] - 1) for p in peaks)
    out["collectives"] = {ph: report[ph] for ph in ("forward", "backward")}
    out["collectives_equal"] = all(report[ph]["predicted"] == report[ph]["executed"] for ph in ("forward", "backward"))
    out["backward_collective_dtypes"] = _collective_dtypes(model.lowered.graphs.get("backward")) \
        if model.lowered is not None else {}
    out["grad_sync"] = report["grad_sync"]
    out["grad_sync_bytes_equal"] = report["grad_sync"]["predicted_bytes"] == report["grad_sync"]["executed_bytes"]
    out["step_s"] = statistics.median(times[2:]) if len(times) > 2 else times[-1]
    return out


def _collective_dtypes(gm) -> dict:
    """{dtype: count} of the tensors the collectives of a lowered graph move (their first tensor argument)."""
    counts: dict = {}
    for node in gm.graph.nodes if gm is not None else ():
        if node.op == "call_function" and "_c10d_functional" in str(node.target) and "wait" not in str(node.target):
            val = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
            key = str(getattr(val, "dtype", None))
            counts[key] = counts.get(key, 0) + 1
    return counts


def _param_rel(got: dict, want: dict) -> float:
    """The relative distance of the fp32 master weights over the whole model: ||got - want|| / ||want||
    (Frobenius over every parameter; one parameter's largest entry is meaningless for biases near 0)."""
    diff = sum(float((got[k].float() - w).pow(2).sum()) for k, w in want.items())
    norm = sum(float(w.pow(2).sum()) for w in want.values())
    return (diff / norm) ** 0.5


def speed_job(job: dict) -> dict:
    """One rank of the --speed run: every setup in turn each round (module docstring)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    sys.path.insert(0, str(HERE))
    from bench_gpt_plans import build_cauto, peak_bytes, time_interleaved

    rank = dist.get_rank()
    torch.manual_seed(0)
    _, batch = speed_gpt()
    quarter = {k: v.chunk(WORLD)[rank] for k, v in batch.items()}
    setups = {}
    for label, path in job["plans"].items():
        setups[label] = build_cauto(path, speed_gpt)
    for label, mp in (("FSDP2 fp32", None),
                      ("FSDP2 bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
        torch.manual_seed(0)
        model = speed_gpt()[0]
        kw = {} if mp is None else {"mp_policy": mp}
        for block in model.blocks:
            fully_shard(block, **kw)
        setups[label] = (fully_shard(model, **kw), quarter)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _) in setups.items()}

    stepper, times = time_interleaved(setups, opts, job["rounds"])
    peaks = {name: peak_bytes(stepper(name), setups[name][0], opts[name], setups[name][1]) for name in setups}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, peaks)
    return {"times": {k: statistics.median(v) for k, v in times.items()},
            "peaks": {k: max(g[k] for g in gathered) for k in peaks}}


def worker(argv: list[str]) -> None:
    """One rank: ``--worker RANK PORT JOBS.json OUT``; writes OUT.RANK with each job's result or error."""
    import traceback

    import torch.distributed as dist

    rank, port, jobs_path, out = int(argv[0]), argv[1], argv[2], argv[3]
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    results = {}
    for job in json.loads(Path(jobs_path).read_text()):
        try:
            results[job["name"]] = speed_job(job) if job.get("speed") else parity_job(job)
        except Exception:
            results[job["name"]] = {"error": traceback.format_exc()[-3000:]}
        Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_jobs(jobs: list[dict], timeout_s: float) -> dict:
    """Run ``jobs`` on 4 gloo ranks (this script's worker); rank 0's results by job name."""
    from cauto.runtime.dist_utils import free_port

    with tempfile.TemporaryDirectory() as tmp:
        jobs_path, out = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        jobs_path.write_text(json.dumps(jobs))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(r), port,
                                   str(jobs_path), str(out)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
        logs = []
        try:
            deadline = time.monotonic() + timeout_s
            for p in procs:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        finally:
            for p in procs:
                p.kill()
        result = Path(f"{out}.0")
        if not result.exists():
            raise RuntimeError("rank 0 wrote nothing:\n" + "\n".join(log[-2000:] for log in logs))
        return json.loads(result.read_text())


def parity(models: list[str], meshes: list[str], steps: int, mixed_precision: str = "bf16",
           timeout_s: float = 1800.0, reduce_dtype: str = "fp32") -> dict:
    """{model/mesh: parity_job's result} (module docstring); ``mixed_precision="none"``: the same for fp32
    plans against eager fp32 (the peak error of the fp32 path, for comparison); ``reduce_dtype="bf16"``:
    the bf16 plans' gradients reduced in bf16."""
    jobs = [{"name": f"{m}/{k}", "model": m, "steps": steps, "mixed_precision": mixed_precision,
             "plan": bf16_plan(m, k, mixed_precision=mixed_precision, reduce_dtype=reduce_dtype)}
            for m in models for k in meshes]
    return run_jobs(jobs, timeout_s)


def speed(rounds: int, out_dir: str) -> dict:
    """The --speed run's {"times", "peaks"} (module docstring)."""
    plans = {}
    for label, mp in (("cauto fp32", "none"), ("cauto bf16", "bf16")):
        doc = bf16_plan("speed_gpt", "4", fraction=None, mixed_precision=mp)
        plans[label] = str(Path(out_dir) / f"{mp}.plan.json")
        Path(plans[label]).write_text(json.dumps(doc))
    return run_jobs([{"name": "speed", "speed": True, "plans": plans, "rounds": rounds}], 3600.0)["speed"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default="gpt,gpt2,vit")
    parser.add_argument("--meshes", default="4,2x2")
    parser.add_argument("--mixed-precision", default="bf16", choices=["bf16", "none"])
    parser.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.speed:
        with tempfile.TemporaryDirectory() as tmp:
            result = speed(args.rounds, tmp)
        for k in result["times"]:
            print(f"{k:12s} step {result['times'][k] * 1e3:8.1f} ms  peak {result['peaks'][k] / MiB:8.2f} MiB")
    else:
        result = parity(args.models.split(","), args.meshes.split(","), args.steps, args.mixed_precision,
                        reduce_dtype=args.reduce_dtype)
        for k, r in result.items():
            if "error" in r:
                print(f"{k:10s} ERROR {r['error'].splitlines()[-1]}")
                continue
            ref = r.get("fp32_vs_autocast", {})
            print(f"{k:10s} loss rel {r['loss_rel']:.2e} params rel {r['param_rel']:.2e} "
                  f"(fp32 vs autocast: {ref.get('loss_rel', float('nan')):.2e} / {ref.get('param_rel', float('nan')):.2e})"
                  f"  peak pred {r['peak_predicted'] / MiB:.3f} MiB worst |meas/pred-1| {r['peak_worst_rel']:.3f}"
                  f"  collectives {'equal' if r['collectives_equal'] else 'DIFF ' + json.dumps(r['collectives'])}"
                  f"  grad sync {r['grad_sync']['executed_bytes']} B ({'as' if r['grad_sync_bytes_equal'] else 'NOT as'} planned)"
                  f"  dtypes {r['dtypes']} loss {r['loss_dtype']} bf16 casts {r['bf16_casts']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
