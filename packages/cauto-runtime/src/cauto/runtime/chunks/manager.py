"""The chunk manager: where every chunk is, moving it on use, evicting by next use, ZeRO collectives.

Chunk lists (one :class:`Chunk` per list and chunk index, all with the same layout):

* ``param``  compute-precision parameters; the model's ``nn.Parameter`` objects are views into it.
* ``grad``   fp32 gradients accumulated during backward (with ZeRO: this micro-batch's local ones).
* ``rgrad``  ZeRO only: the reduce-scattered, accumulated gradient of the chunks this rank owns.
* ``master`` fp32 master parameters (only when the compute dtype is not fp32; else ``param`` is it).
* ``m``, ``v`` Adam moments.

Placement. A chunk is on the device (a slot of the :class:`~.memory.Arena`), on the host, or both
(host copy clean). ``access`` moves a chunk to the device and pins it; eviction copies back only
when the device copy is newer than the host one. The first iteration is a warm-up: it records the
sequence of chunk accesses and the non-model peak (on CUDA allocated bytes minus the arena at each
access and at the allocator's peak; on CPU measured by the wrapped model, chunks/model.py), evicting
least-recently-used. Afterwards the arena shrinks to budget minus the non-model peak, and eviction is Belady/OPT on the
recorded sequence: evict the unpinned chunk whose next use is furthest away. After each access the
next chunk of the sequence is prefetched when it fits without evicting anything.

ZeRO (world_size W > 1). Chunks form groups of W consecutive chunks; rank r owns chunk g*W + r and
holds its optimizer state. Collectives run in one order on every rank so that data-dependent
control flow (a parameter unused on one rank) cannot hang the job: all-gathers go up the group
index (using group g gathers every group below it first; the end of forward gathers the rest),
reduce-scatters go down it (group g is reduced once it and every group above it is done; the end of
backward reduces the rest, used or not).
"""

from __future__ import annotations

import bisect
import contextlib
from collections import OrderedDict

import torch
import torch.distributed as dist

from .arena import Arena, BudgetError, Mover
from .chunk import Chunk, Layout, TensorState, chunk_state

PARAM, GRAD, RGRAD, MASTER, EXP_AVG, EXP_AVG_SQ = "param", "grad", "rgrad", "master", "m", "v"
BACKWARD_PINS = 2  # distinct param chunks an autograd node may unpack at once
OWN_BUFFERS = "cauto::chunk_buffers"  # the profiler scope in which the manager allocates its own buffers


POLICIES = ("belady", "lru", "naive")


