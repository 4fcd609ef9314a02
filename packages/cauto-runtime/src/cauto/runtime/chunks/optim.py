"""Adam/AdamW over chunks: on the device for chunks whose optimizer state is there, on the host
(torch's fused CPU kernel) for the others; real global-norm clipping; fp16 loss scaling.

Every update runs ``torch._fused_adamw_`` / ``torch._fused_adam_`` on per-parameter views of the
chunks, so the arithmetic per element is that of ``torch.optim.AdamW(fused=True)``. Parameters
without a gradient in this step (on every rank) are skipped, as torch does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .chunk import TensorState
from .manager import EXP_AVG, EXP_AVG_SQ, GRAD, MASTER, PARAM, RGRAD, ChunkManager
from .model import ChunkedModel


class ChunkedAdam:
    """Optimizer over a :class:`ChunkedModel`'s chunks; use like a torch optimizer
    (``step``, ``zero_grad``), plus ``clip_grad_norm_`` and ``backward`` (loss scaling)."""

    def __init__(self, model: ChunkedModel, param_groups: list[dict], decoupled: bool = True,
                 max_grad_norm: float | None = None, loss_scale: float | None = None,
                 growth_interval: int = 1000):
        self.model = model
        self.manager: ChunkManager = model.manager
        self.param_groups = param_groups
        self.decoupled = decoupled
        self.max_grad_norm = max_grad_norm
        self.loss_scale = loss_scale
        self.growth_interval = growth_interval
        self._good_steps = 0
        self.steps = {s.name: 0 for s in self.manager.layout.slots}
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None

    # ---------------------------------------------------------------- helpers
    @property
    def _grad_kind(self) -> str:
        return GRAD if self.manager.world_size == 1 else RGRAD

    def _owned_chunks(self):
        layout = self.manager.layout
        for i in range(layout.num_chunks):
            if self.manager.owned(i) and layout.chunk_group[i] >= 0:
                yield i

    def _sync_has_grad(self) -> None:
        mgr = self.manager
        if mgr.world_size == 1:
            return
        slots = mgr.layout.slots
        flags = torch.tensor([float(s.has_grad) for s in slots])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mgr.pg)
        for s, f in zip(slots, flags.tolist()):
            s.has_grad = f > 0

    def _grad_views(self) -> list[torch.Tensor]:
        mgr = self.manager
        views = []
        for i in self._owned_chunks():
            c = mgr.chunks[(self._grad_kind, i)]
            slots = [s for s in mgr.layout.chunk_slots[i] if s.has_grad]
            if slots:
                buf = mgr.payload(c)
                mgr.mark_dirty(c)
                views += [buf[s.offset: s.offset + s.numel] for s in slots]
        return views

    def _all_reduce_max(self, value: float) -> float:
        if self.manager.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.manager.pg)
        return t.item()

    # ---------------------------------------------------------------- public API
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the loss scale when training in fp16."""
        (loss * self.loss_scale if self.loss_scale else loss).backward()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients so that their global L2 norm is at most ``max_norm``; return the norm
        before clipping (like ``torch.nn.utils.clip_grad_norm_``, over every rank's shard)."""
        self._sync_has_grad()
        views = self._grad_views()
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for v in views:
            by_device.setdefault(v.device, []).append(v)
        norms = [n.cpu() for group in by_device.values() for n in torch._foreach_norm(group)]
        if self.manager.world_size == 1:
            total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        else:
            sq = torch.stack(norms).pow(2).sum() if norms else torch.zeros(())
            dist.all_reduce(sq, group=self.manager.pg)
            total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for device, group in by_device.items():
            torch._foreach_mul_(group, coef.to(device))
        self.last_grad_norm = total.item()
        return total

    @torch.no_grad()
    def step(self) -> None:
        """One Adam/AdamW update of every owned chunk (skipped on fp16 overflow)."""
        mgr = self.manager
        self._sync_has_grad()
        if self.loss_scale:
            views = self._grad_views()
            finite = all(bool(torch.isfinite(v).all()) for v in views)
            if self._all_reduce_max(0.0 if finite else 1.0) > 0:
                self.loss_scale /= 2
                self._good_steps = 0
                self.skipped_steps += 1
                self._end_step()
                return
            torch._foreach_mul_(views, 1.0 / self.loss_scale) if views else None
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.loss_scale *= 2
        if self.max_grad_norm is not None:
            self.clip_grad_norm_(self.max_grad_norm)
        for i in self._owned_chunks():
            slots = [s for s in mgr.layout.chunk_slots[i] if s.has_grad]
            if slots:
                self._update_chunk(i, slots)
        self._end_step()

    def _update_chunk(self, i: int, slots) -> None:
        mgr = self.manager
        hp = self.param_groups[mgr.layout.chunk_group[i]]
        gk, pk = (self._grad_kind, i), (MASTER if mgr.has_master else PARAM, i)
        m_c, v_c = mgr.chunks[(EXP_AVG, i)], mgr.chunks[(EXP_AVG_SQ, i)]
        on_device = m_c.fixed
        if on_device:
            g, p = mgr.access(gk), mgr.access(pk)
            m, v = mgr.payload(m_c), mgr.payload(v_c)
        else:
            g, m, v = mgr.host_view(mgr.chunks[gk]), mgr.host_view(m_c), mgr.host_view(v_c)
            p = mgr.host_view(mgr.chunks[pk])
            mgr.drop_device(mgr.chunks[pk])
        steps = []
        for s in slots:
            self.steps[s.name] += 1
            steps.append(torch.full((), float(self.steps[s.name]), dtype=torch.float32, device=p.device))

        def views(buf):
            return [buf[s.offset: s.offset + s.numel] for s in slots]

        kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        beta1, beta2 = hp["betas"]
        kernel(views(p), views(g), views(m), views(v), [], steps, lr=float(hp["lr"]), beta1=beta1,
               beta2=beta2, weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=False, maximize=False)
        if on_device:
            for c in (mgr.chunks[pk], m_c, v_c):
                mgr.mark_dirty(c)
            if mgr.has_master:
                lp = mgr.access((PARAM, i))
                lp.copy_(p)
                mgr.mark_dirty(mgr.chunks[(PARAM, i)])
                mgr.release((PARAM, i))
            mgr.release(gk)
            mgr.release(pk)
        elif mgr.has_master:
            lp_c = mgr.chunks[(PARAM, i)]
            mgr.drop_device(lp_c)
            mgr.host_view(lp_c).copy_(p)

    def _end_step(self) -> None:
        self.model.end_measure()
        self.manager.finish_warmup()
        self.model.new_iteration = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients (device copies are dropped; chunks become logically zero)."""
        mgr = self.manager
        for i in range(mgr.layout.num_chunks):
            for kind in (GRAD, RGRAD):
                c = mgr.chunks.get((kind, i))
                if c is not None and c.present:
                    mgr.drop_device(c)
                    c.zero = True
        for s in mgr.layout.slots:
            s.has_grad = False
            if s.state is not TensorState.FREE:
                s.state = TensorState.HOLD

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """This rank's shard: owned param/master/m/v chunks (host buffers, not copies), step counts,
        layout and loss scale. Never holds more than this rank's own chunks."""
        mgr = self.manager
        kinds = [PARAM, EXP_AVG, EXP_AVG_SQ] + ([MASTER] if mgr.has_master else [])
        return {
            "world_size": mgr.world_size, "rank": mgr.rank, "chunk_elems": mgr.layout.chunk_elems,
            "slots": [(s.name, s.chunk, s.offset, s.numel) for s in mgr.layout.slots],
            "steps": dict(self.steps), "loss_scale": self.loss_scale,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "chunks": {f"{k}/{i}": mgr.host_view(mgr.chunks[(k, i)]) for i in self._owned_chunks() for k in kinds},
        }

    def load_state_dict(self, state: dict) -> None:
        """Load a shard written by :meth:`state_dict` on the same rank of the same layout."""
        mgr = self.manager
        mine = [(s.name, s.chunk, s.offset, s.numel) for s in mgr.layout.slots]
        if state["world_size"] != mgr.world_size or [tuple(x) for x in state["slots"]] != mine:
            raise ValueError(f"checkpoint shard is for world size {state['world_size']} and a different chunk "
                             f"layout; this run has world size {mgr.world_size}, chunk_elems {mgr.layout.chunk_elems}."
                             " Load with the same model, parameter groups, chunk_elems and world size.")
        for name, t in state["chunks"].items():
            kind, i = name.split("/")
            c = mgr.chunks[(kind, int(i))]
            mgr.host_view(c).copy_(t)
            mgr.host_written(c)
        self.steps = dict(state["steps"])
        self.loss_scale = state["loss_scale"]
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update(saved)
