"""The report's memory pictures as inline SVG: the unsharded profile and the plan's per-device view.

``timeline_svg``: live bytes of the whole model on one device over the profiled steps (the graph's
memory timeline). ``device_svg``: what the plan predicts on each device of the mesh, check point by
check point (cauto.solver.memory.timeline), with the model state shaded, the budget, the predicted
peak and, after `cauto run --verify`, the measured peak of every rank as markers. Without the
graph, ``device_svg`` draws the prediction's parts (model state + activations) as one bar.
A budget far above everything drawn (the device's whole memory when no budget was given) is
written above the chart instead of squashing it.
"""

from __future__ import annotations

import html

from cauto.plan.units import format_bytes

WIDTH_PX, HEIGHT_PX, PAD_PX = 560, 280, 48
OFF_CHART = 3.0
"""A budget more than this many times the highest value drawn is written, not drawn."""
PHASE_COLORS = {"forward": "#e8f0fe", "backward": "#fdeaea", "grad_sync": "#fff4d6", "optimizer": "#eaf7ea"}
PEAK_COLOR, BUDGET_COLOR, MEASURED_COLOR, LINE_COLOR = "#d93025", "#188038", "#8430ce", "#1a73e8"


def mib(n: float) -> str:
    """Bytes as ``12.3 MiB``."""
    return format_bytes(n, digits=1, unit="MiB", grouping=True)


class _Frame:
    """Pixel mapping of one chart: x over [0, x_max], y over [0, top] bytes."""

    def __init__(self, x_max: float, values: list[float], budget_bytes: int | None):
        highest = max([*values, 1])
        self.budget_drawn = bool(budget_bytes) and budget_bytes <= OFF_CHART * highest
        self.top = max(highest, budget_bytes if self.budget_drawn else 0) * 1.05
        self.x_max = max(x_max, 1)
        self.parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX}" height="{HEIGHT_PX}" '
                      f'viewBox="0 0 {WIDTH_PX} {HEIGHT_PX}" font-family="sans-serif" font-size="11">']

    def px(self, x: float) -> float:
        return PAD_PX + x / self.x_max * (WIDTH_PX - 2 * PAD_PX)

    def py(self, y: float) -> float:
        return HEIGHT_PX - PAD_PX - y / self.top * (HEIGHT_PX - 2 * PAD_PX)

    def band(self, xa: float, xb: float, fill: str, title: str) -> None:
        a, b = self.px(xa), self.px(xb)
        self.parts.append(f'<rect x="{a:.1f}" y="{PAD_PX}" width="{max(b - a, 1):.1f}" height="{HEIGHT_PX - 2 * PAD_PX}" '
                          f'fill="{fill}"><title>{html.escape(title)}</title></rect>')

    def hline(self, value: float, label: str, color: str, dy: float = -4, left: bool = False) -> None:
        """A dashed line across the chart at ``value``, labelled at its right end (or its left)."""
        y = self.py(value)
        self.parts.append(f'<line x1="{PAD_PX}" x2="{WIDTH_PX - PAD_PX}" y1="{y:.1f}" y2="{y:.1f}" stroke="{color}" '
                          f'stroke-dasharray="4 3"/>')
        x, anchor = (PAD_PX + 4, "start") if left else (WIDTH_PX - PAD_PX, "end")
        self.parts.append(f'<text x="{x}" y="{y + dy:.1f}" text-anchor="{anchor}" fill="{color}">'
                          f'{html.escape(label)}</text>')

    def budget(self, budget_bytes: int | None) -> None:
        if self.budget_drawn:
            self.hline(budget_bytes, f"budget {mib(budget_bytes)}", BUDGET_COLOR, dy=12)
        elif budget_bytes:
            self.parts.append(f'<text x="{WIDTH_PX - PAD_PX}" y="{PAD_PX - 8}" text-anchor="end" fill="{BUDGET_COLOR}">'
                              f'budget {mib(budget_bytes)} (above the chart)</text>')

    def axes(self, left: str, right: str) -> None:
        self.parts.append(f'<text x="{PAD_PX}" y="{PAD_PX - 8}">{mib(self.top / 1.05)}</text>')
        self.parts.append(f'<text x="{PAD_PX}" y="{HEIGHT_PX - PAD_PX + 16}">{html.escape(left)}</text>')
        self.parts.append(f'<text x="{WIDTH_PX - PAD_PX}" y="{HEIGHT_PX - PAD_PX + 16}" text-anchor="end">'
                          f'{html.escape(right)}</text>')

    def svg(self, element_id: str) -> str:
        self.parts[0] = self.parts[0].replace("<svg ", f'<svg id="{element_id}" ', 1)
        return "".join(self.parts) + "</svg>"


