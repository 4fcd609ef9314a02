"""`cauto-solve`: plan a graph document on a mesh, or explain a plan.

    cauto-solve GRAPH --mesh 2x4 [--axis-names dp,tp] [--cluster FILE|PRESET] [--memory 70GiB]
                [--checkpoint none|auto|rotor|chen] [--offload none|auto|chunked] [--offload-axes dp|0,1] [--regather]
                [--solver cbc|highs] [--time-limit S] -o plan.json
    cauto-solve explain PLAN [--graph GRAPH]

Bad input (invalid documents, a bad mesh, an unknown preset) exits with status 2 and one line on
stderr; an infeasible memory budget also exits 2, naming the least memory needed. No partial plan file
is ever left behind (cauto.plan.dump writes atomically, and only after solving).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from cauto.plan import (
    DocumentError,
    MismatchError,
    OutputError,
    check_output,
    check_plan_matches_graph,
    dump,
    load,
    load_graph,
)
from cauto.plan.options import CHECKPOINT_METHODS, OFFLOAD_MODES, SOLVERS
from cauto.plan.units import ByteSizeError, parse_bytes
from cauto.solver.cluster import PRESETS, cluster_for_mesh, load_hardware, parse_mesh
from cauto.solver.errors import InfeasibleBudgetError, SolverError
from cauto.solver.summary import explain, summary


def parse_axes(text: str, axis_names: tuple[str, ...]) -> tuple[int, ...]:
    """'dp' or '0,1' -> mesh axis indices (names as in ``axis_names``); the solver checks the rest."""
    axes = []
    for item in (s.strip() for s in (text or "").split(",")):
        if item in axis_names:
            axes.append(axis_names.index(item))
        elif item.isdigit():
            axes.append(int(item))
        else:
            raise SolverError(f"offload axis {item!r} is neither an axis index nor one of the axis names "
                              f"{', '.join(axis_names)} (give e.g. --offload-axes 0 or --offload-axes {axis_names[0]})")
    return tuple(axes)


def budget_bytes(text: str) -> int:
    """``--memory``: cauto.plan.units.parse_bytes, a bad size raising SolverError (one line, exit 1)."""
    try:
        return parse_bytes(text)
    except ByteSizeError as exc:
        raise SolverError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit 2 with one line, as argparse does, but never a traceback
        self.exit(2, f"{self.prog}: error: {message}\n")


def _solve_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cauto-solve", description="Plan a profiled graph on a device mesh (writes a plan document).")
    p.add_argument("graph", help="graph document (JSON) written by the profiler")
    p.add_argument("--mesh", required=True, help="mesh shape, e.g. 8, 2x4, 2x2x2")
    p.add_argument("--axis-names", help="comma-separated mesh axis names (default dp / dp,tp / a0,dp,tp)")
    p.add_argument("--cluster", default="cpu-gloo",
                   help=f"preset ({', '.join(sorted(PRESETS))}) or spec file from tools/calibrate.py")
    p.add_argument("--devices-per-node", type=int,
                   help="devices (ranks) per host, overriding the cluster's: mesh axes laid out row-major that span "
                        "more than one host are priced with the inter-node link (for `cauto run --nnodes`)")
    p.add_argument("--memory", help="per-device memory budget, e.g. 70GiB (default: the device's memory)")
    p.add_argument("--checkpoint", default="none", choices=list(CHECKPOINT_METHODS),
                   help="activation checkpointing: none, or solved jointly with sharding (auto picks rotor or chen)")
    p.add_argument("--offload", default="none", choices=list(OFFLOAD_MODES),
                   help="hand data-parallel model state to the runtime's chunk manager (host offload, ZeRO): "
                        "auto only when no plan fits on the device, chunked always")
    p.add_argument("--offload-axes",
                   help="comma-separated mesh axes (indices or names) the chunks are ZeRO-sharded over, the "
                        "others left to tensor parallelism (default: the fastest of every axis and each one alone)")
    p.add_argument("--mixed-precision", default="none", choices=["none", "bf16", "fp16"],
                   help="bf16: plan for bf16 autocast compute over fp32 master weights (the graph must be profiled "
                        "with --autocast bf16); fp16 is refused (no loss scaling)")
    p.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="dtype of the gradient reductions under --mixed-precision bf16 (default fp32)")
    p.add_argument("--regather", action="store_true",
                   help="also search plans that free gathered parameters after forward and gather them again in "
                        "backward (FSDP's reshard after forward); the faster predicted plan that fits wins")
    p.add_argument("--solver", default="cbc", choices=list(SOLVERS))
    p.add_argument("--time-limit", type=float, default=60.0, help="solver time limit in seconds")
    p.add_argument("-o", "--output", required=True, help="where to write the plan document")
    p.add_argument("--replace-symlink", action="store_true",
                   help="replace an output that is a symbolic link with a file (refused otherwise)")
    return p


def _explain_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cauto-solve explain", description="Print a plan's placements per layer.")
    p.add_argument("plan")
    p.add_argument("--graph", help="the graph document, to list op nodes by module too")
    return p


def main(argv: list[str] | None = None, progress=None) -> int:
    """Entry point of `cauto-solve`; returns the exit status. ``progress(phase, done, total)``, when
    given, follows the solve (cauto/solver/progress.py; the `cauto` command draws it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "explain":
            args = _explain_parser().parse_args(argv[1:])
            plan = load(args.plan, "plan")
            graph = load(args.graph, "graph") if args.graph else None
            if graph is not None:
                check_plan_matches_graph(plan, graph)
            print(explain(plan, graph))
            return 0
        args = _solve_parser().parse_args(argv)
        from cauto.solver.checkpoint import summary_lines
        from cauto.solver.planning import plan as make_plan
        from cauto.solver.planning import plan_options

        check_output(args.output, replace_symlink=args.replace_symlink)  # before solving, not after
        shape = parse_mesh(args.mesh)
        names = tuple(s.strip() for s in args.axis_names.split(",")) if args.axis_names else None
        hardware = load_hardware(args.cluster)
        if args.devices_per_node is not None:
            if args.devices_per_node < 1:
                raise SolverError(f"--devices-per-node {args.devices_per_node} must be at least 1")
            hardware = dataclasses.replace(hardware, devices_per_node=args.devices_per_node)
        cluster = cluster_for_mesh(hardware, shape, names)
        budget = budget_bytes(args.memory) if args.memory is not None else None  # '' is a bad size, not the default
        offload_axes = parse_axes(args.offload_axes, cluster.axis_names) if args.offload_axes is not None else None
        graph = load_graph(args.graph)
        options = plan_options(memory_budget=budget, checkpoint=args.checkpoint, time_limit_s=args.time_limit,
                               solver=args.solver, offload=args.offload, offload_axes=offload_axes,
                               mixed_precision=args.mixed_precision, reduce_dtype=args.reduce_dtype,
                               regather=args.regather)
        plan = make_plan(graph, cluster, options, progress=progress)
        dump(plan, args.output, replace_symlink=args.replace_symlink)
        print(summary(plan))
        if "checkpoint" in plan:
            print("\n".join(summary_lines(plan["checkpoint"])))
        print(f"plan written to {args.output}")
        return 0
    except InfeasibleBudgetError as exc:
        print(f"cauto-solve: {exc}", file=sys.stderr)
        return 2
    except (SolverError, DocumentError, MismatchError, OutputError, json.JSONDecodeError, OSError) as exc:
        print(f"cauto-solve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
