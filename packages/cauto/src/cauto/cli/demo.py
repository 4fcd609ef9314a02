"""`cauto demo`: the end-to-end main job on a built-in default.

Profiles a small GPT symbolically, solves a plan for 4 CPU ranks (gloo) under a memory budget,
trains it for a few steps with torchrun, and prints predicted vs measured memory and collectives.
Everything is written to ``--out`` (default ./cauto-demo): graph.json, plan.json,
parallel_model.py and report.html (written again after training, with the measured per-rank
peaks). Profiling and planning draw progress bars on stderr, training a step bar (cauto.cli.run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from cauto.profiler.zoo import gpt

DEMO_TARGET = "cauto.cli.demo:demo_gpt"


def demo_gpt():
    """The demo model: a 4-layer GPT (d=128, vocab 512), batch 16 x 64 tokens."""
    return gpt(batch=16, seq=64, vocab=512, dim=128, layers=4, heads=4)


def _section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return 0 on success, the failing step's exit code otherwise."""
    parser = argparse.ArgumentParser(prog="cauto demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cauto-demo", help="folder for graph.json, plan.json, code and report")
    parser.add_argument("--nproc", type=int, default=4, help="CPU ranks (gloo)")
    parser.add_argument("--mesh", default=None, help="mesh shape, default: the number of ranks (1-D)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="train with the local program compiled by inductor")
    parser.add_argument("--memory", default=None, help="per-rank budget, e.g. 200MiB (default: none)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = args.mesh or str(args.nproc)
    started = time.perf_counter()

    _section("1/4 profile (fake tensors, nothing allocated)")
    from cauto.cli.progress import plan_bars, profile_bars
    from cauto.profiler.cli import main as profile_main

    with profile_bars() as bars:
        rc = profile_main([DEMO_TARGET, "-o", str(out / "graph.json"), "--depth", "2"], progress=bars)
    if rc:
        return rc

    _section(f"2/4 plan for mesh {mesh} on cpu-gloo")
    from cauto.solver.cli import main as solve_main

    solve_args = [str(out / "graph.json"), "--mesh", mesh, "--cluster", "cpu-gloo", "-o", str(out / "plan.json")]
    if args.memory:
        solve_args += ["--memory", args.memory]
    with plan_bars(60.0) as bars:
        rc = solve_main(solve_args, progress=bars)
    if rc:
        return rc

    _section("3/4 generated parallel code")
    from cauto.runtime.codegen_cli import main as codegen_main

    rc = codegen_main([str(out / "plan.json"), "--target", DEMO_TARGET, "-o", str(out / "parallel_model.py")])
    if rc:
        return rc
    from cauto.cli.explain import write_html

    (out / "plan.measured.json").unlink(missing_ok=True)  # a previous demo's measurements are not this plan's
    write_html(out / "plan.json", out / "graph.json", out / "report.html")
    print(f"wrote {out / 'parallel_model.py'} and {out / 'report.html'}")

    _section(f"4/4 train {args.steps} steps on {args.nproc} gloo ranks (torchrun), verify predictions")
    from cauto.cli.run import run_torchrun, torchrun_command

    cmd = torchrun_command(DEMO_TARGET, str(out / "plan.json"), args.nproc, args.steps, True, [], compile=args.compile)
    rc = run_torchrun(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if rc == 0:
        write_html(out / "plan.json", out / "graph.json", out / "report.html")
        print(f"wrote {out / 'report.html'} again, with the measured peaks per rank")
    print(f"\ncauto demo finished in {time.perf_counter() - started:.0f} s (exit {rc}); files in {out}/")
    return rc


if __name__ == "__main__":
    sys.exit(main())