def _phase_bands(frame: _Frame, phases: list[str], xs: list[float]) -> None:
    """Shade each run of equal phases from its first x to its last."""
    start = 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[start]:
            fill = next((c for k, c in PHASE_COLORS.items() if k in phases[start]), "#f4f4f4")
            frame.band(xs[start], xs[i - 1], fill, phases[start])
            start = i


def timeline_svg(timeline: list[list], peak_bytes: int | None = None, budget_bytes: int | None = None) -> str:
    """Live bytes of the unsharded profile over its events, phases shaded, peak and budget marked."""
    if not timeline:
        return "<p>(no memory timeline in the graph document)</p>"
    x0 = timeline[0][0]
    xs = [row[0] - x0 for row in timeline]
    ys = [row[3] for row in timeline]
    frame = _Frame(xs[-1], [*ys, peak_bytes or 0], budget_bytes)
    _phase_bands(frame, [row[1] for row in timeline], xs)
    points = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in zip(xs, ys))
    frame.parts.append(f'<polyline points="{points}" fill="none" stroke="{LINE_COLOR}" stroke-width="1.5"/>')
    if peak_bytes:
        frame.hline(peak_bytes, f"peak {mib(peak_bytes)}", PEAK_COLOR)
    frame.budget(budget_bytes)
    frame.axes(f"event {timeline[0][0]}", f"event {timeline[-1][0]}")
    return frame.svg("unsharded-memory")


def _measured_markers(frame: _Frame, x: float, measured_per_rank: list[int]) -> None:
    for rank, value in enumerate(measured_per_rank):
        cx, cy = frame.px(x) + 6 * (rank - (len(measured_per_rank) - 1) / 2), frame.py(value)
        frame.parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="none" stroke="{MEASURED_COLOR}" '
                           f'stroke-width="1.5"><title>rank {rank}: measured {mib(value)}</title></circle>')
    frame.parts.append(f'<text x="{frame.px(x):.1f}" y="{frame.py(max(measured_per_rank)) - 8:.1f}" '
                       f'text-anchor="middle" fill="{MEASURED_COLOR}">measured</text>')
    label = "measured per rank: " + ", ".join(f"{v / 2**20:.2f}" for v in measured_per_rank) + " MiB"
    frame.parts.append(f'<text x="{PAD_PX}" y="{HEIGHT_PX - PAD_PX + 32}" fill="{MEASURED_COLOR}">'
                       f'{html.escape(label)}</text>')


#: share of the chart's width per phase of the per-device timeline (points spread evenly within)
PHASE_SHARES = {"forward": 0.5, "backward": 0.3, "grad_sync": 0.1, "optimizer": 0.1}
PHASE_LABELS = {"grad_sync": "sync", "optimizer": "optim."}
MEASURED_SHARE = 0.12


