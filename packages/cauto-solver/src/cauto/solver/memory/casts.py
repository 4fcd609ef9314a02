"""Mixed precision in the graph: which inputs an op casts on entry, so the dtype each edge moves in.

cauto.plan.precision has the rule (an op that takes a float32 input and gives only bf16 floating
outputs ran under autocast and cast that input on entry; the runtime casts before it redistributes).
Here it is applied to a graph document's nodes. A redistributed input moves in the dtype its consumer
casts it to, a parameter included (the runtime redistributes a parameter where an op reads it, once
per placement and dtype). The edge costs (strategies/groups.py), the plan's collectives
(sharding_section.py), the copies the memory model counts (model.py) and the walk (walk.py) read this map. An fp32 graph has no
entries, so nothing changes for it.
"""

from __future__ import annotations

from cauto.plan import GraphNode, split_ref
from cauto.plan.precision import cast_on_entry


def entry_casts(nodes: list[GraphNode]) -> dict[tuple[str, int], str]:
    """(op id, input index) -> the dtype the op casts that input to as it starts."""
    by_id = {n.id: n for n in nodes}
    out: dict[tuple[str, int], str] = {}
    for n in nodes:
        if n.kind != "op":
            continue
        dtypes = [o.dtype for o in n.outputs]
        for k, ref in enumerate(n.inputs):
            src_id, o = split_ref(ref)
            src = by_id.get(src_id)
            if src is None or o >= len(src.outputs):
                continue
            meta = src.outputs[o]
            cast = cast_on_entry(meta.dtype, len(meta.shape), dtypes)
            if cast is not None:
                out[(n.id, k)] = cast
    return out


__all__ = ["entry_casts"]
