"""Checkpoint schedules of a chain, as nested levels, and the op sequences they run.

A schedule for stages s..t is a *level*: a tuple of items covering s..t in order.

* ``Stored(k)``: stage k runs forward with autograd recording (op ``F_all``) and keeps all it saves
  (x̄_{k+1}) until its backward ``B``.
* ``Region(a, b, inner)``: stages a..b run forward without recording (``F_ck`` for a, which keeps
  its input a^a, then ``F_n`` for a+1..b, each dropping its input). When backward reaches a^{b+1},
  the region runs ``inner`` (a level covering a..b): the recomputation, itself free to store some
  stages and to nest further regions.

The last item of every level is ``Stored``: a level ends with the stage whose gradient input comes
from outside. Each rotor decision is one item: "keep everything of stage s" is ``Stored(s)``,
"run s..j−1 without recording" is ``Region(s, j−1, ·)``. A region is what the runtime wraps in
one non-reentrant ``torch.utils.checkpoint``; its inner regions are the nested checkpoints.

The op sequence of a level is the forward of every item in order, then the backward of every item
in reverse order, where the backward of a region is the op sequence of its inner level.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

F_ALL, F_CK, F_N, BWD = "F_all", "F_ck", "F_n", "B"
OPS = (F_ALL, F_CK, F_N, BWD)


@dataclass(frozen=True)
class Stored:
    """Stage ``stage`` runs recorded and keeps its saved tensors until its backward."""

    stage: int


@dataclass(frozen=True)
class Region:
    """Stages first..last run without recording, then are recomputed by ``inner`` in backward."""

    first: int
    last: int
    inner: tuple[Item, ...]

    def __post_init__(self):
        if self.first > self.last:
            raise ValueError(f"region {self.first}..{self.last} is empty")
        covered = stages_of(self.inner)
        if covered != list(range(self.first, self.last + 1)):
            raise ValueError(f"region {self.first}..{self.last}: inner level covers stages {covered}")
        if not isinstance(self.inner[-1], Stored):
            raise ValueError(f"region {self.first}..{self.last}: inner level must end with a stored stage")


Item = Stored | Region
Schedule = tuple[Item, ...]
Op = tuple[str, int]


def stages_of(level: Schedule) -> list[int]:
    """The stages a level covers, in order."""
    out: list[int] = []
    for item in level:
        out.extend([item.stage] if isinstance(item, Stored) else range(item.first, item.last + 1))
    return out


def store_all(num_stages: int) -> Schedule:
    """The schedule without checkpointing: every stage stored."""
    return tuple(Stored(k) for k in range(num_stages))


def to_ops(level: Schedule) -> list[Op]:
    """The op sequence (``(op, stage)`` pairs) that runs a level forward and back."""
    ops: list[Op] = []
    _emit(level, ops)
    return ops


def _emit(level: Schedule, ops: list[Op]) -> None:
    for item in level:
        if isinstance(item, Stored):
            ops.append((F_ALL, item.stage))
        else:
            ops.append((F_CK, item.first))
            ops.extend((F_N, k) for k in range(item.first + 1, item.last + 1))
    for item in reversed(level):
        if isinstance(item, Stored):
            ops.append((BWD, item.stage))
        else:
            _emit(item.inner, ops)


def regions_of(level: Schedule) -> Iterator[Region]:
    """Every region of a schedule, outer before inner (preorder)."""
    for item in level:
        if isinstance(item, Region):
            yield item
            yield from regions_of(item.inner)


def describe(level: Schedule) -> str:
    """A compact text form: stored stages as numbers, regions as [first-last: inner]."""
    parts = []
    for item in level:
        if isinstance(item, Stored):
            parts.append(str(item.stage))
        else:
            parts.append(f"[{item.first}-{item.last}: {describe(item.inner)}]")
    return " ".join(parts)
