"""Where the parallel program fetches and releases the chunked parameter shards it uses.

A parameter whose plan state is "chunked" in a DTensor program (chunks/in_program.py) enters the
program as a :class:`ChunkedShard` handle, not as a DTensor: its value lives in a chunk that may be
on the host, or not even on this rank (ZeRO), until an op needs it. ``insert_fetches`` rewrites the
program so that

* before each op that uses the parameter, ``fetch_chunked(handle)`` gathers and fetches its chunk,
  pins it and returns the parameter as a DTensor viewing the chunk. Its gradient comes back as the
  plan's placement on the tensor-parallel axes and as a Partial(sum) share on the data-parallel
  ones, for the chunk manager's reduce-scatter (a Shard gradient there is gathered, a Replicate one
  split evenly into shares); later uses in the same forward send their gradient to the first use's,
  so that the sum is converted once;
* after the last op that reads that DTensor or anything that may alias it (views, ``getitem``,
  redistributions, which may return a local view), ``release_chunked(handle, last)`` unpins it;
* a redistribution of the stored parameter to the placement its op wants (``execute.build`` puts
  those at the top of the program) moves to just before its first user, so a chunk is pinned only
  around the ops that read it; every redistribution of a fetched parameter becomes
  ``redistribute_fetched``: DTensor's own backward would reduce the gradient to the stored
  placement on every axis, an all-reduce over the data-parallel axes per parameter, which the chunk
  manager's reduce-scatter does instead; here the gradient stays as it comes on those axes.

Autograd may save the DTensor for backward: the chunk manager's saved-tensor hooks store a reference
to the chunk instead and fetch it again in backward (chunks/model.py).

Checkpoint regions. A fetch belongs to the op it serves and a release to the op of the last use
(``FETCHED_FOR``), so a region cut out of the program (runtime/checkpoint.py) contains the fetches of
its own ops: its recomputation in backward fetches the parameters again, where their chunks are then,
and keeps them pinned until their gradients are in (chunks/model.py). A region never takes a value
viewing a chunk from outside (``CHUNK_VIEW``; its recomputation would read wherever the chunk was in
forward): checkpoint.py refuses such a region by name.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Replicate

from cauto.runtime import ops
from cauto.runtime.dist_utils import to_placements

FETCHED_FOR = "cauto_fetched_for"
"""Node meta of a fetch or release: the plan node whose use it serves (a fetch: the op reading the
parameter; a release: the op of the last use). A checkpoint region of that op contains it
(runtime/checkpoint.py), so that the region's recomputation fetches the parameter again."""

CHUNK_VIEW = "cauto_chunk_view"
"""Node meta of a fetch and every value that may alias it: the chunked parameter it views."""


@dataclass(frozen=True, eq=False)
class ChunkedShard:
    """What the program receives for a chunked parameter: where its shard is and how to place it."""

    chunks: object  # cauto.runtime.chunks.ChunkedModel
    index: int      # its slot in chunks.layout.slots
    mesh: object
    placements: tuple
    data_axes: frozenset  # the mesh axes its chunk is ZeRO-sharded over
    shape: torch.Size
    stride: tuple[int, ...]

    def __repr__(self) -> str:
        return f"ChunkedShard(slot {self.index}, {self.placements})"


def fetch_chunked(shard: ChunkedShard):
    """The parameter as a DTensor viewing its pinned chunk (see module docstring)."""
    local = shard.chunks.fetch(shard.index)
    first = shard.chunks.fetched.get(shard.index)
    if first is not None:  # a later use: the chunk may have moved since, its gradient joins the first's
        return _Refetched.apply(first, local.detach(), shard.mesh, shard.placements, shard.shape, shard.stride)
    out = _ShardAsDTensor.apply(local, shard.mesh, shard.placements, shard.shape, shard.stride, shard.data_axes)
    shard.chunks.fetched[shard.index] = out
    return out


def release_chunked(shard: ChunkedShard, after=None) -> None:
    """Unpin the parameter's chunk; ``after`` is the last value that used it (an ordering edge)."""
    shard.chunks.release(shard.index)


def _grad_on_data_axes(grad, mesh, stored: tuple, data_axes: frozenset):
    """``grad`` with the stored placements on every axis but ``data_axes``; there a Partial gradient
    stays Partial (the chunks sum it) and a Shard one is gathered to Replicate."""
    want = tuple((g if g.is_partial() else Replicate()) if a in data_axes else s
                 for a, (g, s) in enumerate(zip(grad.placements, stored)))
    return grad.redistribute(mesh, want) if want != tuple(grad.placements) else grad


