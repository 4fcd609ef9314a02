"""Gradient synchronization: bring each gradient to its parameter's placement, bucketed and overlapped.

A parameter replicated on a data-parallel axis gets a gradient that is Partial there. Left alone,
DTensor would all-reduce it parameter by parameter when the optimizer touches it, with no overlap
(the speed trap in ARCHITECTURE.md). Instead, a post-accumulate-grad hook on every parameter puts
its gradient into a bucket as soon as autograd has it; a full bucket (at most ``bucket_bytes``, or
one larger gradient) is flattened into one buffer and all-reduced asynchronously while backward goes on, as DDP does. At the
end of backward (an autograd engine callback) the last buckets are launched, all are waited for and
each gradient becomes a DTensor with its parameter's placements, viewing the reduced buffer.

Bucketed: Partial(sum|avg) -> Replicate on any set of mesh axes (the data-parallel case).
Everything else (Partial -> Shard: a reduce-scatter; Partial(max)) is redistributed per parameter
at the end of backward, which is correct but not bucketed.

Mixed precision's bf16 reduction (``reduce_dtype``): a floating bucket of another dtype is cast to
it before the all-reduce and back after, and the per-parameter fallback redistributes in it (DTensor's
``backward_dtype`` analogue), as FSDP2's ``reduce_dtype``.

Gradient accumulation: while ``sync`` is False (``ParallelModule.no_sync()``, read when the forward
runs) the hooks leave every gradient as backward made it, this rank's unreduced sum (``pending``
then says that such gradients are there); the next backward with ``sync`` on buckets and reduces the
accumulated gradients, once per optimizer step, as above. Without ``no_sync`` a second backward
adds a new Partial gradient to a synchronized one, which DTensor then all-reduces per parameter
(correct, slower).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter] = field(default_factory=list)
    nbytes: int = 0


class GradSync:
    """Hooks that synchronize the gradients of ``params`` on ``mesh`` after each backward."""

    def __init__(self, params: list[torch.nn.Parameter], mesh: DeviceMesh, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 plain_grad_placements: dict[int, tuple] | None = None, reduce_dtype: torch.dtype | None = None):
        """``params``: DTensor parameters, and plain ones (replicated everywhere, the local program's)
        whose gradients arrive as local tensors with the placements ``plain_grad_placements[id(p)]``
        (read at each gradient: the local program fills it when it is traced)."""
        self.mesh = mesh
        #: the dtype floating gradients are reduced in (None: their own; module docstring)
        self.reduce_dtype = reduce_dtype
        self._plain = plain_grad_placements if plain_grad_placements is not None else {}
        #: buckets the local program's backward graph all-reduces itself (lowering.bucket_gradient_reductions),
        #: reported with this object's own after each backward
        self.in_graph: list[tuple[str, int, int]] = []
        self.bucket_bytes = bucket_bytes
        self._open: dict[tuple, _Bucket] = {}
        self._inflight: list[tuple[tuple, list, torch.Tensor, object]] = []
        self._fallback: list[torch.nn.Parameter] = []
        self._queued = False
        #: per finished backward: (op, axis, bytes) of each bucket, for verify
        self.last_buckets: list[tuple[str, int, int]] = []
        #: per finished backward: buckets launched while backward was still running (overlapped)
        self.last_overlapped = 0
        self._early = 0
        #: whether backward synchronizes gradients (False inside ``no_sync``); ``begin`` reads it per forward
        self.sync = True
        #: gradients accumulated without synchronization are on the parameters (reduced at the next sync)
        self.pending = False
        self._syncing = True
        self._handles = []
        seen = set()
        for p in params:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _key(self, p: torch.nn.Parameter) -> tuple | None:
        """(dtype, ((axis, reduce_op), ...)) when the gradient can go into a bucket, None otherwise."""
        axes = []
        have = p.grad.placements if isinstance(p.grad, DTensor) else self._plain[id(p)]
        want_all = p.placements if isinstance(p, DTensor) else [Replicate()] * self.mesh.ndim
        for axis, (g, want) in enumerate(zip(have, want_all)):
            if g == want:
                continue
            if isinstance(g, Partial) and isinstance(want, Replicate) and g.reduce_op in ("sum", "avg"):
                axes.append((axis, g.reduce_op))
            else:
                return None
        return (p.grad.dtype, tuple(axes))

    def begin(self) -> bool:
        """Called by each training forward: the backward of this forward synchronizes iff ``sync``.
        Returns whether the program should reduce gradients itself (no unreduced ones accumulated)."""
        self._syncing = self.sync
        return self.sync and not self.pending

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        if not self._syncing:
            self.pending = True
            return
        grad = p.grad
        if isinstance(grad, DTensor):
            if tuple(grad.placements) == tuple(p.placements):
                return
        elif isinstance(p, DTensor) or all(isinstance(g, Replicate) for g in self._plain.get(id(p), ())):
            return
        key = self._key(p)
        if key is None:
            self._fallback.append(p)
            return
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        nbytes = local.numel() * local.element_size()
        # The backward graph's rule (lowering.bucket_gradient_reductions): a bucket holds at most
        # bucket_bytes (or one larger gradient), so a step reduces in the same buckets whether the graph or
        # this object reduces them (gradient accumulation: the same collectives at any number of micro-batches)
        if key in self._open and self._open[key].nbytes + nbytes > self.bucket_bytes:
            self._launch(key)
            self._early += 1
        bucket = self._open.setdefault(key, _Bucket())
        bucket.params.append(p)
        bucket.nbytes += nbytes
        if bucket.nbytes >= self.bucket_bytes:
            self._launch(key)
            self._early += 1

    def _launch(self, key: tuple) -> None:
        bucket = self._open.pop(key)
        flat = torch.cat([_local(p.grad).reshape(-1) for p in bucket.params])
        if self._moves_in(flat.dtype) != flat.dtype:
            flat = flat.to(self.reduce_dtype)
        (axis, _), *_ = key[1]
        work = dist.all_reduce(flat, group=self.mesh.get_group(axis), async_op=True)
        self._inflight.append((key, bucket.params, flat, work))

    def _finish(self) -> None:
        if not self._syncing:  # accumulating: nothing launched, nothing to report
            self.last_buckets, self.last_overlapped, self._queued = [], 0, False
            return
        self.pending = False
        for key in list(self._open):
            self._launch(key)
        self.last_buckets = list(self.in_graph)
        self._early += max(len(self.in_graph) - 1, 0)  # every in-graph bucket but the last overlaps backward
        for key, params, flat, work in self._inflight:
            work.wait()
            axes = key[1]
            for axis, _ in axes[1:]:
                dist.all_reduce(flat, group=self.mesh.get_group(axis))
            for axis, op in axes:
                self.last_buckets.append(("all_reduce", axis, flat.numel() * flat.element_size()))
                if op == "avg":
                    flat.div_(self.mesh.size(axis))
            if flat.dtype != key[0]:  # reduced in reduce_dtype: back to the gradients' dtype
                flat = flat.to(key[0])
            offset = 0
            for p in params:
                local = _local(p.grad)
                n = local.numel()
                view = flat[offset:offset + n].view_as(local)
                p.grad = view if not isinstance(p, DTensor) else DTensor.from_local(
                    view, self.mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                offset += n
        for p in self._fallback:
            moved = self._moves_in(p.grad.dtype)
            p.grad = p.grad.redistribute(self.mesh, p.placements) if moved == p.grad.dtype else \
                p.grad.to(moved).redistribute(self.mesh, p.placements).to(p.grad.dtype)
        self.last_overlapped, self._early = self._early, 0
        self._inflight, self._fallback, self._queued = [], [], False

    def _moves_in(self, dtype: torch.dtype) -> torch.dtype:
        return reduction_dtype(dtype, self.reduce_dtype)

    def remove(self) -> None:
        """Remove the hooks (the parameters' gradients are then left as autograd makes them)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def reduction_dtype(grad_dtype: torch.dtype, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a gradient of ``grad_dtype`` is reduced in: mixed precision's ``reduce_dtype`` for a floating
    gradient, else its own (the one rule of this object's buckets and of the backward graph's)."""
    return grad_dtype if reduce_dtype is None or not grad_dtype.is_floating_point else reduce_dtype


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if isinstance(grad, DTensor) else grad