def _phase_layout(points: list[tuple[str, str | None, int]]) -> tuple[list[tuple[float, float, int]], list]:
    """(x from, x to, bytes) per check point and (phase, x from, x to) per phase, x in [0, 1]: each phase
    gets its share of the width whatever its number of points (one optimizer point stays visible)."""
    phases: list[str] = []
    for phase, _, _ in points:
        if phase not in phases:
            phases.append(phase)
    shares = {p: PHASE_SHARES.get(p, 0.1) for p in phases}
    scale = 1.0 / sum(shares.values())
    segments, bands, x = [], [], 0.0
    for phase in phases:
        ys = [y for p, _, y in points if p == phase]
        width = shares[phase] * scale
        step = width / len(ys)
        segments += [(x + i * step, x + (i + 1) * step, y) for i, y in enumerate(ys)]
        bands.append((phase, x, x + width))
        x += width
    return segments, bands


def device_svg(predictions: dict, device=None, measured_per_rank: list[int] | None = None) -> str:
    """The plan's predicted memory on one device (``device``: a cauto.solver DeviceTimeline, or None
    for the prediction's parts as one bar), budget line, measured per-rank peaks as markers."""
    peak = int(predictions["peak_bytes"])
    budget = predictions.get("memory_budget_bytes")
    measured = list(measured_per_rank or [])
    if device is not None and device.points:
        segments, bands = _phase_layout(device.points)
        frame = _Frame(1.0 + (MEASURED_SHARE if measured else 0.0), [*(y for _, _, y in segments), peak, *measured],
                       budget)
        for phase, a, b in bands:
            frame.band(a, b, PHASE_COLORS.get(phase, "#f4f4f4"), phase)
            frame.parts.append(f'<text x="{(frame.px(a) + frame.px(b)) / 2:.1f}" y="{HEIGHT_PX - PAD_PX + 16}" '
                               f'text-anchor="middle">{html.escape(PHASE_LABELS.get(phase, phase))}</text>')
        state_y = frame.py(device.state_bytes)
        frame.parts.append(f'<rect x="{frame.px(0):.1f}" y="{state_y:.1f}" width="{frame.px(1) - frame.px(0):.1f}" '
                           f'height="{frame.py(0) - state_y:.1f}" fill="#9aa0a6" fill-opacity="0.35">'
                           f'<title>model state {mib(device.state_bytes)}</title></rect>')
        frame.parts.append(f'<text x="{frame.px(0) + 4:.1f}" y="{frame.py(0) - 6:.1f}" fill="#3c4043">'
                           f'model state {mib(device.state_bytes)}</text>')
        points = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for a, b, y in segments for x in (a, b))
        frame.parts.append(f'<polyline points="{points}" fill="none" stroke="{LINE_COLOR}" stroke-width="1.5"/>')
        label = "predicted peak (with checkpointing)" if device.checkpointed else "predicted peak"
        frame.hline(peak, f"{label} {mib(peak)}", PEAK_COLOR, left=True)
        x_measured = 1.0 + MEASURED_SHARE / 2
        frame.parts.append(f'<text x="{PAD_PX}" y="{PAD_PX - 8}">{mib(frame.top / 1.05)}</text>')
    else:
        state = int(predictions.get("model_state_bytes", 0))
        frame = _Frame(4 if measured else 2, [peak, *measured], budget)
        x0, x1 = frame.px(0.5), frame.px(1.5)
        for bottom, top_, fill, title in ((0, state, "#9aa0a6", "model state"), (state, peak, LINE_COLOR, "activations")):
            frame.parts.append(f'<rect x="{x0:.1f}" y="{frame.py(top_):.1f}" width="{x1 - x0:.1f}" '
                               f'height="{frame.py(bottom) - frame.py(top_):.1f}" fill="{fill}" fill-opacity="0.5">'
                               f'<title>{title} {mib(top_ - bottom)}</title></rect>')
        frame.hline(peak, f"predicted peak {mib(peak)}", PEAK_COLOR, left=True)
        x_measured = 3
        frame.axes("predicted (model state + activations)", "")
    frame.budget(budget)
    if measured:
        _measured_markers(frame, x_measured, measured)
    return frame.svg("device-memory")
