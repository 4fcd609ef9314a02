"""One-command GPU check of cauto's runtime: NCCL, world size 1, the same code path as CPU (~1-2 minutes).

cauto runs the plan as its local program (eager, then ``apply(..., compile=True)``: inductor); the plain
model runs eager, then under ``torch.compile``.

    python tools/gpu/check_runtime.py [--dim 1024 --layers 8 --seq 512 --batch 8]

For the zoo GPT: profile (cauto.profiler, device cuda) -> solve for a 1-device mesh (cauto-solver,
preset h200) -> apply -> 3 AdamW steps on CUDA under NCCL. Falls back to a hand-made plan
(cauto.runtime.handplan) with the profiler's predicted peak when the solver is unavailable.
Prints one table: loss vs the plain single-device model (same initial state), predicted peak bytes
(plan) vs torch.cuda.max_memory_allocated of a step of the cauto model and of the plain model, and
step times of both.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time
import traceback

import torch
import torch.distributed as dist
from cuda_workspaces import warm_cuda_workspaces  # tools/gpu, beside this script


def _steps(loss_fn, opt, n: int) -> tuple[list[float], list[float]]:
    """``n`` AdamW steps; return their wall times (synchronized) and losses."""
    times, losses = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    return times, losses


def _compiled_step_s(module, args_, kwargs) -> str:
    """Median step time of ``torch.compile(module)`` (3 timed steps after 2 warm-up), or why it failed."""
    from cauto.profiler.capture import loss_of

    try:
        compiled = torch.compile(module)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        times = []
        for step in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss_of(compiled(*args_, **kwargs)).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            if step >= 2:
                times.append(time.perf_counter() - t)
        return f"{sorted(times)[1]:.4f}"
    except Exception as exc:  # report, don't stop: one lent-machine run shows everything
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA device"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")

    from cauto.plan import load_plan
    from cauto.profiler import capture, profile
    from cauto.profiler.capture import loss_of, split_inputs
    from cauto.profiler.zoo import gpt
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import init_distributed, make_mesh
    from cauto.runtime.verify import format_report, verify_step

    init_distributed(120)
    mesh = make_mesh((1,), ("dp",))
    fn = lambda: gpt(batch=args.batch, seq=args.seq, vocab=args.vocab, dim=args.dim, layers=args.layers,  # noqa: E731
                     heads=args.heads)
    prof = profile(fn, device="cuda")
    try:
        from cauto.profiler.graphdoc import build_graph_document
        from cauto.solver import cluster_for_mesh, solve
        plan = load_plan(solve(build_graph_document(prof), cluster_for_mesh("h200", (1,))))
        source = "cauto-solver"
    except Exception as exc:
        traceback.print_exc()
        from cauto.runtime.handplan import make_plan
        plan = load_plan(make_plan(capture(fn), mesh, inputs="R", peak_bytes=prof.peak_bytes))
        source = f"hand-made (solver failed: {type(exc).__name__})"
    workspace = warm_cuda_workspaces()

    def build():
        torch.manual_seed(0)
        with torch.device("cuda"):
            return fn()

    # cauto first, alone on the device: the plain model is built only after it is freed, so each
    # peak is of one model (both on the GPU at once added the other's state: +2.2 GiB, the first run).
    ref, inputs = build()
    state = {k: v.detach().cpu() for k, v in ref.state_dict().items()}  # on the host: no GPU bytes in a peak
    del ref
    args_, kwargs = split_inputs(inputs)
    model = apply(fn, plan, mesh, state_dict={k: v.cuda() for k, v in state.items()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses = _steps(functools.partial(model, *args_, **kwargs), opt, 3)
    report = verify_step(model, (args_, kwargs), opt)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    # cauto's own compile: the local program's forward and backward graphs through inductor
    try:
        model = apply(fn, plan, mesh, state_dict={k: v.cuda() for k, v in state.items()}, compile=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ctimes, closses = _steps(functools.partial(model, *args_, **kwargs), opt, 5)
        compiled = f"{sorted(ctimes[2:])[1]:.4f}"
        compiled_loss_diff = max(abs(a - b) for a, b in zip(closses[:3], losses))
    except Exception as exc:  # report, don't stop: one lent-machine run shows everything
        compiled, compiled_loss_diff = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}", float("nan")
        model = opt = None
    gc.collect()
    torch.cuda.empty_cache()

    ref, _ = build()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    times_ref, losses_ref = _steps(lambda: loss_of(ref(*args_, **kwargs)), opt_ref, 3)
    torch.cuda.reset_peak_memory_stats()
    _steps(lambda: loss_of(ref(*args_, **kwargs)), opt_ref, 1)
    plain_peak = torch.cuda.max_memory_allocated()
    compiled_ref = _compiled_step_s(ref, args_, kwargs)

    print(format_report(report))
    print(f"\nplan: {source}; GPT dim {args.dim} L{args.layers} seq {args.seq} batch {args.batch} on "
          f"{torch.cuda.get_device_name()}; cuBLAS workspaces {workspace / 2**20:.1f} MiB (in every measured peak)")
    print("| quantity | cauto | plain single device |\n|---|---:|---:|")
    print(f"| loss after 3 steps | {losses[-1]:.5f} | {losses_ref[-1]:.5f} |")
    print(f"| max loss difference over 3 steps | {max(abs(a - b) for a, b in zip(losses, losses_ref)):.2e} | |")
    print(f"| predicted peak (MiB) | {report['peak_bytes']['predicted'] / 2**20:.1f} | |")
    print(f"| max_memory_allocated of a step (MiB) | {report['peak_bytes']['measured'] / 2**20:.1f} | "
          f"{plain_peak / 2**20:.1f} |")
    print(f"| same, less cuBLAS workspaces (MiB) | {(report['peak_bytes']['measured'] - workspace) / 2**20:.1f} | "
          f"{(plain_peak - workspace) / 2**20:.1f} |")
    print(f"| step time eager (s, last of 3) | {times[-1]:.4f} | {times_ref[-1]:.4f} |")
    print(f"| step time compiled (s, median of 3 after 2 warm-up) | {compiled} | {compiled_ref} |")
    print(f"| compiled vs eager max loss difference (3 steps) | {compiled_loss_diff:.2e} | |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
