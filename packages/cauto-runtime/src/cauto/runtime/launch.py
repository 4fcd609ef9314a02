"""``torchrun --nproc-per-node N -m cauto.runtime.launch TARGET --plan plan.json --steps K [--verify]``.

Trains the model of factory TARGET ("pkg.module:fn") for K AdamW steps under the plan, on gloo
(CPU) or NCCL (CUDA), every rank passing the factory's example batch (global-batch mode). Process
groups get a collective timeout, and a rank that fails prints its error and makes the job exit
non-zero: a failing rank never leaves the others hanging past the timeout. A collective that fails
(timed out, or a peer gone) is reported in one line naming it; other errors with their traceback.
Under `cauto run` each rank keeps a heartbeat (heartbeat.py: phase setup/forward/backward/optimizer,
step) that the command's watchdog reads to end a stalled job and name the rank.

The optimizer is the one ``apply`` builds (``model.optimizer``): torch's AdamW for a plan that keeps
state on the device, the chunk manager's ChunkedAdam (AdamW arithmetic) for a plan with chunked
state. ``--verify`` on a chunked plan reports the chunk manager's predicted vs measured host link
bytes, arena, non-model peak and chunks in use, and the step's collectives per op (the JSON goes
to ``--measured-out`` as for other plans).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

from cauto.runtime.heartbeat import Heartbeat

#: torch.distributed functions whose name says which collective a failing call was in
_COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "barrier", "scatter",
                "gather", "reduce", "send", "recv")


def collective_failure(exc: BaseException, timeout_s: float) -> str | None:
    """One line for an error raised inside a torch.distributed collective (None for any other error):
    which collective, and whether it timed out or lost a peer."""
    text = str(exc)
    name = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith("<eval_with_key") and "_c10d_functional" in (frame.line or ""):
            # the local program (lowering.py): the failing line waits for or issues a functional collective
            line = (frame.line or "").replace("wait_tensor", "")
            found = next((c for c in _COLLECTIVES if c in line), None)
            name = name or found
            continue
        if f"torch{os.sep}distributed" in frame.filename:
            base = frame.name.lstrip("_").removesuffix("_into_tensor").removesuffix("_tensor").removesuffix("_single")
            if name is None and base in _COLLECTIVES:
                name = base
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    lost = any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe"))
    if not (timed_out or lost) or (name is None and "gloo" not in text.lower() and "nccl" not in text.lower()):
        return None
    what = f"collective {name}" if name else "a collective"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # gloo's "[file.cc:123] " prefix, first sentence
    why = f"timed out after {timeout_s:g} s (a peer rank stalled or died)" if timed_out and not lost else \
        "lost a peer (its connection closed: that rank died or was killed)"
    return f"{what} {why}: {first}"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.accumulate < 1:
        parser.error("--accumulate must be at least 1")

    import torch
    import torch.distributed as dist

    from cauto.plan import load_plan
    from cauto.profiler.capture import split_inputs
    from cauto.profiler.target import bind_sizes, load_target
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import init_distributed, make_mesh

    rank = 0
    beat = Heartbeat.from_env()
    try:
        init_distributed(args.timeout_s)
        rank = dist.get_rank()
        beat.enter("setup")
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
        first = model.load(args.resume) if args.resume else 0
        if rank == 0 and args.resume:
            print(f"resumed from step {first} ({args.resume})", flush=True)
        _train(args, model, opt, inputs, first, beat, rank)
        beat.enter("verify" if args.verify else "finish")
        if args.verify:
            _verify(args, model, opt, inputs, rank)
        dist.barrier()
        dist.destroy_process_group()
        beat.end("done")
        return 0
    except Exception as exc:
        # Exit without waiting for the other ranks: torchrun then stops them, and any rank blocked in
        # a collective with this one fails after the process group's timeout at the latest.
        where = beat.state["phase"] + (f" (step {beat.state['step']})" if beat.state["step"] else "")
        line = collective_failure(exc, args.timeout_s)
        if line is not None:
            print(f"[rank {rank}] {line} in {where}", file=sys.stderr, flush=True)
        else:
            line = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            print(f"[rank {rank}] cauto launch failed in {where}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        beat.end("failed", line)
        return 1


def _parser() -> argparse.ArgumentParser:
    """The launcher's arguments."""
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
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per optimizer step (the example batch each; all but the last under no_sync)")
    parser.add_argument("--max-norm", type=float, help="clip the global gradient norm (model.clip_grad_norm_)")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (with --save-dir)")
    parser.add_argument("--save-dir", help="where checkpoints go (DIR/step-N, complete or absent)")
    parser.add_argument("--resume", help="a checkpoint folder (or a --save-dir) to resume training from")
    return parser


def _train(args: argparse.Namespace, model, opt, inputs, first: int, beat: Heartbeat, rank: int) -> None:
    """Steps ``first`` to ``args.steps``: micro-batches, clipping, the optimizer step, rank 0's step line
    and the checkpoints, each phase announced to the heartbeat."""
    for step in range(first, args.steps):
        start = time.perf_counter()
        loss = 0.0
        for i in range(args.accumulate):  # all but the last micro-batch without gradient sync
            with model.no_sync() if i < args.accumulate - 1 else contextlib.nullcontext():
                beat.enter("forward", step + 1)
                micro = model(*inputs[0], **inputs[1]) / args.accumulate
                beat.enter("backward", step + 1)
                micro.backward()
            loss += micro.detach()
        beat.enter("optimizer", step + 1)
        if args.max_norm is not None:
            model.clip_grad_norm_(args.max_norm)
        opt.step()
        opt.zero_grad()
        if rank == 0:  # `cauto run` draws its step bar from this line (cauto.cli.run.STEP_LINE)
            print(f"step {step + 1}/{args.steps} loss {loss.item():.9g} time {time.perf_counter() - start:.3f} s", flush=True)
        if args.save_dir and args.save_every and (step + 1) % args.save_every == 0:
            beat.enter("save", step + 1)
            model.save(args.save_dir, step + 1)


def _verify(args: argparse.Namespace, model, opt, inputs, rank: int) -> None:
    """``--verify``: one more step measured against the plan (the chunk report for chunked state); rank 0
    prints it and writes the JSON report."""
    import torch
    import torch.distributed as dist

    from cauto.plan import write_atomic
    from cauto.runtime.chunks.data_parallel import ChunkedParallelModule, chunk_report, format_chunk_report
    from cauto.runtime.verify import format_report, verify_step

    if isinstance(model, ChunkedParallelModule) or getattr(model, "manager", None) is not None:
        report = chunk_report(model, inputs)
        if rank == 0:
            print(format_chunk_report(report, rank), flush=True)
            measured_path = Path(args.measured_out or Path(args.plan).with_suffix(".measured.json"))
            write_atomic(measured_path, json.dumps(report, indent=1, default=str) + "\n")
            print(f"measured figures written to {measured_path}", flush=True)
    else:
        report = verify_step(model, inputs, opt, accumulate=args.accumulate)
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mine = torch.tensor([report["peak_bytes"]["measured"]], dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        report["peak_bytes"]["measured_per_rank"] = [int(t.item()) for t in every]
        if rank == 0:
            print(format_report(report, rank), flush=True)
            measured_path = Path(args.measured_out or Path(args.plan).with_suffix(".measured.json"))
            write_atomic(measured_path, json.dumps(report, indent=1, default=str) + "\n")
            print(f"measured figures written to {measured_path} (cauto explain shows them)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
