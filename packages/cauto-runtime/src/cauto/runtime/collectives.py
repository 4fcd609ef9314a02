"""Which collectives a redistribution between two placements runs, per mesh axis.

This is the rule the runtime uses to describe edges in generated code and to count what a plan
implies; it mirrors DTensor's redistribute: Shard->Replicate all-gathers, Partial->Replicate
all-reduces, Partial->Shard reduce-scatters, Shard(i)->Shard(j) is an all-to-all, and
Replicate->Shard or Replicate->Partial only slice or scale locally.
"""

from __future__ import annotations

from cauto.plan import parse_placement

#: (kind of the placement held, kind wanted) -> collective on that mesh axis; pairs not listed are local
TRANSITIONS = {
    ("S", "R"): "all_gather",
    ("P", "R"): "all_reduce",
    ("P", "S"): "reduce_scatter",
    ("S", "S"): "all_to_all",
    ("S", "P"): "all_gather",
    ("P", "P"): "all_reduce",
}


def transition(have: str, want: str) -> str | None:
    """The collective that turns placement ``have`` into ``want`` on one mesh axis (None: local)."""
    if have == want:
        return None
    return TRANSITIONS.get((parse_placement(have)[0], parse_placement(want)[0]))


def edge_collectives(have: list[str] | str, want: list[str] | str, full_bytes: int, *,
                     phase: str = "forward", where: str | None = None) -> list[dict]:
    """Plan-document collectives (op, axis, bytes, phase) of redistributing a tensor of ``full_bytes``."""
    have = have.split(",") if isinstance(have, str) else list(have)
    want = want.split(",") if isinstance(want, str) else list(want)
    out = []
    for axis, (h, w) in enumerate(zip(have, want)):
        op = transition(h, w)
        if op is not None:
            entry = {"op": op, "axis": axis, "bytes": int(full_bytes), "phase": phase}
            if where:
                entry["where"] = where
            out.append(entry)
    return out


def describe(have: str, want: str) -> str:
    """A short text for generated code: "S(0),R -> R,R: all_gather(axis 0)"."""
    ops = [f"{c['op']}(axis {c['axis']})" for c in edge_collectives(have, want, 0)]
    return f"{have} -> {want}: " + (", ".join(ops) if ops else "local slice")
