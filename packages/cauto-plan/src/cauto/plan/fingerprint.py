"""The graph fingerprint: a hash of what the runtime executes, repeated in every plan.

It covers node ids, kinds, ops, parameter targets, input edges and output shapes/dtypes, and
nothing that profiling settings or cost models change, so a graph profiled for another device
keeps its fingerprint while a changed model (another layer count, shape or op) does not.
"""

from __future__ import annotations

import hashlib
import json


def graph_fingerprint(nodes: list[dict]) -> str:
    """Return the sha256 hex digest of the structural fields of graph-document nodes (dicts)."""
    canonical = [
        [n["id"], n["kind"], n["op"], n.get("target"), list(n["inputs"]),
         [[list(o["shape"]), o["dtype"]] for o in n["outputs"]]]
        for n in nodes
    ]
    blob = json.dumps(canonical, separators=(",", ":"), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()
