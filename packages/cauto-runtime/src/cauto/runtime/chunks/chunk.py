"""Chunk layout, tensor states and the chunk-size search (PatrickStar §4 of ALGORITHMS.md).

Parameters are packed in registration order, one optimizer parameter group at a time, into chunks
of one fixed number of elements. The same layout serves every chunk list (compute-precision
params, fp32 gradients, fp32 master params, Adam m and v), so the lists mirror each other: the
element range of a parameter is the same in all of them. A parameter never spans two chunks.
Offsets are aligned to 64 bytes so parameter views have the alignment of fresh allocations. The
packing arithmetic and the chunk-size search live in cauto.plan.chunking, shared with the solver.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from cauto.plan.chunking import aligned_elems


class TensorState(enum.Enum):
    """Life-cycle state of one parameter tensor inside its chunk."""

    FREE = "free"                      # no payload (ZeRO: a chunk this rank does not own, not gathered)
    COMPUTE = "compute"                # an operator is using it now: its chunk must stay on the device
    HOLD = "hold"                      # payload valid, not in use
    HOLD_AFTER_FWD = "hold_after_fwd"  # used in this forward, not yet in backward
    HOLD_AFTER_BWD = "hold_after_bwd"  # its gradient of this backward is accumulated


def chunk_state(states: list[TensorState]) -> TensorState:
    """A chunk's state derived from its tensors': COMPUTE wins, then FREE if all free, then the
    weakest hold (HOLD_AFTER_BWD only when every tensor is there)."""
    if any(s is TensorState.COMPUTE for s in states):
        return TensorState.COMPUTE
    if all(s is TensorState.FREE for s in states):
        return TensorState.FREE
    if all(s is TensorState.HOLD_AFTER_BWD for s in states):
        return TensorState.HOLD_AFTER_BWD
    if any(s is TensorState.HOLD_AFTER_FWD for s in states):
        return TensorState.HOLD_AFTER_FWD
    return TensorState.HOLD


@dataclass
class ParamSlot:
    """Where one parameter lives: chunk index and element range, plus its current state."""

    name: str
    param: torch.nn.Parameter
    group: int
    chunk: int
    offset: int
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.HOLD
    has_grad: bool = False


@dataclass
class Layout:
    """The packing of all parameters into ``num_chunks`` chunks of ``chunk_elems`` elements."""

    chunk_elems: int
    slots: list[ParamSlot]
    chunk_group: list[int]            # optimizer param group of each chunk (-1: padding chunk)
    chunk_slots: list[list[ParamSlot]] = field(default_factory=list)

    @property
    def num_chunks(self) -> int:
        """Number of chunks, padding chunks included."""
        return len(self.chunk_group)

    def waste_elems(self) -> int:
        """Elements of all chunks not covered by a parameter (alignment and tail padding)."""
        return self.num_chunks * self.chunk_elems - sum(s.numel for s in self.slots)


def build_layout(named_params: list[tuple[str, torch.nn.Parameter]], param_groups: list[list[int]],
                 chunk_elems: int, world_size: int = 1) -> Layout:
    """Pack parameters (indices into ``named_params`` per optimizer group, each in registration
    order) into chunks; pad the chunk count to a multiple of ``world_size``."""
    slots: list[ParamSlot] = []
    chunk_group: list[int] = []
    for g, members in enumerate(param_groups):
        used = None
        for i in members:
            name, p = named_params[i]
            n = p.numel()
            if n > chunk_elems:
                raise ValueError(f"parameter {name} has {n} elements, more than the chunk size {chunk_elems}; "
                                 "pass a larger chunk_elems or leave it to the search")
            if used is None or used + n > chunk_elems:
                chunk_group.append(g)
                used = 0
            slots.append(ParamSlot(name, p, g, len(chunk_group) - 1, used, n, p.shape))
            used += aligned_elems(n)
    while len(chunk_group) % world_size:
        chunk_group.append(-1)
    chunk_slots: list[list[ParamSlot]] = [[] for _ in chunk_group]
    for s in slots:
        chunk_slots[s.chunk].append(s)
    return Layout(chunk_elems, slots, chunk_group, chunk_slots)


class Chunk:
    """One chunk of one list: a host buffer and/or an arena slot, plus bookkeeping."""

    def __init__(self, kind: str, index: int, numel: int, dtype: torch.dtype):
        self.kind, self.index, self.numel, self.dtype = kind, index, numel, dtype
        self.present = False      # False: FREE (ZeRO chunk of another rank, not gathered)
        self.host: torch.Tensor | None = None
        self.dev_off: int | None = None
        self.dirty = False        # device copy newer than host copy
        self.zero = False         # logically all zeros; buffers not yet written
        self.pins = 0
        self.fixed = False        # placed on the device for good (optimizer state that fits)
        self.event = None

    @property
    def key(self) -> tuple[str, int]:
        """(list kind, chunk index)."""
        return (self.kind, self.index)

    @property
    def nbytes(self) -> int:
        """Payload bytes."""
        return self.numel * self.dtype.itemsize
