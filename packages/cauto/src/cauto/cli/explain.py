"""`cauto explain PLAN [--graph GRAPH] [--html report.html]`: what the plan does and why.

Prints the solver's per-layer placement table and predictions; with --html writes a
self-contained page with the memory timeline and the placement table as pictures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cauto.cli.report_html import render_report
from cauto.plan import DocumentError, load


def write_html(plan_path: str | Path, graph_path: str | Path | None, html_path: str | Path) -> Path:
    """Render the HTML report of a plan (and its graph) to ``html_path``; return the path."""
    plan = load(plan_path, "plan")
    graph = load(graph_path, "graph") if graph_path else None
    html_path = Path(html_path)
    tmp = html_path.with_suffix(html_path.suffix + ".tmp")
    tmp.write_text(render_report(plan, graph), encoding="utf-8")
    tmp.replace(html_path)
    return html_path


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 2 with a one-line message on bad input."""
    parser = argparse.ArgumentParser(prog="cauto explain", description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("--graph", help="the graph.json the plan was solved from (adds the memory timeline)")
    parser.add_argument("--html", help="write a self-contained HTML report here")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    from cauto.solver.cli import main as solve_main

    rc = solve_main(["explain", args.plan])
    if rc or not args.html:
        return rc
    try:
        path = write_html(args.plan, args.graph, args.html)
    except DocumentError as exc:
        print(f"cauto explain: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
