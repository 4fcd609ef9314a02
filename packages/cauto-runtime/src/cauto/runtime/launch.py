"""``torchrun --nproc-per-node N -m cauto.runtime.launch TARGET --plan plan.json --steps K [--verify]``.

Trains the model of factory TARGET ("pkg.module:fn") for K AdamW steps under the plan, on gloo
(CPU) or NCCL (CUDA), every rank passing the factory's example batch (global-batch mode). Process
groups get a collective timeout, and a rank that fails prints its error and makes the job exit
non-zero: a failing rank never leaves the others hanging past the timeout.

The optimizer is the one ``apply`` builds (``model.optimizer``): torch's AdamW for a plan that keeps
state on the device, the chunk manager's ChunkedAdam (AdamW arithmetic) for a plan with chunked
state. ``--verify`` on a chunked plan reports the chunk manager's predicted vs measured host link
bytes, arena, non-model peak and chunks in use, and the step's collectives per op (the JSON goes
to ``--measured-out`` as for other plans).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="cauto.runtime.launch", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="model factory, e.g. cauto.profiler.zoo:gpt")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout")
    parser.add_argument("--verify", action="store_true", help="print predicted vs executed collectives and peak memory")
    parser.add_argument("--measured-out", help="where --verify writes its JSON report (default: PLAN.measured.json)")
    parser.add_argument("--batch", type=int, help="passed to the factory as batch= (as for cauto-profile)")
    parser.add_argument("--seq", type=int, help="passed to the factory as seq= (as for cauto-profile)")
    parser.add_argument("--compile", action="store_true",
                        help="run the local program's forward and backward graphs compiled by inductor")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from cauto.plan import load_plan
    from cauto.profiler.capture import split_inputs
    from cauto.profiler.target import bind_sizes, load_target
    from cauto.runtime.apply import apply
    from cauto.runtime.chunked import ChunkedParallelModule, chunk_report, format_chunk_report
    from cauto.runtime.dist_utils import init_distributed, make_mesh
    from cauto.runtime.verify import format_report, verify_step

    rank = 0
    try:
        init_distributed(args.timeout_s)
        rank = dist.get_rank()
        plan = load_plan(args.plan)
        mesh = make_mesh(plan.mesh["shape"], plan.mesh["axis_names"])
        fn = bind_sizes(load_target(args.target), {"batch": args.batch, "seq": args.seq})
        model = apply(fn, plan, mesh, seed=args.seed, compile=args.compile,
                      optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=args.lr))
        torch.manual_seed(args.seed)
        with torch.device("cpu"):
            _, example = fn()
        inputs = split_inputs(example)
        opt = model.optimizer
        for step in range(args.steps):
            start = time.perf_counter()
            loss = model(*inputs[0], **inputs[1])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if rank == 0:  # `cauto run` draws its step bar from this line (cauto.cli.run.STEP_LINE)
                print(f"step {step + 1}/{args.steps} loss {loss.item():.5f} time {time.perf_counter() - start:.3f} s", flush=True)
        if args.verify and (isinstance(model, ChunkedParallelModule) or getattr(model, "manager", None) is not None):
            report = chunk_report(model, inputs)
            if rank == 0:
                print(format_chunk_report(report, rank), flush=True)
                measured_path = Path(args.measured_out or Path(args.plan).with_suffix(".measured.json"))
                measured_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
                print(f"measured figures written to {measured_path}", flush=True)
        elif args.verify:
            report = verify_step(model, inputs, opt)
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            mine = torch.tensor([report["peak_bytes"]["measured"]], dtype=torch.int64, device=device)
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            report["peak_bytes"]["measured_per_rank"] = [int(t.item()) for t in every]
            if rank == 0:
                print(format_report(report, rank), flush=True)
                measured_path = Path(args.measured_out or Path(args.plan).with_suffix(".measured.json"))
                measured_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
                print(f"measured figures written to {measured_path} (cauto explain shows them)", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except Exception:
        # Exit without waiting for the other ranks: torchrun then stops them, and any rank blocked in
        # a collective with this one fails after the process group's timeout at the latest.
        print(f"[rank {rank}] cauto launch failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
