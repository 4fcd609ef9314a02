"""Plans with chunked state and tensor parallelism: the DTensor program, parameter shards in chunks.

``apply`` hands a plan here when its parameters' state is "chunked" and the plan is not pure data
parallelism: its chunks are ZeRO-sharded over some mesh axes only (``offload.mesh_axes``, the
data-parallel axes D, any subset of the mesh's axes; on the others parameters are tensor-parallel or
replicated), or it redistributes activations. (Pure data
parallelism without edges runs the model as written instead: chunks/data_parallel.py.)

* The program is ``execute.build``'s, as for a plan without chunks: DTensors, the plan's
  redistributions, its generated code. Each chunked parameter enters it as a
  :class:`~cauto.runtime.chunks.fetch.ChunkedShard` and is fetched around the ops that read it
  (chunks/fetch.py): the program's code shows ``fetch_chunked`` / ``release_chunked`` calls.
* A chunked parameter is Replicate on every axis of D and placed as planned on the others (e.g.
  Shard(0) on a tensor-parallel axis). Each rank materializes its shard as for a DTensor plan, then
  the chunk manager (``chunk_module``) takes the local shards: ZeRO-sharded over the process group
  of D (one mesh axis's group, the whole mesh, or for any other subset of axes a group over the
  ranks that differ only on D: ``zero_group_ranks``), paged between device and host within the plan's
  ``offload.device_budget_bytes`` (``offload.simulated_device_budget_bytes`` on the CPU's simulated device).
* Gradients: a fetched parameter's gradient comes back as a Partial(sum) share on D (a Replicate
  gradient becomes an equal share per rank, a Shard one is gathered first) and as planned on the
  other axes (chunks/fetch.py), so the chunk manager's reduce-scatter sums the ranks' shares
  (``average_grads=False``) into the gradient of the global loss.
* Checkpoint regions (the solver's three-way plans: sharding, recomputation and chunked state) run
  on this DTensor program as on any other: each region contains the fetches of its own ops, so its
  recomputation fetches the chunked parameters again and keeps them pinned until their gradients are
  in (chunks/fetch.py, chunks/model.py).
* Every trainable parameter must be chunked (one optimizer, ``model.optimizer``, a ChunkedAdam
  built from the ``optimizer`` factory's class and groups); no host state.

Loop and checkpoints as in chunks/data_parallel.py (``model.optimizer``; ``cauto.runtime.chunks.save_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cauto.plan import PlanDocument
from cauto.plan.mesh_axes import data_parallel_axes
from cauto.profiler.capture import Capture
from cauto.runtime import execute
from cauto.runtime.chunks.data_parallel import (
    chunked_targets,
    device_budget_bytes,
    mismatch,
    refuse_frozen_chunks,
    refuse_host_state,
)
from cauto.runtime.chunks.fetch import ChunkedShard
from cauto.runtime.chunks.model import ChunkedModel
from cauto.runtime.chunks.optim import ChunkedAdam
from cauto.runtime.chunks.wrap import chunk_module


def plan_data_parallel_axes(plan: PlanDocument) -> list[int]:
    """The mesh axes the plan ZeRO-shards chunks over (``offload.mesh_axes``; all axes if absent)."""
    return list(data_parallel_axes(plan.mesh["shape"], (plan.offload or {}).get("mesh_axes")))


def check_chunked_program(plan: PlanDocument, model: nn.Module) -> None:
    """Raise PlanMismatchError unless ``plan``'s chunked state can run in the DTensor program (module docstring)."""
    refuse_host_state(plan)
    refuse_frozen_chunks(plan, model)
    if plan.offload is None:
        raise mismatch("the plan marks parameters \"chunked\" but has no offload section; solve again with "
                        "--offload chunked")
    try:
        axes = plan_data_parallel_axes(plan)
    except ValueError as exc:
        raise mismatch(f"the plan's offload.mesh_axes are not data-parallel axes of its mesh ({exc}): the plan is "
                        "malformed, solve again") from None
    chunked = set(chunked_targets(plan))
    left = [n for n, p in model.named_parameters() if p.requires_grad and n not in chunked]
    if left:
        raise mismatch(f"the plan chunks {len(chunked)} parameters but keeps {len(left)} trainable ones on the "
                        f"device (first: {left[0]!r}); with tensor parallelism, chunked state runs only when every "
                        "trainable parameter is chunked: solve again with --offload chunked")
    bad = [e["target"] for e in plan.params.values()
           if e.get("state") == "chunked" and any(e["placements"][a] != "R" for a in axes)]
    if bad:
        raise mismatch(f"chunked parameter {bad[0]!r} is not Replicate on the data-parallel mesh axes {axes}; the "
                        "chunk manager ZeRO-shards it there itself: the plan is malformed, solve again")


