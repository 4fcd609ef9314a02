"""A self-contained HTML report of a plan: memory pictures and placements as inline SVG and tables.

Memory: the unsharded profile's timeline beside the plan's predicted per-device view (budget line,
measured per-rank peaks after `cauto run --verify`; see memory_svg.py), and a table of peaks per
phase. No JavaScript, no external files: the page can be mailed or attached to an issue as it is.
"""

from __future__ import annotations

import html
import math

from cauto.cli.memory_svg import device_svg, mib, timeline_svg

__all__ = ["placement_rows", "render_report", "timeline_svg"]


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


def phase_rows(graph: dict | None, device, measured_per_rank: list[int] | None) -> list[tuple[str, str, str]]:
    """(phase, unsharded peak, predicted peak per device) for the phases either side knows, then the measured row."""
    unsharded = (graph or {}).get("memory", {}).get("phases") or {}
    sharded = device.phase_peaks() if device is not None else {}
    rows = [(phase, mib(unsharded[phase]) if phase in unsharded else "", mib(sharded[phase]) if phase in sharded else "")
            for phase in ("forward", "backward", "grad_sync", "optimizer", "zero_grad")
            if phase in unsharded or phase in sharded]
    if measured_per_rank:
        rows.append(("measured peak per rank", "", ", ".join(mib(v) for v in measured_per_rank)))
    return rows


def render_report(plan: dict, graph: dict | None = None, measured: dict | None = None, *, device=None,
                  measured_per_rank: list[int] | None = None, device_note: str | None = None) -> str:
    """The whole HTML page for ``plan`` (and its graph and measurements, when given).

    ``device``: the plan's per-device timeline (cauto.solver.memory.timeline.device_timeline), drawn
    beside the unsharded one; ``measured_per_rank``: peak bytes `cauto run --verify` measured per rank;
    ``device_note``: why there is no per-device timeline, when there is none.
    """
    pred = plan["predictions"]
    mesh = plan["mesh"]
    step = pred["step_time_s"]
    summary = [
        ("mesh", " x ".join(f"{n}={s}" for n, s in zip(mesh["axis_names"], mesh["shape"]))),
        ("predicted peak per device", mib(pred["peak_bytes"])),
        ("model state / activations per device", f"{mib(pred.get('model_state_bytes', 0))} / "
                                                  f"{mib(pred.get('activation_bytes', 0))}"),
        ("memory budget", mib(pred["memory_budget_bytes"]) if pred.get("memory_budget_bytes") else "none"),
        ("predicted step time", f"{step['total'] * 1e3:.2f} ms (compute {step['compute'] * 1e3:.2f} ms, "
                                f"communication {step['communication'] * 1e3:.2f} ms)"),
        ("collectives per step", str(len(pred["collectives"]))),
        ("solver", f"{plan['solver']['name']} {plan['solver']['status']}"),
    ]
    if measured:
        summary += [(f"measured {k}", str(v)) for k, v in measured.items()]
    rows = placement_rows(plan, graph)
    memory = (graph or {}).get("memory", {})
    n_devices = math.prod(mesh["shape"])
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>cauto plan report</title>",
           "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:3px 8px;font-size:12px;text-align:left}"
           ".charts{display:flex;flex-wrap:wrap;gap:1.5em}.charts h3{font-size:14px;margin:0 0 .3em}"
           "p.note{font-size:12px;color:#5f6368}</style></head><body>",
           "<h1>cauto plan report</h1><table>"]
    out += [f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary]
    out.append("</table><h2>Memory</h2><div class='charts'>")
    out.append("<figure><h3>Unsharded profile: the whole model on one device</h3>")
    out.append(timeline_svg(memory.get("timeline", []), memory.get("peak_bytes"), pred.get("memory_budget_bytes")))
    out.append("</figure><figure>")
    out.append(f"<h3>The plan, per device (each of {n_devices}): predicted</h3>")
    out.append(device_svg(pred, device, measured_per_rank))
    out.append("</figure></div>")
    notes = []
    if device is not None and device.checkpointed:
        notes.append("The plan recomputes checkpoint regions; the per-device timeline follows the recomputation "
                     "(a region keeps only its inputs in forward and is recomputed when backward reaches it).")
    if device_note:
        notes.append(device_note)
    out += [f"<p class='note'>{html.escape(n)}</p>" for n in notes]
    prows = phase_rows(graph, device, measured_per_rank)
    if prows:
        out.append("<h3>Peak per phase</h3><table id='phase-peaks'><tr><th>phase</th><th>unsharded</th>"
                   "<th>plan, per device</th></tr>")
        out += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in prows]
        out.append("</table>")
    out.append(f"<h2>Sharded operators ({len(rows)})</h2><table><tr><th>node</th><th>module</th><th>op</th>"
               "<th>inputs</th><th>outputs</th></tr>")
    out += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
    out.append("</table></body></html>\n")
    return "".join(out)
