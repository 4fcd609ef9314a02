"""`cauto run`: launch the runtime on N local processes through torchrun.

    cauto run TARGET --plan plan.json --nproc 4 [--steps 3] [--verify] [-- <extra torchrun flags>]

Multi-host jobs pass torchrun's own flags after `--` (``--nnodes 2 --node-rank 0
--rdzv-endpoint host:port``); everything else is what ``python -m cauto.runtime.launch`` takes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def torchrun_command(target: str, plan: str, nproc: int, steps: int, verify: bool, extra: list[str],
                     launch_args: list[str] | None = None) -> list[str]:
    """The torchrun command line that runs ``target`` with ``plan`` on ``nproc`` local processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *extra,
           "-m", "cauto.runtime.launch", target, "--plan", plan, "--steps", str(steps)]
    if verify:
        cmd.append("--verify")
    return cmd + list(launch_args or [])


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, check the plan file exists, run torchrun; return its exit code (2 on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="cauto run", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="model factory: path/file.py:fn or pkg.module:fn")
    parser.add_argument("--plan", required=True, help="plan.json from `cauto plan`")
    parser.add_argument("--nproc", type=int, required=True, help="processes on this host (= mesh size per host)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--verify", action="store_true", help="print predicted vs measured collectives and peak")
    parser.add_argument("--batch", type=int, help="passed to the factory as batch= (as for `cauto profile`)")
    parser.add_argument("--seq", type=int, help="passed to the factory as seq= (as for `cauto profile`)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    if not Path(args.plan).is_file():
        print(f"cauto run: plan file {args.plan!r} not found; create one with `cauto plan GRAPH -o plan.json`",
              file=sys.stderr)
        return 2
    if args.nproc < 1:
        print("cauto run: --nproc must be at least 1", file=sys.stderr)
        return 2
    sizes = [f"--{k}={v}" for k, v in (("batch", args.batch), ("seq", args.seq)) if v is not None]
    return subprocess.call(torchrun_command(args.target, args.plan, args.nproc, args.steps, args.verify, extra, sizes))
