"""The one place the profiler touches DTensor's private internals: run an op on DTensors and report
what DTensor did.

``sharded_call`` runs a callable on DTensor arguments inside DTensor's
``ExplicitRedistributionContext(strict=True)`` (private: ``torch.distributed.tensor._utils``), which
makes DTensor raise on *any* input redistribution its sharding propagation asks for, including the
free ones (Replicate -> Shard, Replicate -> Partial), and inside ``CommDebugMode``, which counts
every collective. The answer says whether DTensor redistributed, how many collectives ran, and the
placements of every DTensor output. This is how the sharding labels are checked against DTensor's
own propagation: composite ops (linear, layer_norm, scaled_dot_product_attention, ...) decompose
exactly as they do at run time, so what is checked is what the runtime will meet.

``fake_mesh`` builds a mesh (1-D or 2-D) on torch's fake process group (collectives are no-ops),
so all of this runs in one process without other ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

_REDISTRIBUTION_MESSAGE = "Implicit redistribution occurred"


#: ranks of the fake process group: enough for a 2x2 mesh; smaller meshes use the first ranks
FAKE_WORLD_SIZE = 4


def fake_mesh(shape: Sequence[int] = (2,)) -> DeviceMesh:
    """A CPU mesh of ``shape`` on torch's fake process group (this process is rank 0, collectives
    are no-ops). Initializes the default process group with the "fake" backend if none exists."""
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD_SIZE)
    size = math.prod(shape)
    if dist.get_world_size() < size or dist.get_rank() != 0:
        raise RuntimeError(f"a fake mesh of shape {tuple(shape)} needs rank 0 of a process group of at least {size} "
                           f"ranks; this one has {dist.get_world_size()} (rank {dist.get_rank()})")
    return DeviceMesh("cpu", torch.arange(size).reshape(tuple(shape)))


def to_dtensor(full: torch.Tensor, placements: Placement | Sequence[Placement], mesh: DeviceMesh) -> DTensor:
    """A DTensor of global value ``full`` with one placement per mesh axis, as seen by rank 0.

    Shard(d) keeps rank 0's chunk (nested in mesh-axis order); Replicate and Partial keep the whole
    tensor as the local value."""
    placements = [placements] if isinstance(placements, Placement) else list(placements)
    local = full.detach()
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            local = local.chunk(mesh.size(axis), placement.dim)[0]
    local = local.contiguous() if any(isinstance(p, Shard) for p in placements) else local.clone()
    if full.is_floating_point():
        local.requires_grad_(full.requires_grad)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


@dataclass
class ShardedCall:
    """What DTensor did for one call: outputs' placements, or why it could not run."""

    #: placements of each DTensor output, in pytree leaf order (one tuple per output)
    output_placements: list[tuple[Placement, ...]] = field(default_factory=list)
    #: DTensor asked to redistribute an input (message names the op and the specs)
    redistributed: str | None = None
    #: collectives issued while running (any is a hidden communication)
    collectives: int = 0
    #: any other failure (no sharding strategy, unsupported op ...)
    error: str | None = None


def sharded_call(fn: Callable[..., object], args: Sequence, kwargs: dict) -> ShardedCall:
    """Run ``fn(*args, **kwargs)`` (args holding DTensors) and report redistributions, collectives and
    output placements."""
    from torch.distributed.tensor._utils import ExplicitRedistributionContext

    result = ShardedCall()
    try:
        with ExplicitRedistributionContext(strict=True), CommDebugMode() as comm:
            out = fn(*args, **kwargs)
    except Exception as exc:  # DTensor raises many types; the message is the diagnosis
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if _REDISTRIBUTION_MESSAGE in text:
            result.redistributed = text
        else:
            result.error = f"{type(exc).__name__}: {text}"
        return result
    result.collectives = comm.get_total_counts()
    result.output_placements = [tuple(t.placements) for t in pytree.tree_leaves(out) if isinstance(t, DTensor)]
    return result


def placement_is(actual: Placement, kind: str, dim: int | None = None, reduce: str | None = None) -> bool:
    """True when ``actual`` is Replicate ('R'), Shard(dim) ('S') or Partial(reduce) ('P').

    Partial subclasses count by their reduce op: DTensor's row-wise embedding output (a masked
    partial) is a Partial('sum')."""
    if kind == "R":
        return isinstance(actual, Replicate)
    if kind == "S":
        return isinstance(actual, Shard) and actual.dim == dim and type(actual) is Shard
    if kind == "P":
        return isinstance(actual, Partial) and actual.reduce_op == reduce
    raise ValueError(f"placement kind must be 'R', 'S' or 'P', not {kind!r}")

