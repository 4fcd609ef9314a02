"""The wrapped model: module hooks that fetch parameter chunks, saved-tensor hooks, gradient hooks.

* Forward: a module's pre-forward hook gathers (ZeRO) and fetches the chunks of its own parameters
  and pins them (COMPUTE); its post-forward hook unpins them (HOLD_AFTER_FWD).
* Saved tensors: a tensor autograd saves that views a parameter chunk is saved as (chunk, offset,
  shape, stride), never as a pointer into a slot, because the chunk may move before backward. When
  backward unpacks it, the chunk is fetched again (pre-backward use, at the exact operator) and the
  view rebuilt where the chunk is now. The last ``BACKWARD_PINS`` distinct chunks stay pinned.
* Gradients: a post-accumulate-grad hook adds ``param.grad`` into the fp32 gradient chunk, drops
  ``param.grad`` and marks the tensor HOLD_AFTER_BWD (with ZeRO this can complete a group and
  trigger its reduce-scatter). Tied parameters get one hook call per backward, after both uses.
* Recomputation (``torch.utils.checkpoint`` inside the model, or a program's checkpoint region): a
  forward that runs during backward fetches its chunks again and keeps them pinned, because the
  recomputed activations view the slots directly (checkpoint's own saved-tensor hooks replace ours
  there): a module's until all the chunk's tensors are HOLD_AFTER_BWD; a program's fetch of one
  parameter until that parameter's gradient is in (every op reading it has run its backward).
* Programs instead of the module's forward (``module_hooks=False``; cauto.runtime's DTensor
  program with chunked parameter shards): :meth:`ChunkedModel.run` wraps one forward,
  :meth:`ChunkedModel.fetch` gathers, fetches and pins a parameter's chunk and returns the
  parameter (viewing it), :meth:`ChunkedModel.release` unpins it. Saved DTensors whose local tensor
  views a chunk are saved as a reference plus their DTensor spec, like plain tensors.
* Non-model memory, which the warm-up (the first optimizer step) measures to size the arena: on
  CUDA, allocated bytes minus the arena, at every chunk access and at the allocator's peak. On CPU
  each forward-to-end-of-backward of the warm-up runs under ``torch.profiler`` (``profile_memory``)
  and its peak of live bytes (``cauto.runtime.verify.allocation_peak``: every allocation and free,
  frees on gloo threads dated at their storage's death, ``cauto.runtime.storage_deaths``) is added to what was live when it started and is not model
  state: this rank's inputs at their local size (``input_bytes``: a slice of a global batch counts
  as the copy a device would hold), parameters outside the chunks and buffers. The chunk manager's
  own buffers (host chunks, the all-gather's and reduce-scatter's staging and gloo's copies in them:
  host memory beside a device) are left out (allocated in a profiler scope, ``manager.OWN_BUFFERS``). A CPU warm-up under a profiler already
  running cannot be measured and raises.
"""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from cauto.profiler.memory_session import memory_session
from cauto.runtime.storage_deaths import StorageDeaths

from .chunk import Layout, TensorState
from .manager import BACKWARD_PINS, GRAD, OWN_BUFFERS, PARAM, ChunkManager

#: the chunked model whose CPU warm-up is being measured, if any: one profiler session per process, so a
#: warm-up left open (a forward and backward with no step after it) is ended by the next model's, and at exit
_MEASURING: list = []


def _end_open_measurement() -> None:
    if _MEASURING:
        _MEASURING[0].end_measure()


atexit.register(_end_open_measurement)


@dataclass(frozen=True)
class _ParamRef:
    index: int
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]
    spec: object = None  # the DTensorSpec when the saved tensor was a DTensor


