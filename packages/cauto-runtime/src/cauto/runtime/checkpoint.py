"""Checkpoint regions: run a plan's region nodes inside non-reentrant ``torch.utils.checkpoint``.

A region (plan.checkpoint.regions[i].nodes: graph node ids) is cut out of the parallel GraphModule
into a sub-GraphModule ``checkpoint_<i>`` together with the redistributions that belong to its nodes;
the main graph then calls ``ops.checkpointed(self.checkpoint_<i>, *inputs)``, which runs it under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Its activations are dropped after forward and recomputed in backward
(including the region's redistributions). Nested regions (``children``) are cut out first, so an
outer region contains the call of its inner one.

With chunked parameters (chunks/fetch.py) a region also contains the fetches and releases of its own
ops, so that its recomputation fetches them again; a region that would read a chunk through a value
fetched outside it is refused by name.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from cauto.runtime.chunks.fetch import CHUNK_VIEW, FETCHED_FOR
from cauto.runtime.ops import checkpointed


def _order(regions: list[dict]) -> list[int]:
    done: list[int] = []

    def visit(i: int, stack: tuple[int, ...] = ()) -> None:
        if i in done:
            return
        if i in stack:
            raise ValueError(f"plan.checkpoint.regions[{i}] is nested in itself (children form a cycle)")
        for c in regions[i].get("children", []):
            visit(c, stack + (i,))
        done.append(i)

    for i in range(len(regions)):
        visit(i)
    return done


def wrap_regions(gm: torch.fx.GraphModule, regions: list[dict]) -> None:
    """Cut every region of ``regions`` out of ``gm`` into a checkpointed submodule (in place)."""
    members: dict[int, set[str]] = {i: set(r["nodes"]) for i, r in enumerate(regions)}
    for i in _order(regions):
        for c in regions[i].get("children", []):
            members[i] |= members[c]
        call = _cut(gm, members[i], f"checkpoint_{i}")
        members[i].add(call)
    gm.graph.lint()


def _cut(gm: torch.fx.GraphModule, names: set[str], attr: str) -> str:
    graph = gm.graph
    region: list[torch.fx.Node] = []
    inside: set[torch.fx.Node] = set()
    for n in graph.nodes:
        # a multi-output op's outputs are getitem nodes, which the plan does not name (it writes "chunk#1"):
        # they belong to the op's region
        if n.op == "call_function" and (n.name in names or n.meta.get("cauto_owner") in names
                                        or n.meta.get("cauto_region") in names
                                        or n.meta.get(FETCHED_FOR) in names
                                        or (n.target is operator.getitem and n.args[0] in inside)):
            region.append(n)
            inside.add(n)
    if not region:
        raise ValueError(f"checkpoint region {attr} names no node of the graph: {sorted(names)[:3]}...")
    inputs: list[torch.fx.Node] = []
    for n in region:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    viewing = [a for a in inputs if CHUNK_VIEW in a.meta]
    if viewing:
        raise ValueError(f"checkpoint region {attr} reads the chunked parameter {viewing[0].meta[CHUNK_VIEW]!r} "
                         f"through {viewing[0].name!r}, fetched outside the region: its recomputation would read "
                         "the chunk where it was in forward. Plan without checkpoint regions (--checkpoint none), "
                         "or without chunked state (--offload none)")
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in region:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    module = torch.fx.GraphModule(torch.nn.Module(), sub)
    gm.add_submodule(attr, module)
    order = list(graph.nodes)
    first_use = min(order.index(u) for o in outputs for u in o.users if u not in inside)
    if any(order.index(a) > first_use for a in inputs):
        raise ValueError(f"checkpoint region {attr} is not contiguous: a value it needs is computed after a "
                         "value it produces is used; list the nodes of one contiguous stretch of the graph")
    with graph.inserting_before(order[first_use]):
        fn = graph.get_attr(attr)
        call = graph.call_function(checkpointed, (fn, *inputs))
        call.meta["cauto_comment"] = f"checkpoint region: {len(region)} nodes recomputed in backward"
        getters = []
        for k, o in enumerate(outputs):
            g = graph.call_function(operator.getitem, (call, k))
            g.meta = {"val": o.meta.get("val"), "cauto_region": call.name}
            getters.append(g)
    call.meta["cauto_region"] = call.name
    fn.meta["cauto_region"] = call.name
    for o, g in zip(outputs, getters):
        o.replace_all_uses_with(g, delete_user_cb=lambda u: u not in inside)
    for n in reversed(region):
        graph.erase_node(n)
    gm.recompile()
    return call.name
