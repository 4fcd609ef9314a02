"""Placement strings of plan documents: "R", "S(d)", "P(sum)", "P(avg)", "P(max)", "P(min)".

A tensor's placement on a mesh is a list with one entry per mesh axis, as in DTensor.
"""

from __future__ import annotations

import re

_PATTERN = re.compile(r"^(R|S\((\d+)\)|P\((sum|avg|max|min)\))$")


def parse_placement(text: str) -> tuple[str, int | str | None]:
    """Return ("R", None), ("S", dim) or ("P", reduce_op) for a placement string."""
    match = _PATTERN.match(text)
    if not match:
        raise ValueError(f"placement {text!r} is not one of R, S(<dim>), P(sum|avg|max|min)")
    if text == "R":
        return "R", None
    if match.group(2) is not None:
        return "S", int(match.group(2))
    return "P", match.group(3)


def format_placement(kind: str, arg: int | str | None = None) -> str:
    """Inverse of parse_placement."""
    if kind == "R":
        return "R"
    if kind == "S":
        return f"S({int(arg)})"
    if kind == "P":
        return f"P({arg or 'sum'})"
    raise ValueError(f"placement kind {kind!r} is not R, S or P")
