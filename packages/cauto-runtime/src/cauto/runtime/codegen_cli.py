"""``cauto-codegen plan.json --target pkg.module:fn -o parallel_model.py``: write the parallel forward.

The code is produced by building the parallel program for the plan on a simulated process group
of the plan's mesh size (one process, no data: parameters are not materialized), so it runs
anywhere; it is the same code ``apply`` executes on each rank.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path


def load_target(spec: str):
    """The factory named by "pkg.module:fn" (a callable returning (model, inputs))."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"--target {spec!r}: expected 'package.module:function'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--target {spec!r}: {exc}") from None


def generate(target, plan_path: str) -> str:
    """Source of the parallel forward of ``target`` under the plan at ``plan_path``."""
    import torch
    import torch.distributed as dist
    from cauto.plan import load_plan
    from cauto.profiler.capture import capture
    from cauto.runtime import execute
    from cauto.runtime.apply import check_fits
    from cauto.runtime.codegen import render
    from cauto.runtime.dist_utils import make_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plan = load_plan(plan_path)
    world = 1
    for s in plan.mesh["shape"]:
        world *= s
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = make_mesh(plan.mesh["shape"], plan.mesh["axis_names"])
    cap = capture(target)
    check_fits(cap, plan, mesh)
    return render(execute.build(cap, plan, mesh, torch.device("cpu")), plan)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="cauto-codegen", description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="plan.json written by the solver")
    parser.add_argument("--target", required=True, help="model factory, e.g. cauto.profiler.zoo:gpt")
    parser.add_argument("-o", "--output", default="-", help="output file ('-': stdout)")
    args = parser.parse_args(argv)
    source = generate(load_target(args.target), args.plan)
    if args.output == "-":
        sys.stdout.write(source)
    else:
        Path(args.output).write_text(source)
        print(f"wrote {args.output} ({len(source.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