class ChunkManager:
    """Owns every chunk of one rank; see the module docstring for the policy.

    ``policy="naive"`` is the ZeRO-Offload-like reference the benchmark compares against: a param
    chunk goes back to the host as soon as it is unpinned (so each use moves it again), a grad chunk
    as soon as all its gradients of this backward are in, nothing is prefetched and the optimizer
    state always stays on the host. ``policy="lru"`` is the ablation that evicts the least recently
    used chunk instead of using the warm-up trace (everything else as "belady").
    """

    def __init__(self, layout: Layout, compute_dtype: torch.dtype, device: torch.device, budget_bytes: int,
                 warmup_arena_bytes: int, process_group=None, policy: str = "belady", average_grads: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"unknown chunk policy {policy!r}; choose one of {POLICIES}")
        self.policy = policy
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.device = device
        self.budget_bytes = budget_bytes
        self.pg = process_group
        #: the reduce-scatter averages the ranks' gradients (each rank's is of its own batch slice's
        #: loss) or sums them (each rank holds a Partial(sum) share of the global loss's gradient)
        self.average_grads = average_grads
        self.world_size = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.comm_device = device if (process_group is not None and dist.get_backend(process_group) == "nccl") \
            else torch.device("cpu")
        self.mover = Mover(device)
        self.arena = Arena(warmup_arena_bytes, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the warm-up reads the non-model peak from it
        self.has_master = compute_dtype != torch.float32
        n = layout.chunk_elems
        self.chunks: dict[tuple[str, int], Chunk] = {}
        kinds = [(PARAM, compute_dtype), (GRAD, torch.float32), (EXP_AVG, torch.float32), (EXP_AVG_SQ, torch.float32)]
        if self.has_master:
            kinds.append((MASTER, torch.float32))
        if self.world_size > 1:
            kinds.append((RGRAD, torch.float32))
        for i in range(layout.num_chunks):
            for kind, dtype in kinds:
                self.chunks[(kind, i)] = Chunk(kind, i, n, dtype)
        self.resident: OrderedDict[tuple[str, int], Chunk] = OrderedDict()
        self._by_storage: dict[int, list[tuple[int, Chunk]]] = {}
        # warm-up trace and Belady index
        self.recording = True
        self.trace: list[tuple[str, int]] = []
        self.trace_nonmodel_bytes: list[int] = []
        self.trace_pinned_bytes: list[int] = []
        self.next_uses: dict[tuple[str, int], list[int]] = {}
        self.moment = 0
        self.nonmodel_bytes = 0   # CUDA: non-model bytes at the last recorded access
        self.nonmodel_peak_bytes = 0
        #: while a CPU warm-up step is measured (chunks/model.py): this manager allocates its own buffers
        #: (host chunks, collective staging, gloo's copies inside its collectives) in a profiler scope
        #: named ``OWN_BUFFERS``: not non-model memory
        self.measuring = False
        self._gathered_groups = 0
        self._reduced_below = 0
        self._empty = torch.empty(0, dtype=compute_dtype, device=device)

    # ---------------------------------------------------------------- ownership and init
    def owned(self, index: int) -> bool:
        """Whether this rank owns chunk ``index`` (holds its optimizer state and gradient shard)."""
        return index % self.world_size == self.rank

    @property
    def num_groups(self) -> int:
        """Number of ZeRO chunk groups (world_size chunks each)."""
        return self.layout.num_chunks // self.world_size

    def init_from_params(self) -> None:
        """Copy the model's parameters into the owned host chunks and point parameters at them."""
        for i, slots in enumerate(self.layout.chunk_slots):
            if self.owned(i):
                pc = self._make_present(self.chunks[(PARAM, i)], zero=True)
                host = self.host_view(pc)
                for s in slots:
                    host[s.offset: s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                if self.has_master:
                    mc = self._make_present(self.chunks[(MASTER, i)], zero=True)
                    mhost = self.host_view(mc)
                    for s in slots:
                        mhost[s.offset: s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                for kind in (EXP_AVG, EXP_AVG_SQ, RGRAD):
                    if (kind, i) in self.chunks:
                        self._make_present(self.chunks[(kind, i)], zero=True)
            if self.world_size == 1:
                self._make_present(self.chunks[(GRAD, i)], zero=True)
            self._repoint(self.chunks[(PARAM, i)])

    def _own_buffers(self):
        """The context in which this manager allocates its own buffers: a profiler scope (``OWN_BUFFERS``)
        while a warm-up step is measured."""
        return torch.profiler.record_function(OWN_BUFFERS) if self.measuring else contextlib.nullcontext()

    def _make_present(self, c: Chunk, zero: bool) -> Chunk:
        c.present, c.zero, c.dirty = True, zero, False
        return c

    # ---------------------------------------------------------------- views and param pointers
    def host_view(self, c: Chunk) -> torch.Tensor:
        """The chunk's content on the host (copying back a newer device copy, keeping it resident)."""
        if c.host is None:
            with self._own_buffers():
                c.host = self.mover.host_empty(c.numel, c.dtype)
            if c.kind == PARAM:
                self._register(c)
        if c.zero:
            c.host.zero_()
            c.zero = False
            if c.dev_off is not None:
                self.arena.view(c.dev_off, c.numel, c.dtype).zero_()
        elif c.dev_off is not None and c.dirty:
            self.mover.to_host(self.arena.view(c.dev_off, c.numel, c.dtype), c.host)
            c.dirty = False
        return c.host

    def payload(self, c: Chunk) -> torch.Tensor:
        """The chunk's current content where it is: its arena slot if resident, else the host."""
        if c.dev_off is not None:
            if c.event is not None:
                torch.cuda.current_stream(self.device).wait_event(c.event)
                c.event = None
            return self.arena.view(c.dev_off, c.numel, c.dtype)
        return self.host_view(c)

    def _repoint(self, c: Chunk) -> None:
        if c.kind != PARAM:
            return
        base = None
        if c.present:  # no stream wait here: a prefetched chunk is waited for when accessed
            base = self.arena.view(c.dev_off, c.numel, c.dtype) if c.dev_off is not None else self.host_view(c)
        for s in self.layout.chunk_slots[c.index]:
            s.param.data = self._empty if base is None else base[s.offset: s.offset + s.numel].view(s.shape)
            if base is None:
                s.state = TensorState.FREE
            elif s.state is TensorState.FREE:
                s.state = TensorState.HOLD

    def _register(self, c: Chunk) -> None:
        t = c.host
        start = t.storage_offset() * t.element_size()
        entries = self._by_storage.setdefault(t.untyped_storage().data_ptr(), [])
        entries.append((start, c))
        entries.sort(key=lambda e: e[0])

    def _unregister(self, c: Chunk) -> None:
        t = c.host
        ptr = t.untyped_storage().data_ptr()
        entries = [e for e in self._by_storage.get(ptr, []) if e[1] is not c]
        if entries:
            self._by_storage[ptr] = entries
        else:
            self._by_storage.pop(ptr, None)

    def find_param_chunk(self, t: torch.Tensor) -> tuple[Chunk, int] | None:
        """If ``t`` views a param chunk (arena slot or host buffer), return it and the element
        offset of ``t`` inside the chunk; else None."""
        if t.dtype != self.compute_dtype:
            return None
        ptr = t.untyped_storage().data_ptr()
        byte = t.storage_offset() * t.element_size()
        if ptr == self.arena.buffer.untyped_storage().data_ptr():
            for c in self.resident.values():
                if c.kind == PARAM and c.dev_off <= byte < c.dev_off + c.nbytes:
                    return c, (byte - c.dev_off) // t.element_size()
            return None
        entries = self._by_storage.get(ptr)
        if not entries:
            return None
        i = bisect.bisect_right([e[0] for e in entries], byte) - 1
        if i < 0:
            return None
        start, c = entries[i]
        if byte < start + c.nbytes:
            return c, (byte - start) // t.element_size()
        return None

    # ---------------------------------------------------------------- moving
    def access(self, key: tuple[str, int]) -> torch.Tensor:
        """Move chunk ``key`` to the device if needed, pin it, and return its device payload."""
        c = self.chunks[key]
        if not c.present:
            raise RuntimeError(f"chunk {key} is not present on rank {self.rank} (ZeRO chunk not gathered)")
        self._record(key)
        if c.dev_off is None:
            self._place(c)
        c.pins += 1
        self.resident.move_to_end(key)
        self._prefetch()
        return self.payload(c)

    def release(self, key: tuple[str, int]) -> None:
        """Unpin a chunk pinned by :meth:`access` (no-op if it was discarded after its reduce-scatter)."""
        c = self.chunks[key]
        if not c.present:
            return
        c.pins -= 1
        assert c.pins >= 0, key
        if self.policy == "naive" and c.kind == PARAM and not c.pins:
            self.evict(c)

    def grad_done(self, index: int) -> None:
        """Called after a gradient was added to grad chunk ``index``: ZeRO reduce-scatters that are
        ready run; the naive policy sends a completed grad chunk to the host."""
        if self.policy == "naive":
            if all(s.state is TensorState.HOLD_AFTER_BWD for s in self.layout.chunk_slots[index]):
                self.evict(self.chunks[(GRAD, index)])
        self.reduce_ready()

    def end_backward(self) -> None:
        """End of a backward pass: reduce-scatter every group not reduced yet, in order."""
        self.reduce_ready(final=True)
        if self.policy == "naive":
            for c in [c for c in self.resident.values() if c.kind == GRAD]:
                self.evict(c)

    def _record(self, key) -> None:
        if self.recording:
            if self.device.type == "cuda":
                self.nonmodel_bytes = torch.cuda.memory_allocated(self.device) - self.arena.nbytes
            self.trace.append(key)
            self.trace_nonmodel_bytes.append(self.nonmodel_bytes)
            self.trace_pinned_bytes.append(sum(c.nbytes for c in self.resident.values() if c.pins or c.fixed))
            self.nonmodel_peak_bytes = max(self.nonmodel_peak_bytes, self.nonmodel_bytes)
        self.moment += 1

    def _place(self, c: Chunk, evict: bool = True) -> bool:
        off = self.arena.alloc(c.nbytes)
        while off is None:
            victim = self._victim() if evict else None
            if victim is None:
                if not evict:
                    return False
                pinned = sum(x.nbytes for x in self.resident.values() if x.pins or x.fixed)
                raise BudgetError(
                    f"chunk {c.key} ({c.nbytes} B) does not fit in the device arena of {self.arena.nbytes} B "
                    f"(device budget {self.budget_bytes} B minus non-model peak {self.nonmodel_peak_bytes} B): "
                    f"{pinned} B are pinned by chunks in use. Raise device_budget or lower chunk_elems.")
            self.evict(victim)
            off = self.arena.alloc(c.nbytes)
        c.dev_off = off
        self.resident[c.key] = c
        view = self.arena.view(off, c.numel, c.dtype)
        if c.zero:
            view.zero_()
            c.zero, c.dirty = False, True
            if c.host is not None:
                c.host.zero_()
                c.dirty = False
        else:
            c.event = self.mover.to_device(c.host, view)
            c.dirty = False
        self._repoint(c)
        return True

    def _victim(self) -> Chunk | None:
        candidates = [c for c in self.resident.values() if not c.pins and not c.fixed]
        if not candidates:
            return None
        if self.recording or not self.trace or self.policy == "lru":
            return candidates[0]  # least recently used
        period = len(self.trace)
        now = self.moment % period

        def next_use(c: Chunk) -> int:
            uses = self.next_uses.get(c.key)
            if not uses:
                return 1 << 62
            i = bisect.bisect_right(uses, now)
            return uses[i] if i < len(uses) else uses[0] + period

        return max(candidates, key=next_use)

    def _prefetch(self) -> None:
        if self.recording or not self.trace or self.policy == "naive":
            return
        key = self.trace[self.moment % len(self.trace)]
        c = self.chunks[key]
        if c.present and c.dev_off is None and not c.zero:
            self._place(c, evict=False)

    def evict(self, c: Chunk) -> None:
        """Move a resident chunk to the host (copying only if the device copy is newer)."""
        if c.dirty:
            self.host_view(c)
        self.drop_device(c)

    def drop_device(self, c: Chunk) -> None:
        """Forget the device copy without copying it back (the host copy is valid or unwanted)."""
        if c.dev_off is None:
            return
        assert not c.pins, f"dropping pinned chunk {c.key}"
        self.arena.free(c.dev_off, c.nbytes)
        c.dev_off, c.dirty, c.event = None, False, None
        del self.resident[c.key]
        self._repoint(c)

    def discard(self, c: Chunk) -> None:
        """Make a chunk FREE: no payload anywhere."""
        if c.dev_off is not None:
            c.pins = 0
            c.dirty = False
            self.drop_device(c)
        if c.host is not None and c.kind == PARAM:
            self._unregister(c)
        c.host, c.present, c.zero, c.dirty = None, False, False, False
        self._repoint(c)

    def host_written(self, c: Chunk) -> None:
        """The chunk's host copy was just written (a checkpoint loaded into it): a device copy that must
        stay (fixed optimizer state) takes it, any other is dropped, and parameters view the new values."""
        if c.fixed:
            self.payload(c).copy_(self.host_view(c))
            self.mark_dirty(c)
        else:
            self.drop_device(c)
        self._repoint(c)

    def mark_dirty(self, c: Chunk) -> None:
        """Record that the device copy was written."""
        if c.dev_off is not None:
            c.dirty = True

    # ---------------------------------------------------------------- warm-up end
    def finish_warmup(self) -> None:
        """Freeze the trace, size the arena to budget minus non-model peak, place optimizer state."""
        if not self.recording:
            return
        self.recording = False
        if self.device.type == "cuda":  # peaks inside operators, between the recorded moments
            peak = torch.cuda.max_memory_allocated(self.device) - self.arena.nbytes
            self.nonmodel_peak_bytes = max(self.nonmodel_peak_bytes, peak)
        for pos, key in enumerate(self.trace):
            self.next_uses.setdefault(key, []).append(pos)
        for c in list(self.resident.values()):
            c.pins = 0
            self.evict(c)
        arena_bytes = self.budget_bytes - self.nonmodel_peak_bytes
        if arena_bytes < max(self.trace_pinned_bytes, default=0):
            raise BudgetError(
                f"device budget {self.budget_bytes} B minus non-model peak {self.nonmodel_peak_bytes} B leaves "
                f"{arena_bytes} B for chunks, but {max(self.trace_pinned_bytes)} B of chunks were in use at once "
                "in the warm-up. Raise device_budget or lower chunk_elems.")
        self.arena = None  # free the warm-up arena before allocating the final one
        self.arena = Arena(arena_bytes, self.device)
        self.moment = 0
        # Optimizer state goes on the device only where every param and grad chunk fits beside it.
        used_keys = {k for k in self.trace if k[0] in (PARAM, GRAD)}
        used = sum(self.chunks[k].nbytes for k in used_keys)
        free = self.arena.nbytes - used if self.policy != "naive" else 0
        for i in range(self.layout.num_chunks):
            if not self.owned(i) or self.layout.chunk_group[i] < 0:
                continue
            kinds = [EXP_AVG, EXP_AVG_SQ] + ([MASTER] if self.has_master else [])
            need = sum(self.chunks[(k, i)].nbytes for k in kinds)
            if need > free:
                break
            for k in kinds:
                c = self.chunks[(k, i)]
                self._place(c, evict=False)
                c.fixed = True
            free -= need

    def iteration_start(self) -> None:
        """Align the Belady clock with the trace at the start of an iteration (after a step)."""
        if not self.recording:
            self.moment = 0

    # ---------------------------------------------------------------- ZeRO collectives
    def begin_forward(self) -> None:
        """Reset the gather pointer; chunks gathered by an earlier forward without backward go."""
        if self.world_size == 1:
            return
        for i in range(self.layout.num_chunks):
            if not self.owned(i) and self.chunks[(PARAM, i)].present:
                self.discard(self.chunks[(PARAM, i)])
        self._gathered_groups = 0
        self._reduced_below = self.num_groups

    def gather_for(self, index: int) -> None:
        """Make chunk ``index`` present, gathering every group up to its own in order."""
        if self.world_size == 1:
            return
        self.gather_groups(index // self.world_size + 1)

    def gather_groups(self, upto: int) -> None:
        """All-gather groups ``[gathered, upto)`` in increasing order."""
        w, n = self.world_size, self.layout.chunk_elems
        while w > 1 and self._gathered_groups < upto:
            g = self._gathered_groups
            own = self.chunks[(PARAM, g * w + self.rank)]
            inp = self.host_view(own).to(self.comm_device) if self.comm_device.type == "cpu" \
                else self.payload(own)
            with self._own_buffers():
                out = torch.empty(w * n, dtype=self.compute_dtype, device=self.comm_device)
                dist.all_gather_single(out, inp, group=self.pg)
            self.mover.traffic.comm_bytes += out.numel() * out.element_size()
            host_out = out.cpu()
            for r in range(w):
                if r == self.rank:
                    continue
                c = self.chunks[(PARAM, g * w + r)]
                c.host = host_out[r * n: (r + 1) * n]
                self._register(c)
                self._make_present(c, zero=False)
                self._repoint(c)
            self._gathered_groups += 1

    def begin_backward(self) -> None:
        """Start a backward pass: fresh zero local gradient chunks (ZeRO), reduce pointer at the top."""
        if self.world_size > 1:
            self._reduced_below = self.num_groups
            for i in range(self.layout.num_chunks):
                c = self.chunks[(GRAD, i)]
                if not c.present:
                    self._make_present(c, zero=True)

    def group_done(self, g: int) -> bool:
        """Whether every tensor of group ``g`` is HOLD_AFTER_BWD (its gradients are all in)."""
        w = self.world_size
        states = [s.state for i in range(g * w, (g + 1) * w) for s in self.layout.chunk_slots[i]]
        return not states or chunk_state(states) is TensorState.HOLD_AFTER_BWD

    def reduce_ready(self, final: bool = False) -> None:
        """Reduce-scatter groups from the top down while they are done (all of them if ``final``)."""
        if self.world_size == 1:
            return
        while self._reduced_below > 0 and (final or self.group_done(self._reduced_below - 1)):
            self._reduced_below -= 1
            with self._own_buffers():
                self._reduce_group(self._reduced_below)

    def _reduce_group(self, g: int) -> None:
        w, n = self.world_size, self.layout.chunk_elems
        inp = torch.empty(w * n, dtype=torch.float32, device=self.comm_device)
        for r in range(w):
            c = self.chunks[(GRAD, g * w + r)]
            dst = inp[r * n: (r + 1) * n]
            if c.present and not c.zero:
                dst.copy_(self.payload(c))
            else:
                dst.zero_()
            self.discard(c)
        out = torch.empty(n, dtype=torch.float32, device=self.comm_device)
        dist.reduce_scatter_single(out, inp, group=self.pg)
        self.mover.traffic.comm_bytes += inp.numel() * inp.element_size()
        if self.average_grads:
            out.div_(w)
        own = g * w + self.rank
        rg = self.chunks[(RGRAD, own)]
        if rg.dev_off is not None:
            self.payload(rg).add_(out.to(self.device))
            self.mark_dirty(rg)
        else:
            self.host_view(rg).add_(out)
        for r in range(w):
            if r != self.rank:
                self.discard(self.chunks[(PARAM, g * w + r)])