class ChunkedModel(nn.Module):
    """A model whose parameters live in chunks; call it like the original module."""

    def __init__(self, module: nn.Module, manager: ChunkManager, layout: Layout, module_hooks: bool = True):
        super().__init__()
        self.module = module
        self.manager = manager
        self.layout = layout
        self._slot_of = {id(s.param): s for s in layout.slots}
        self._module_slots: dict[nn.Module, list] = {}
        for m in module.modules():
            slots = [self._slot_of[id(p)] for p in m.parameters(recurse=False) if id(p) in self._slot_of]
            if slots and module_hooks:
                self._module_slots[m] = slots
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward)
        for s in layout.slots:
            s.param.register_post_accumulate_grad_hook(self._grad_hook)
        self._in_backward = False
        self._ring: list[tuple[str, int]] = []
        self._recompute_pins: dict[int, int] = {}
        #: a program's recomputation: id(parameter) -> pins of its chunk held until its gradient is in
        self._slot_pins: dict[int, int] = {}
        self._session = None  # the profiler measuring a CPU warm-up step, and what was live before it
        self._session_base_bytes = 0
        self._prof = None
        self._deaths = None  # StorageDeaths over the same step: frees on gloo threads (verify module doc)
        self._session_end_ns: int | None = None
        #: bytes of the inputs of the next forward at the size this rank holds them (module doc)
        self.input_bytes = 0
        #: in a program's forward (run): slot index -> what its first fetch returned (the program's own
        #: bookkeeping, so that every use of a parameter sends its gradient through one autograd node)
        self.fetched: dict[int, object] = {}
        self.new_iteration = False

    def forward(self, *args, **kwargs):
        """Run the wrapped module (floating inputs cast to the compute dtype); return its output."""
        dtype = self.manager.compute_dtype
        if dtype != torch.float32:
            cast = lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        self.input_bytes = sum(x.numel() * x.element_size() for x in (*args, *kwargs.values()) if torch.is_tensor(x))
        return self.run(self.module, *args, **kwargs)

    # ---------------------------------------------------------------- programs (module_hooks=False)
    def run(self, program, *args, **kwargs):
        """Run ``program(*args, **kwargs)`` as one forward of the chunked parameters: the module (its
        hooks fetch chunks) or a program that calls fetch/release."""
        mgr = self.manager
        if self.new_iteration:
            mgr.iteration_start()
            self.new_iteration = False
        mgr.begin_forward()
        self._start_measure()
        self.fetched = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = program(*args, **kwargs)
        finally:
            self.fetched = {}
        mgr.gather_groups(mgr.num_groups)  # same all-gathers on every rank, used or not
        return out

    def fetch(self, index: int) -> torch.Tensor:
        """Parameter ``layout.slots[index]`` (its leaf tensor, viewing its chunk on the device), with its
        chunk gathered, fetched and pinned until :meth:`release`; during backward (a checkpoint region's
        recomputation fetches its chunked parameters again) pinned until this parameter's gradient is in:
        every backward op that reads the recomputed view has run by then (module docstring)."""
        s = self.layout.slots[index]
        recompute = torch._C._current_graph_task_id() != -1
        if recompute:
            self._begin_backward()
        self.manager.gather_for(s.chunk)
        self.manager.access((PARAM, s.chunk))
        if recompute:  # held until this parameter's gradient is in (_grad_hook): no later read of it
            self._slot_pins[id(s.param)] = self._slot_pins.get(id(s.param), 0) + 1
        else:
            s.state = TensorState.COMPUTE
        return s.param

    def release(self, index: int) -> None:
        """Unpin the chunk of parameter ``layout.slots[index]`` (its forward use is over); during backward
        nothing: a recomputation's pin lasts until the chunk's gradients are in."""
        if torch._C._current_graph_task_id() != -1:
            return
        s = self.layout.slots[index]
        self.manager.release((PARAM, s.chunk))
        if s.state is TensorState.COMPUTE:
            s.state = TensorState.HOLD_AFTER_FWD

    # ---------------------------------------------------------------- forward hooks
    def _pre_forward(self, module, args):
        recompute = torch._C._current_graph_task_id() != -1
        if recompute:
            self._begin_backward()
        for i in sorted({s.chunk for s in self._module_slots[module]}):
            self.manager.gather_for(i)
            self.manager.access((PARAM, i))
            if recompute:
                self._recompute_pins[i] = self._recompute_pins.get(i, 0) + 1
        if not recompute:
            for s in self._module_slots[module]:
                s.state = TensorState.COMPUTE

    def _post_forward(self, module, args, output):
        if torch._C._current_graph_task_id() != -1:
            return  # recomputation: chunks stay pinned until their gradients are in
        for i in sorted({s.chunk for s in self._module_slots[module]}):
            self.manager.release((PARAM, i))
        for s in self._module_slots[module]:
            s.state = TensorState.HOLD_AFTER_FWD

    # ---------------------------------------------------------------- saved tensors
    def _pack(self, t: torch.Tensor):
        spec, local = (t._spec, t._local_tensor) if isinstance(t, DTensor) else (None, t)
        try:
            found = self.manager.find_param_chunk(local)
        except (RuntimeError, NotImplementedError):
            return t
        if found is not None:
            chunk, offset = found
            return _ParamRef(chunk.index, offset, local.shape, local.stride(), spec)
        return t

    def _unpack(self, saved):
        if not isinstance(saved, _ParamRef):
            return saved
        self._begin_backward()
        key = (PARAM, saved.index)
        base = self.manager.access(key)
        if key in self._ring:
            self.manager.release(key)
        else:
            self._ring.append(key)
            if len(self._ring) > BACKWARD_PINS:
                self.manager.release(self._ring.pop(0))
        view = base.as_strided(saved.shape, saved.stride, base.storage_offset() + saved.offset)
        return view if saved.spec is None else DTensor(view, saved.spec, requires_grad=False)

    # ---------------------------------------------------------------- backward
    def _begin_backward(self):
        if self._in_backward:
            return
        self._in_backward = True
        self.manager.begin_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _grad_hook(self, param: torch.Tensor) -> None:
        self._begin_backward()
        mgr = self.manager
        s = self._slot_of[id(param)]
        grad = param.grad
        param.grad = None
        key = (GRAD, s.chunk)
        buf = mgr.access(key)
        buf[s.offset: s.offset + s.numel].add_(grad.reshape(-1))
        mgr.mark_dirty(mgr.chunks[key])
        mgr.release(key)
        s.state = TensorState.HOLD_AFTER_BWD
        s.has_grad = True
        for _ in range(self._slot_pins.pop(id(param), 0)):
            mgr.release((PARAM, s.chunk))
        if s.chunk in self._recompute_pins and all(
                x.state is TensorState.HOLD_AFTER_BWD for x in self.layout.chunk_slots[s.chunk]):
            for _ in range(self._recompute_pins.pop(s.chunk)):
                mgr.release((PARAM, s.chunk))
        mgr.grad_done(s.chunk)

    def _end_backward(self):
        for key in self._ring:
            self.manager.release(key)
        self._ring.clear()
        for i, pins in self._recompute_pins.items():
            for _ in range(pins):
                self.manager.release((PARAM, i))
        self._recompute_pins.clear()
        for pid, pins in self._slot_pins.items():
            for _ in range(pins):
                self.manager.release((PARAM, self._slot_of[pid].chunk))
        self._slot_pins.clear()
        self.manager.end_backward()
        self._in_backward = False
        if self._session is not None and self._session_end_ns is None:
            # the profiler stops on the thread that started it (next forward or optimizer step): the
            # measured region ends here, before what the caller runs after backward
            self._session_end_ns = time.time_ns()

    # ---------------------------------------------------------------- measuring a CPU warm-up step
    def _start_measure(self) -> None:
        """At a forward: end the measurement still open; start one if this is a CPU warm-up forward (module doc)."""
        mgr = self.manager
        self.end_measure()
        if _MEASURING:  # another chunked model's warm-up that never reached its next forward or step
            _MEASURING[0].end_measure()
        if mgr.device.type != "cpu" or not mgr.recording:
            return
        if torch._C._autograd._profiler_enabled():
            raise RuntimeError("the chunk manager measures its CPU warm-up step (the first optimizer step) with "
                               "torch.profiler, and a profiler is already running: start yours after that step")
        self._session_base_bytes = self.input_bytes + self._resident_nonmodel_bytes()
        mgr.measuring = True
        self._session = memory_session()
        self._prof = self._session.__enter__()
        self._deaths = StorageDeaths()
        self._deaths.__enter__()
        _MEASURING[:] = [self]

    def end_measure(self) -> None:
        """Stop measuring (at the next forward, or the warm-up's end) and raise the manager's non-model
        peak to what the measured forward and backward reached."""
        if self._session is None:
            return
        from cauto.runtime.verify import allocation_peak  # not at the top: cauto.runtime imports this module

        session, self._session = self._session, None
        if _MEASURING and _MEASURING[0] is self:
            _MEASURING.clear()
        deaths, self._deaths = self._deaths, None
        deaths.__exit__(None, None, None)
        session.__exit__(None, None, None)
        mgr = self.manager
        mgr.measuring = False
        peak = self._session_base_bytes + allocation_peak(self._prof, steady_state=True, until_ns=self._session_end_ns,
                                                          exclude_scope=OWN_BUFFERS, lifetimes=deaths.lifetimes())
        self._prof, self._session_end_ns = None, None
        mgr.nonmodel_peak_bytes = max(mgr.nonmodel_peak_bytes, peak)

    def _resident_nonmodel_bytes(self) -> int:
        """Bytes of the parameters outside the chunks and the buffers, each storage once."""
        storages: dict[int, int] = {}
        chunked = {id(s.param) for s in self.layout.slots}
        tensors = [p for p in self.module.parameters() if id(p) not in chunked] + list(self.module.buffers())
        for t in tensors:
            t = t._local_tensor if isinstance(t, DTensor) else t
            if t.device.type != "meta":
                st = t.untyped_storage()
                storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        return sum(storages.values())
