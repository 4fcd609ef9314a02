"""What recomputation repeats besides compute: the collectives of redistributions inside regions.

The runtime cuts each checkpoint region out together with the redistributions its nodes consume
(an edge belongs to its consumer), runs it under non-reentrant ``torch.utils.checkpoint`` with early
stop off, and so re-runs the whole region in backward: every forward collective of an edge whose
consumer lies in a region runs once more per enclosing region (a node nested ``d`` regions deep is
recomputed ``d`` times: once by each enclosing region's recomputation).
"""

from __future__ import annotations

from collections import Counter


def region_depths(regions: list[dict]) -> Counter:
    """Node id -> how many regions contain it (a region's ``nodes`` include its children's)."""
    depth: Counter = Counter()
    for region in regions:
        depth.update(set(region["nodes"]))
    return depth


def recompute_collectives(plan_doc: dict, regions: list[dict]) -> list[dict]:
    """The collectives recomputation runs in backward: phase "backward", ``where`` "recompute: <edge>"."""
    depth = region_depths(regions)
    out = []
    for edge in plan_doc.get("edges", []):
        for _ in range(depth.get(edge["dst"], 0)):
            for c in edge["collectives"]:
                out.append({**c, "phase": "backward", "where": f"recompute: {c.get('where', edge['dst'])}"})
    return out
