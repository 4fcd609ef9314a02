"""A self-contained HTML report of a plan: memory timeline and placements as inline SVG and tables.

No JavaScript, no external files: the page can be mailed or attached to an issue as it is.
"""

from __future__ import annotations

import html

_WIDTH, _HEIGHT, _PAD = 900, 260, 48


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def timeline_svg(timeline: list[list], peak_bytes: int | None = None, budget_bytes: int | None = None) -> str:
    """An SVG line chart of live bytes over the profiled events, phases shaded, peak/budget marked."""
    if not timeline:
        return "<p>(no memory timeline in the graph document)</p>"
    xs = [row[0] for row in timeline]
    ys = [row[3] for row in timeline]
    top = max([*ys, peak_bytes or 0, budget_bytes or 0, 1])
    x0, x1 = min(xs), max(xs) or 1

    def px(x: float) -> float:
        return _PAD + (x - x0) / max(x1 - x0, 1) * (_WIDTH - 2 * _PAD)

    def py(y: float) -> float:
        return _HEIGHT - _PAD + -(y / top) * (_HEIGHT - 2 * _PAD)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
             f'viewBox="0 0 {_WIDTH} {_HEIGHT}" font-family="sans-serif" font-size="11">']
    colors = {"forward": "#e8f0fe", "backward": "#fdeaea", "optimizer": "#eaf7ea"}
    start = 0
    for i in range(1, len(timeline) + 1):
        if i == len(timeline) or timeline[i][1] != timeline[start][1]:
            phase = timeline[start][1]
            fill = next((c for k, c in colors.items() if k in phase), "#f4f4f4")
            xa, xb = px(timeline[start][0]), px(timeline[i - 1][0])
            parts.append(f'<rect x="{xa:.1f}" y="{_PAD}" width="{max(xb - xa, 1):.1f}" '
                         f'height="{_HEIGHT - 2 * _PAD}" fill="{fill}"><title>{html.escape(phase)}</title></rect>')
            start = i
    points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
    parts.append(f'<polyline points="{points}" fill="none" stroke="#1a73e8" stroke-width="1.5"/>')
    for value, label, color in ((peak_bytes, "predicted peak", "#d93025"), (budget_bytes, "budget", "#188038")):
        if value:
            parts.append(f'<line x1="{_PAD}" x2="{_WIDTH - _PAD}" y1="{py(value):.1f}" y2="{py(value):.1f}" '
                         f'stroke="{color}" stroke-dasharray="4 3"/>')
            parts.append(f'<text x="{_WIDTH - _PAD}" y="{py(value) - 4:.1f}" text-anchor="end" fill="{color}">'
                         f'{label} {_mib(value)}</text>')
    parts.append(f'<text x="{_PAD}" y="{_PAD - 8}">{_mib(top)}</text>')
    parts.append(f'<text x="{_PAD}" y="{_HEIGHT - _PAD + 16}">event 0</text>')
    parts.append(f'<text x="{_WIDTH - _PAD}" y="{_HEIGHT - _PAD + 16}" text-anchor="end">event {x1}</text>')
    parts.append("</svg>")
    return "".join(parts)


def placement_rows(plan: dict, graph: dict | None) -> list[tuple[str, str, str, str, str]]:
    """(node, module, op, input placements, output placements) for every op node whose placements are not all R."""
    nodes = {n["id"]: n for n in graph["nodes"]} if graph else {}
    rows = []
    for node_id, strategy in plan["nodes"].items():
        info = nodes.get(node_id, {})
        if info.get("kind", "op") != "op":
            continue
        flat = [p for group in strategy["inputs"] + strategy["outputs"] for p in group]
        if all(p == "R" for p in flat):
            continue
        rows.append((node_id, info.get("module", ""), info.get("op", ""),
                     " ".join("[" + ",".join(g) + "]" for g in strategy["inputs"]),
                     " ".join("[" + ",".join(g) + "]" for g in strategy["outputs"])))
    return rows


def render_report(plan: dict, graph: dict | None = None, measured: dict | None = None) -> str:
    """The whole HTML page for ``plan`` (and its graph and measurements, when given)."""
    pred = plan["predictions"]
    mesh = plan["mesh"]
    step = pred["step_time_s"]
    summary = [
        ("mesh", " x ".join(f"{n}={s}" for n, s in zip(mesh["axis_names"], mesh["shape"]))),
        ("predicted peak per device", _mib(pred["peak_bytes"])),
        ("memory budget", _mib(pred["memory_budget_bytes"]) if pred.get("memory_budget_bytes") else "none"),
        ("predicted step time", f"{step['total'] * 1e3:.2f} ms (compute {step['compute'] * 1e3:.2f} ms, "
                                f"communication {step['communication'] * 1e3:.2f} ms)"),
        ("collectives per step", str(len(pred["collectives"]))),
        ("solver", f"{plan['solver']['name']} {plan['solver']['status']}"),
    ]
    if measured:
        summary += [(f"measured {k}", str(v)) for k, v in measured.items()]
    rows = placement_rows(plan, graph)
    timeline = (graph or {}).get("memory", {}).get("timeline", [])
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>cauto plan report</title>",
           "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:3px 8px;font-size:12px;text-align:left}</style></head><body>",
           "<h1>cauto plan report</h1><table>"]
    out += [f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary]
    out.append("</table><h2>Memory timeline (unsharded profile)</h2>")
    out.append(timeline_svg(timeline, (graph or {}).get("memory", {}).get("peak_bytes"),
                            pred.get("memory_budget_bytes")))
    out.append(f"<h2>Sharded operators ({len(rows)})</h2><table><tr><th>node</th><th>module</th><th>op</th>"
               "<th>inputs</th><th>outputs</th></tr>")
    out += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
    out.append("</table></body></html>\n")
    return "".join(out)