#: (mesh ranks, mesh shape, axes) -> this rank's flattened group: groups are made once per process
_FLAT_GROUPS: dict[tuple, object] = {}


def zero_group_ranks(mesh_ranks: torch.Tensor, axes: list[int]) -> list[list[int]]:
    """The ZeRO groups of the mesh axes ``axes``: for each coordinate on the other axes, the ranks that
    differ only on ``axes`` (in mesh order, so a rank's place in its group is its flattened coordinate on
    ``axes``: the chunks it owns, as the solver's ``offload.num_chunks`` counts them)."""
    others = [a for a in range(mesh_ranks.dim()) if a not in axes]
    w = 1
    for a in axes:
        w *= mesh_ranks.shape[a]
    return mesh_ranks.permute(*others, *axes).reshape(-1, w).tolist()


def _process_group(mesh: DeviceMesh, axes: list[int]):
    """The process group the chunks are ZeRO-sharded over: the ranks that differ only on ``axes`` (one
    axis of size > 1: its group; several: a group over those ranks, made once, so that each chunk group
    is one collective, as the plan predicts). None on one device."""
    if mesh.size() == 1:
        return None
    big = [a for a in axes if mesh.size(a) > 1]  # an axis of size 1 adds no rank to the group
    if len(big) <= 1:
        return mesh.get_group(big[0] if big else axes[0])  # of size 1: then nothing is ZeRO-sharded
    axes = big
    key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), tuple(axes))
    if key not in _FLAT_GROUPS:
        mine = None
        for ranks in zero_group_ranks(mesh.mesh, axes):  # every rank makes every group, in the same order
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        _FLAT_GROUPS[key] = mine
    return _FLAT_GROUPS[key]


def shard_into_chunks(model: nn.Module, plan: PlanDocument, mesh: DeviceMesh, device: torch.device,
                      optimizer: Callable | None) -> tuple[ChunkedModel, ChunkedAdam, dict[str, ChunkedShard]]:
    """Put the local shards of ``model``'s chunked DTensor parameters into chunks, in place (module
    docstring); return (chunked model, optimizer, fqn -> ChunkedShard for every name of each)."""
    check_chunked_program(plan, model)
    axes = plan_data_parallel_axes(plan)
    targets = set(chunked_targets(plan))
    chosen = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in targets}
    spec: dict[int, tuple] = {}
    local_of: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or id(p) not in chosen:
                continue
            if id(p) not in local_of:  # a tied parameter becomes one local shard under every name
                local = nn.Parameter(p._local_tensor.detach().to(device).clone(), requires_grad=True)
                local_of[id(p)] = local
                spec[id(local)] = (tuple(p.placements), p.shape, p.stride())
            module._parameters[name] = local_of[id(p)]
    names = [n for n, p in model.named_parameters() if id(p) in spec]
    group = _process_group(mesh, axes)
    chunked, opt = chunk_module(model, optimizer, device_budget_bytes(plan, device), params=names, device=device,
                                chunk_elems=int(plan.offload["chunk_elems"]), process_group=group,
                                average_grads=False, module_hooks=False)
    index = {id(s.param): i for i, s in enumerate(chunked.layout.slots)}
    shards = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in spec:
            placements, shape, stride = spec[id(p)]
            shards[fqn] = ChunkedShard(chunked, index[id(p)], mesh, placements, frozenset(axes), shape, stride)
    return chunked, opt, shards


def build_program(cap: Capture, plan: PlanDocument, mesh: DeviceMesh, device: torch.device, propagation,
                  shards: dict[str, ChunkedShard]) -> execute.ExecutableGraph:
    """``execute.build`` with every chunked parameter's placeholder fetched around its uses."""
    chunked = {node for node, (kind, fqn) in cap.placeholders.items() if kind == "param" and fqn in shards}
    return execute.build(cap, plan, mesh, device, propagation, chunked=chunked)


__all__ = ["build_program", "check_chunked_program", "plan_data_parallel_axes", "shard_into_chunks", "zero_group_ranks"]
