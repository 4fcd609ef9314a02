"""Which part of the global batch this rank loads: ``model.batch_slice()``, for a per-rank DataLoader.

The plan places every user input; the mesh axes on which the inputs are split on their batch
dimension (``Shard(0)``) are the data-parallel axes the plan chose. The ranks along those axes load
disjoint slices of each global batch; ranks that differ only on the other axes (tensor parallel,
inputs ``Replicate``) load the same slice. ``batch_slice()`` says which, in the terms of
``torch.utils.data.DistributedSampler``::

    s = model.batch_slice()                       # BatchSlice(index=1, count=2, axes=(0,))
    sampler = DistributedSampler(dataset, num_replicas=s.count, rank=s.index, shuffle=True, seed=0,
                                 drop_last=True)
    loader = DataLoader(dataset, batch_size=s.local_batch(global_batch), sampler=sampler, drop_last=True)
    for epoch in range(E):
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = model(**batch)                 # this rank's slice: the shape tells it from the global batch

(``s.sampler(dataset, ...)`` builds that sampler.) The global batch of a step is the ranks' local
batches concatenated in ``index`` order: the loss and the gradients are the single-process ones of
that global batch (tests/test_training.py checks it). ``index`` counts row-major over ``axes``, as
``input_slices()`` cuts the global batch (``torch.chunk`` per mesh axis, axes in order).

A plan that splits an input on another dimension, or splits different inputs over different axes,
has no single batch slice: ``batch_slice()`` raises and ``input_slices()`` gives each input's slice.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard

from cauto.runtime.dist_utils import to_placements


@dataclass(frozen=True)
class BatchSlice:
    """This rank's part of the global batch: slice ``index`` of ``count`` equal ones (module docstring)."""

    index: int
    count: int
    #: the mesh axes the batch dimension is split over (the plan's data-parallel axes)
    axes: tuple[int, ...]

    def local_batch(self, global_batch: int) -> int:
        """The per-rank batch size of a global batch of ``global_batch`` samples (must divide evenly)."""
        if global_batch % self.count:
            raise ValueError(f"a global batch of {global_batch} does not split into {self.count} equal slices "
                             f"(the plan splits the batch over mesh axes {list(self.axes)}); use a multiple of {self.count}")
        return global_batch // self.count

    def rows(self, global_batch: int) -> slice:
        """This rank's rows of a global batch of ``global_batch`` samples."""
        n = self.local_batch(global_batch)
        return slice(self.index * n, (self.index + 1) * n)

    def sampler(self, dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        """A ``DistributedSampler`` over ``dataset`` that yields this rank's samples (call ``set_epoch``)."""
        from torch.utils.data import DistributedSampler
        return DistributedSampler(dataset, num_replicas=self.count, rank=self.index, shuffle=shuffle, seed=seed,
                                  drop_last=drop_last)


def batch_slice(capture, plan, mesh, uneven: str = "raise") -> BatchSlice:
    """The BatchSlice of this rank for a plan's user inputs (module docstring). When there is none (the plan
    splits its inputs differently, or one off its batch dimension): ``uneven="raise"`` raises ValueError;
    ``uneven="whole"`` warns and returns the whole batch (every rank loads whole micro-batches and the module
    cuts each input as the plan places it: correct, at the cost of loading more)."""
    if uneven not in ("raise", "whole"):
        raise ValueError(f"batch_slice(uneven={uneven!r}): expected 'raise' or 'whole'")
    try:
        return _batch_slice(capture, plan, mesh)
    except ValueError as why:
        if uneven == "raise":
            raise
        warnings.warn(f"cauto: every rank loads whole micro-batches: {why}", stacklevel=3)
        return BatchSlice(index=0, count=1, axes=())


def _batch_slice(capture, plan, mesh) -> BatchSlice:
    split: tuple[int, ...] | None = None
    first = None
    for node in capture.graph.nodes:
        if node.op != "placeholder" or capture.placeholders[node.name][0] != "input":
            continue
        val = node.meta.get("val")
        if val is None or getattr(val, "dim", lambda: 0)() == 0:
            continue
        name = capture.placeholders[node.name][1]
        placements = to_placements(tuple(plan.nodes[node.name]["outputs"][0]))
        other = [(a, p) for a, p in enumerate(placements) if not isinstance(p, (Replicate, Shard))
                 or (isinstance(p, Shard) and p.dim != 0)]
        if other:
            axis, p = other[0]
            raise ValueError(f"the plan places input {name!r} {p} on mesh axis {axis}, not split on its batch dimension: "
                             "there is no single batch slice; load what input_slices() says for each input")
        axes = tuple(a for a, p in enumerate(placements) if isinstance(p, Shard) and mesh.size(a) > 1)
        if split is not None and axes != split:
            raise ValueError(f"the plan splits input {first!r} over mesh axes {list(split)} and input {name!r} over "
                             f"{list(axes)}: there is no single batch slice; load what input_slices() says for each input")
        split, first = axes, name
    split = split or ()
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    index, count = 0, 1
    for a in split:
        index = index * mesh.size(a) + coords[a]
        count *= mesh.size(a)
    return BatchSlice(index=index, count=count, axes=split)


__all__ = ["BatchSlice", "batch_slice"]
