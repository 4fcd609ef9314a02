"""``cauto-codegen plan.json --target pkg.module:fn -o parallel_model.py``: write the parallel forward.

The code is produced by building the parallel program for the plan on a simulated process group
of the plan's mesh size (one process, no data: parameters are not materialized), so it runs
anywhere; it is the same code ``apply`` executes on each rank. A plan with chunked state beside
tensor parallelism shows its ``fetch_chunked``/``release_chunked`` calls; a pure data-parallel plan
with chunked state has no program (the model runs as written) and is refused.
"""

from __future__ import annotations

import argparse
import sys

from cauto.plan import DocumentError, MismatchError, check_output, write_atomic
from cauto.profiler.capture import CaptureError
from cauto.profiler.target import UsageError, bind_sizes, load_target


def generate(target, plan_path: str) -> str:
    """Source of the parallel forward of ``target`` under the plan at ``plan_path``."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cauto.plan import load_plan
    from cauto.plan.validate import check_plan_against_graph
    from cauto.profiler.capture import capture
    from cauto.runtime import execute
    from cauto.runtime.apply import check_fits
    from cauto.runtime.chunked_program import is_pure_data_parallel
    from cauto.runtime.codegen import render
    from cauto.runtime.dist_utils import make_mesh

    plan = load_plan(plan_path)
    cap = capture(target)  # the plan must belong to this model before anything is built for it
    check_plan_against_graph(plan.to_dict(), cap.structure(), cap.fingerprint(), source=str(plan_path))
    world = 1
    for s in plan.mesh["shape"]:
        world *= s
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = make_mesh(plan.mesh["shape"], plan.mesh["axis_names"])
    chunked = {pid for pid, entry in plan.params.items() if entry.get("state") == "chunked"}
    check_fits(cap, plan, mesh, chunked_ok=bool(chunked) and not is_pure_data_parallel(plan))
    return render(execute.build(cap, plan, mesh, torch.device("cpu"), chunked=chunked), plan)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="cauto-codegen", description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="plan.json written by the solver")
    parser.add_argument("--target", required=True, help="model factory, e.g. cauto.profiler.zoo:gpt")
    parser.add_argument("-o", "--output", default="-", help="output file ('-': stdout)")
    parser.add_argument("--batch", type=int, help="passed to the factory as batch= (as for cauto-profile)")
    parser.add_argument("--seq", type=int, help="passed to the factory as seq= (as for cauto-profile)")
    parser.add_argument("--replace-symlink", action="store_true",
                        help="replace an output that is a symbolic link with a file (refused otherwise)")
    args = parser.parse_args(argv)
    try:
        if args.output != "-":
            check_output(args.output, replace_symlink=args.replace_symlink)
        fn = bind_sizes(load_target(args.target), {"batch": args.batch, "seq": args.seq})
        source = generate(fn, args.plan)
        if args.output == "-":
            sys.stdout.write(source)
            return 0
        write_atomic(args.output, source, replace_symlink=args.replace_symlink)
    except (UsageError, DocumentError, MismatchError, CaptureError, ValueError) as exc:  # OutputError included
        print(f"cauto-codegen: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({len(source.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
