"""Gradient clipping over a parallelized model: one global norm, each gradient counted exactly once.

``clip_grad_norm_(model, max_norm)`` is ``torch.nn.utils.clip_grad_norm_`` for what ``apply`` returns,
whatever the plan placed where. Each rank adds up ``|g|^p`` over the gradient elements it holds and
counts each element once over the whole mesh:

* a gradient sharded on a mesh axis (``Shard(d)``, FSDP or tensor parallel) adds every shard: the
  ranks along that axis hold disjoint parts of it;
* a gradient replicated on a mesh axis (``Replicate``: data parallel, or a tensor-parallel axis that
  does not split it) is counted by the rank at coordinate 0 of that axis only;
* a gradient still ``Partial`` on an axis (not synchronized: a plan whose sync redistributes it later)
  is reduced first, for the norm only (a collective per such gradient; after a normal backward none is);
* plain parameters (a data-parallel plan's, replicated everywhere) are counted by rank 0 only;
* chunked state: each chunk's reduced gradient is owned by one rank of the ZeRO group (the plan's
  data-parallel axes), which counts it; on the other (tensor-parallel) axes the parameter's
  placement decides as above.

Then one all-reduce of a scalar over the world (sum, or max for ``inf``), in float64, and every
gradient is scaled in place by ``max_norm / (norm + 1e-6)`` when that is below 1, as torch does.
Returns the norm before clipping, a float32 scalar tensor equal on every rank.

Call it after ``backward`` and before ``optimizer.step()``; with gradient accumulation, after the
last micro-batch (on the synchronized gradients): clipping while ``no_sync`` holds unsynchronized
gradients raises, because no rank has the global gradient then.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def _counted_here(placements, coords) -> bool:
    """Whether this rank counts its part of a gradient placed ``placements`` (module docstring)."""
    return all(c == 0 for p, c in zip(placements, coords) if isinstance(p, Replicate))


def _power_sum(t: torch.Tensor, p: float) -> torch.Tensor:
    """``sum |t|^p`` (``max |t|`` for inf) as a float64 scalar."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    if math.isinf(p):
        return t.detach().abs().max().double()
    return torch.linalg.vector_norm(t.detach(), p, dtype=torch.float32).double() ** p


def _finish(parts: list[torch.Tensor], grads: list[torch.Tensor], max_norm: float, p: float, device,
            error_if_nonfinite: bool) -> torch.Tensor:
    if math.isinf(p):
        local = torch.stack(parts).max() if parts else torch.zeros((), dtype=torch.float64, device=device)
    else:
        local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)
    total = local.reshape(1).to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM)
    norm = total[0] if math.isinf(p) else total[0] ** (1.0 / p)
    norm = norm.float()
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of order {p} of the gradients is non-finite ({float(norm)}); "
                           "pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for dev, group in by_device.items():
        torch._foreach_mul_(group, coef.to(dev))
    return norm


def clip_grad_norm_(module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``module`` (a ParallelModule or ChunkedParallelModule) to global norm
    ``max_norm`` of order ``norm_type``, in place; return the norm before clipping (module docstring)."""
    p = float(norm_type)
    sync = getattr(module, "grad_sync", None)
    if sync is not None and getattr(sync, "pending", False):
        raise RuntimeError("clip_grad_norm_ was called inside no_sync(): the gradients are this rank's "
                           "unsynchronized micro-batch sums; clip after the last micro-batch's backward, outside no_sync")
    if getattr(module, "chunked", None) is not None:
        return _clip_chunked(module, max_norm, p, error_if_nonfinite)
    mesh = module.mesh
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    parts, grads = [], []
    device = torch.device("cpu")
    for param in module.parameters():  # deduplicated: a tied parameter once
        g = param.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            placements = tuple(g.placements)
            if any(isinstance(q, Partial) for q in placements):
                reduced = g.redistribute(g.device_mesh, [Replicate() if isinstance(q, Partial) else q
                                                         for q in placements])
                placements, local = tuple(reduced.placements), reduced._local_tensor
            else:
                local = g._local_tensor
            grads.append(g._local_tensor)
        else:
            placements, local = (Replicate(),) * mesh.ndim, g
            grads.append(g)
        device = local.device
        if _counted_here(placements, coords):
            parts.append(_power_sum(local, p).to(device))
    return _finish(parts, grads, max_norm, p, device, error_if_nonfinite)


def _clip_chunked(module, max_norm: float, p: float, error_if_nonfinite: bool) -> torch.Tensor:
    """Chunked state: the gradient chunks this rank owns (the ZeRO group's share), each slot counted
    once on the mesh axes outside the group as its placement there says."""
    opt = module.optimizer
    mgr = opt.manager
    opt._sync_has_grad()
    shards = getattr(module, "_shards", None) or {}
    placement_of = {s.index: (s.placements, s.data_axes) for s in shards.values()}
    mesh = module.mesh
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    parts, grads = [], []
    device = torch.device("cpu")
    index = {id(s): k for k, s in enumerate(mgr.layout.slots)}
    for i in opt._owned_chunks():
        c = mgr.chunks[(opt._grad_kind, i)]
        slots = [s for s in mgr.layout.chunk_slots[i] if s.has_grad]
        if not slots:
            continue
        buf = mgr.payload(c)
        mgr.mark_dirty(c)
        for s in slots:
            view = buf[s.offset: s.offset + s.numel]
            grads.append(view)
            device = view.device
            placements, data_axes = placement_of.get(index[id(s)], ((Replicate(),) * mesh.ndim,
                                                                    frozenset(range(mesh.ndim))))
            # on the ZeRO axes the owner counts it (already unique there); elsewhere as placed
            outside = [(q, c_) for axis, (q, c_) in enumerate(zip(placements, coords)) if axis not in data_axes]
            if _counted_here([q for q, _ in outside], [c_ for _, c_ in outside]):
                parts.append(_power_sum(view, p).to(device))
    norm = _finish(parts, grads, max_norm, p, device, error_if_nonfinite)
    opt.last_grad_norm = float(norm)
    return norm


__all__ = ["clip_grad_norm_"]
