"""Small torch.distributed helpers: placement strings <-> DTensor placements, meshes, process groups.

Placement strings are the plan documents' ("R", "S(d)", "P(sum)"...); a tensor's placement on a
mesh is one string per mesh axis, written joined with "," in generated code ("S(0),R").
"""

from __future__ import annotations

import datetime
import functools
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from cauto.plan import format_placement, parse_placement

#: collective timeout of every process group the runtime creates: a dead rank ends the job, never hangs it
DEFAULT_TIMEOUT_S = 300.0
#: the timeout init_distributed gave the default group; make_mesh gives it to the mesh's own groups too
_group_timeout_s: list[float] = []


def to_placement(text: str) -> Placement:
    """The DTensor placement of a plan placement string ("R", "S(1)", "P(sum)")."""
    kind, arg = parse_placement(text)
    if kind == "R":
        return Replicate()
    if kind == "S":
        return Shard(int(arg))
    return Partial(str(arg))


@functools.cache
def to_placements(spec: str | tuple[str, ...]) -> tuple[Placement, ...]:
    """DTensor placements of "S(0),R" or ("S(0)", "R")."""
    parts = tuple(spec.split(",")) if isinstance(spec, str) else spec
    return tuple(to_placement(p.strip()) for p in parts)


def placement_text(p: Placement) -> str:
    """The plan string of a DTensor placement."""
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard):
        return format_placement("S", p.dim)
    if isinstance(p, Partial):
        return format_placement("P", p.reduce_op)
    raise ValueError(f"placement {p!r} has no plan spelling (only Replicate, Shard, Partial)")


def placements_text(placements) -> str:
    """"S(0),R" for (Shard(0), Replicate())."""
    return ",".join(placement_text(p) for p in placements)


def free_port() -> int:
    """A TCP port that was free a moment ago (for MASTER_PORT in tests and tools)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_type() -> str:
    """"cuda" when this process has a GPU, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialize the default process group from torchrun's environment (gloo on CPU, NCCL on CUDA).

    Every collective gets ``timeout_s``: a rank that dies makes the others fail after it, not hang.
    A no-op when a group already exists.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device_type() == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _group_timeout_s[:] = [timeout_s]


def make_mesh(shape: tuple[int, ...] | list[int], axis_names: tuple[str, ...] | list[str] | None = None,
              timeout_s: float | None = None) -> DeviceMesh:
    """A device mesh of ``shape`` over the default group's ranks (row-major).

    The mesh's groups get the collective timeout ``timeout_s`` (default: init_distributed's, when it
    made the default group); torch would give a multi-axis mesh's groups its own (30 min on gloo).
    """
    names = tuple(axis_names) if axis_names else None
    mesh = init_device_mesh(device_type(), tuple(shape), mesh_dim_names=names)
    timeout_s = timeout_s if timeout_s is not None else (_group_timeout_s[0] if _group_timeout_s else None)
    if timeout_s is not None:
        set_timeout(mesh, timeout_s)
    return mesh


def set_timeout(mesh: DeviceMesh, timeout_s: float) -> None:
    """Give the default group and every group of ``mesh`` the collective timeout ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in {dist.group.WORLD, *(mesh.get_group(axis) for axis in range(mesh.ndim))}:
        dist.distributed_c10d._set_pg_timeout(timeout, group)  # torch has no public setter


def local_slices(global_shape: tuple[int, ...], placements, mesh: DeviceMesh) -> tuple[slice, ...]:
    """The index of this rank's shard of a tensor of ``global_shape`` placed ``placements`` on ``mesh``.

    Shards follow DTensor's convention: ``torch.chunk`` per mesh axis, axes applied in order.
    """
    start = [0] * len(global_shape)
    length = list(global_shape)
    coords = mesh.get_coordinate()
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            n = mesh.size(axis)
            chunk = -(-length[p.dim] // n) if length[p.dim] else 0
            offset = min(coords[axis] * chunk, length[p.dim])
            start[p.dim] += offset
            length[p.dim] = max(0, min(chunk, length[p.dim] - offset))
    return tuple(slice(s, s + n) for s, n in zip(start, length))
