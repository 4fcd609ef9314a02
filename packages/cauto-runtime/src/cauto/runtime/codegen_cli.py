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
from cauto.plan.execution import regathers_params
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
    from cauto.runtime.codegen import render
    from cauto.runtime.dist_utils import make_mesh

    plan = load_plan(plan_path)
    from cauto.runtime.apply import compute_dtype

    cap = capture(target, autocast=compute_dtype(plan))  # the plan must belong to this model first
    check_plan_against_graph(plan.to_dict(), cap.structure(), cap.fingerprint(), source=str(plan_path))
    world = 1
    for s in plan.mesh["shape"]:
        world *= s
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = make_mesh(plan.mesh["shape"], plan.mesh["axis_names"])
    chunked = {pid for pid, entry in plan.params.items() if entry.get("state") == "chunked"}
    check_fits(cap, plan, mesh, chunked_ok=bool(chunked) and plan.execution["mode"] == "program")
    executable = execute.build(cap, plan, mesh, torch.device("cpu"), chunked=chunked)
    lowered = None if chunked else local_program_of(cap, plan, mesh, executable)
    return render(executable, plan, lowered)


def local_program_of(cap, plan, mesh, executable):
    """The plan's local program, traced from metadata alone (parameters on meta), as ``apply`` lowers it."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    from cauto.runtime.dist_utils import local_slices, to_placements
    from cauto.runtime.lowering import LocalProgram

    state, inputs = [], []
    for node in cap.graph.nodes:
        if node.op != "placeholder":
            continue
        kind, _ = cap.placeholders[node.name]
        val = node.meta["val"]
        if kind == "input":
            inputs.append((tuple(val.shape), val.dtype))
            continue
        pid = node.name if node.name in plan.params else cap.tied.get(node.name)
        placements = to_placements(tuple(plan.params[pid]["placements"])) if kind == "param" and pid in plan.params \
            else (Replicate(),) * mesh.ndim
        shape = tuple(val.shape)
        local_shape = tuple(s.stop - s.start for s in local_slices(shape, placements, mesh))
        local = torch.empty(local_shape, dtype=val.dtype, device="meta")
        dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                stride=torch.empty(shape, device="meta").stride())
        state.append(torch.nn.Parameter(dt, requires_grad=kind == "param") if kind == "param" else dt)
    every_replicated = all(all(isinstance(q, Replicate) for q in x.placements) for x in state
                           if isinstance(x, torch.nn.Parameter))
    plain = {i for i, x in enumerate(state) if isinstance(x, torch.nn.Parameter)} if every_replicated else set()
    if plain:  # data parallel: the runtime keeps these parameters plain (apply._replicated_as_plain)
        state = [torch.nn.Parameter(x._local_tensor, requires_grad=True) if i in plain else x
                 for i, x in enumerate(state)]
    lowered = LocalProgram(executable.module, mesh, plain=plain, plan_nodes=plan.nodes,
                           regather=regathers_params(plan.execution))
    lowered.prepare(state, inputs)
    return lowered


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
