"""`cauto explain PLAN [--graph GRAPH] [--html report.html]`: what the plan does and why.

With --graph the plan must belong to that graph (same fingerprint, its nodes and tensors): a graph
of another model is refused (exit 2) rather than explained wrongly.

Prints the solver's per-layer placement table and predictions; with --html writes a
self-contained page: the unsharded memory timeline (from --graph) beside the plan's predicted
memory per device (check point by check point when --graph is given, else model state +
activations), the budget, the measured per-rank peaks when PLAN.measured.json (from
`cauto run --verify`) lies beside the plan, and the placement table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cauto.cli.report_html import render_report
from cauto.plan import (
    DocumentError,
    MismatchError,
    OutputError,
    check_output,
    check_plan_matches_graph,
    load,
    write_atomic,
)


def measured_for(plan_path: str | Path) -> dict | None:
    """The figures `cauto run --verify` wrote beside the plan (PLAN.measured.json), if any."""
    path = Path(plan_path).with_suffix(".measured.json")
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        return report if isinstance(report, dict) and ("peak_bytes" in report or "moved_bytes" in report) else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


_CHUNK_FIGURES = {"moved_bytes": "host link per step", "arena_bytes": "chunk arena",
                  "nonmodel_peak_bytes": "non-model peak", "working_set_bytes": "chunks in use at once"}


def _chunk_lines(report: dict) -> list[str]:
    """Predicted vs measured of a plan with chunked state (the chunk manager's report)."""
    lines = ["predicted vs measured (from cauto run --verify, chunked state):"]
    for key, name in _CHUNK_FIGURES.items():
        r = report[key]
        lines.append(f"  {name}: predicted {r['predicted'] / 2**20:.3f} MiB, measured {r['measured'] / 2**20:.3f} MiB")
    coll = report.get("collectives", {})
    for op in sorted(set(coll.get("predicted", {})) | set(coll.get("executed", {}))):
        p, e = coll["predicted"].get(op, 0), coll["executed"].get(op, 0)
        lines.append(f"  {op} per step: predicted {p} executed {e} {'ok' if p == e else 'DIFF'}")
    return lines


def measured_lines(report: dict) -> list[str]:
    """Predicted vs measured, as `cauto run --verify` found them."""
    if "peak_bytes" not in report:
        return _chunk_lines(report)
    pk = report["peak_bytes"]
    per_rank = pk.get("measured_per_rank") or [pk["measured"]]
    lines = ["predicted vs measured (from cauto run --verify):",
             f"  peak per rank: predicted {pk['predicted'] / 2**20:.2f} MiB, measured "
             + ", ".join(f"{m / 2**20:.2f}" for m in per_rank) + " MiB"]
    for phase in ("forward", "backward"):
        got = report.get(phase, {})
        for op in sorted(set(got.get("predicted", {})) | set(got.get("executed", {}))):
            p, e = got["predicted"].get(op, 0), got["executed"].get(op, 0)
            lines.append(f"  {phase:8s} {op:15s} predicted {p:3d} executed {e:3d} {'ok' if p == e else 'DIFF'}")
    return lines


def device_view(plan: dict, graph: dict | None):
    """(the plan's per-device timeline or None, a note saying why there is none or None)."""
    if graph is None:
        return None, "Pass --graph to see the per-device memory check point by check point."
    from cauto.solver import SolverError
    from cauto.solver.memory.timeline import device_timeline

    try:
        return device_timeline(plan, graph), None
    except (SolverError, DocumentError, MismatchError) as exc:
        return None, f"No per-device timeline: {exc}"


def write_html(plan_path: str | Path, graph_path: str | Path | None, html_path: str | Path, *,
               replace_symlink: bool = False) -> Path:
    """Render the HTML report of a plan (and its graph) to ``html_path`` (atomically, cauto.plan.writing);
    return the path."""
    plan = load(plan_path, "plan")
    graph = load(graph_path, "graph") if graph_path else None
    report = measured_for(plan_path)
    measured = {line.split(":")[0].strip(): line.split(":", 1)[1].strip()
                for line in measured_lines(report)[1:] if ":" in line} if report else None
    per_rank = None
    if report and "peak_bytes" in report:
        peak = report["peak_bytes"]
        per_rank = [int(v) for v in (peak.get("measured_per_rank") or [peak["measured"]])]
    device, note = device_view(plan, graph)
    page = render_report(plan, graph, measured, device=device, measured_per_rank=per_rank, device_note=note)
    return write_atomic(html_path, page, replace_symlink=replace_symlink)


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 2 with a one-line message on bad input (a plan for another graph included)."""
    parser = argparse.ArgumentParser(prog="cauto explain", description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("--graph", help="the graph.json the plan was solved from (adds the memory timeline)")
    parser.add_argument("--html", help="write a self-contained HTML report here")
    parser.add_argument("--replace-symlink", action="store_true",
                        help="replace an --html output that is a symbolic link with a file (refused otherwise)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    from cauto.solver.summary import explain

    try:
        if args.html:
            check_output(args.html, replace_symlink=args.replace_symlink)
        plan = load(args.plan, "plan")
        graph = load(args.graph, "graph") if args.graph else None
        if graph is not None:
            check_plan_matches_graph(plan, graph)
        print(explain(plan, graph))
        report = measured_for(args.plan)
        if report:
            print("\n".join(measured_lines(report)))
        if not args.html:
            return 0
        path = write_html(args.plan, args.graph, args.html, replace_symlink=args.replace_symlink)
    except (DocumentError, MismatchError, OutputError) as exc:
        print(f"cauto explain: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