class _ShardAsDTensor(torch.autograd.Function):
    """Forward: this rank's parameter shard as a DTensor. Backward: its local gradient, a Partial(sum)
    share on the data-parallel axes (a Replicate gradient is split evenly into shares)."""

    @staticmethod
    def forward(ctx, local, mesh, placements, shape, stride, data_axes):
        ctx.mesh, ctx.placements, ctx.data_axes = mesh, placements, data_axes
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        grad = _grad_on_data_axes(grad, ctx.mesh, ctx.placements, ctx.data_axes)
        local = grad._local_tensor
        shares = 1
        for a in ctx.data_axes:
            p = grad.placements[a]
            if not p.is_partial() or p.reduce_op == "avg":
                shares *= ctx.mesh.size(a)
        return (local / shares if shares > 1 else local), None, None, None, None, None


class _Refetched(torch.autograd.Function):
    """Forward: the parameter fetched again (``local``, where its chunk is now) as a DTensor. Backward:
    the gradient to the parameter's first fetch of this forward, so that autograd sums the gradients
    of every use before one conversion (as it does for a device parameter: one reduction, not one per use)."""

    @staticmethod
    def forward(ctx, first, local, mesh, placements, shape, stride):
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None, None


class _RedistributeFetched(torch.autograd.Function):
    """Forward: DTensor's redistribute. Backward: the gradient back to the stored placements, except
    on the data-parallel axes (``_grad_on_data_axes``)."""

    @staticmethod
    def forward(ctx, x, mesh, target, data_axes):
        ctx.mesh, ctx.stored, ctx.data_axes = mesh, tuple(x.placements), data_axes
        return x.redistribute(mesh, target)

    @staticmethod
    def backward(ctx, grad):
        return _grad_on_data_axes(grad, ctx.mesh, ctx.stored, ctx.data_axes), None, None, None


def redistribute_fetched(x, mesh, placements: str, shard: ChunkedShard):
    """``ops.redistribute`` of a fetched parameter, its gradient left Partial on the data-parallel axes."""
    target = to_placements(placements)
    if tuple(x.placements) == target:
        return x
    return _RedistributeFetched.apply(x, mesh, target, shard.data_axes)


def _may_alias(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in (ops.redistribute, redistribute_fetched, operator.getitem):
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True  # not an ATen op: assume it may return a view
    return any(r.alias_info is not None for r in schema.returns)


def aliases_of(node: torch.fx.Node) -> set[torch.fx.Node]:
    """``node`` and every value downstream of it that may alias it (through views, getitem, redistributions)."""
    aliases, stack = {node}, [node]
    while stack:
        for u in stack.pop().users:
            if u not in aliases and _may_alias(u):
                aliases.add(u)
                stack.append(u)
    return aliases


def _order(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def insert_fetches(graph: torch.fx.Graph, chunked: set[str]) -> int:
    """Rewrite ``graph`` (module docstring) for the placeholders named in ``chunked``; return the
    number of fetches inserted."""
    fetches = 0
    for ph in [n for n in graph.nodes if n.op == "placeholder" and n.name in chunked]:
        order = _order(graph)
        for user in list(ph.users):
            if user.target is ops.redistribute and user.users:
                min(user.users, key=order.__getitem__).prepend(user)
        for user in sorted(ph.users, key=_order(graph).__getitem__):
            with graph.inserting_before(user):
                fetch = graph.call_function(fetch_chunked, (ph,))
            fetch.meta["val"] = ph.meta.get("val")
            fetch.meta["cauto_owner"] = ph.name
            fetch.meta["cauto_comment"] = "chunked parameter: gather + fetch its chunk, pin it"
            fetch.meta[FETCHED_FOR] = user.meta.get("cauto_owner", user.name)
            user.replace_input_with(ph, fetch)
            if user.target is ops.redistribute:
                value, mesh, placements = user.args
                user.target, user.args = redistribute_fetched, (value, mesh, placements, ph)
            order = _order(graph)
            last = max((u for a in aliases_of(fetch) for u in a.users), key=order.__getitem__)
            ctx = graph.inserting_before(last) if last.op == "output" else graph.inserting_after(last)
            with ctx:
                release = graph.call_function(release_chunked, (ph, last if last.op != "output" else None))
            release.meta["cauto_owner"] = ph.name
            release.meta["cauto_comment"] = "chunked parameter: its forward use is over, unpin the chunk"
            if last.op != "output":
                release.meta[FETCHED_FOR] = last.meta.get("cauto_owner", last.name)
            for a in aliases_of(fetch):
                a.meta[CHUNK_VIEW] = ph.name
            fetches += 1
    return fetches


__all__ = ["CHUNK_VIEW", "FETCHED_FOR", "ChunkedShard", "aliases_of", "fetch_chunked", "insert_fetches", "redistribute_fetched", "release_chunked"]
