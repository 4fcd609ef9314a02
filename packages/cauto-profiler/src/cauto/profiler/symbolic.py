"""The symbolic training-step profiler: exact peak memory, FLOPs, bytes and time without memory.

``profile(fn)`` captures the model once (:func:`cauto.profiler.capture.capture`, on meta), gives
its parameters, buffers and inputs storage-less tensors (meta by default, or FakeTensorMode) with
the model's shapes, strides, dtypes and storage sharing, and runs ``steps`` real training steps
over them — the captured graph forward node by node, ``loss.backward()``, the optimizer's
``step()`` and ``zero_grad(set_to_none=True)`` — exactly the loop
:mod:`cauto.profiler.ground_truth` measures.

A dispatch mode sees every op. It counts every new storage (``untyped_storage().nbytes()``) when
an op returns it and uncounts it when the storage dies (weakref finalizer), so live bytes follow
the real allocator. Each allocation is attributed to the graph node that ran it: in forward the
executor says which; in backward the running autograd node's sequence number maps back to the
forward node that created it. Checkpointed regions (torch.utils.checkpoint, non-reentrant,
marked at capture) run under the same checkpoint, so recomputation shows up where it happens.
What kernels allocate internally, out of the dispatcher's sight, is modelled: wrapped Python
scalars, checkpoint's RNG state, and on CPU the buffers of the kernels that allocate inside
themselves (oneDNN convolutions and matmuls, some ATen kernels), asked of the real kernel once per op
and metadata (:mod:`cauto.profiler.kernel_allocs`); see ``Profile.modelled_effects``.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import operator
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    is_fake,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from cauto.profiler.capture import (
    Capture,
    CaptureError,
    capture,
    concrete_int,
    module_path,
    output_tensors,
    tensor_bytes,
)
from cauto.profiler.devices import DeviceModel, get_device_model
from cauto.profiler.hints import current_hints, size_hint
from cauto.profiler.kernel_allocs import KERNELS, MAX_BYTES, MAX_FLOPS, cpu_description, kernel_allocs
from cauto.profiler.progress import ProgressFn, StepProgress
from cauto.profiler.training import OPTIMIZERS, make_optimizer, run_steps, unique_storage_bytes, with_dtype

_AUTOCAST = {None: None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16}
_DTYPES = {None: None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_CUDA_BLOCK = 512


# --------------------------------------------------------------------------------------------- FLOPs

def _sdpa_cpu_fwd(query, key, value, *args, out_val=None, **kwargs):
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_cpu_bwd(grad_out, query, key, value, *args, out_val=None, **kwargs):
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


#: op overload packet -> f(*args, out_val=..., **kwargs) -> FLOPs. torch's registry plus the CPU
#: flash-attention kernels it counts as 0 in this torch.
FLOP_FORMULAS: dict = dict(flop_registry)
for _name, _fn in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu_fwd),
                   ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_bwd)):
    _packet = getattr(torch.ops.aten, _name, None)
    if _packet is not None and _packet not in FLOP_FORMULAS:
        FLOP_FORMULAS[_packet] = _fn


# ------------------------------------------------------------------------------------------- results

@dataclass
class NodeStats:
    """Per-graph-node costs (forward from step 1, backward from step 1)."""

    id: str
    op: str
    module: str
    output_bytes: int = 0
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    fwd_kernels: list = field(default_factory=list)  #: (flops, bytes, dtype) per kernel
    bwd_kernels: list = field(default_factory=list)
    fwd_time_s: float = 0.0
    bwd_time_s: float = 0.0
    saved_bytes: int = 0
    transient_bytes: int = 0
    allocated_bytes: int = 0  #: bytes allocated while this node ran (all phases, all steps)

    def row(self) -> dict:
        return {k: getattr(self, k) for k in ("id", "op", "module", "output_bytes", "fwd_flops", "bwd_flops",
                                               "fwd_bytes", "bwd_bytes", "fwd_time_s", "bwd_time_s",
                                               "saved_bytes", "transient_bytes")}


@dataclass
class Profile:
    """What ``profile()`` found. Bytes are per device; FLOPs are per training step (fwd + bwd)."""

    name: str
    capture: Capture
    settings: dict
    device_model: DeviceModel
    peak_bytes: int
    baseline_bytes: int
    phases: dict[str, int]
    phase_steps: dict[str, int]
    nodes: dict[str, NodeStats]
    timeline: list[tuple[int, str, str | None, int]]
    modelled_effects: list[str]
    peak_event: tuple[int, str, str | None, int] | None = None

    @property
    def flops(self) -> float:
        """Total forward + backward FLOPs of one step."""
        return sum(n.fwd_flops + n.bwd_flops for n in self.nodes.values())

    @property
    def time_s(self) -> float:
        """Roofline estimate of one step's forward + backward compute time on the device model."""
        return sum(n.fwd_time_s + n.bwd_time_s for n in self.nodes.values())

    def node_table(self) -> list[dict]:
        """One row per graph node, in execution order."""
        return [n.row() for n in self.nodes.values()]

    def module_table(self, depth: int | None = None) -> list[dict]:
        """Roll-up per module path prefix (every prefix of every node's module path, '' = whole model).

        With ``depth``, only prefixes of at most that many dotted components.
        """
        rows: dict[str, dict] = {}
        for n in self.nodes.values():
            parts = n.module.split(".") if n.module else []
            prefixes = [""] + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            for p in prefixes:
                if depth is not None and p and p.count(".") + 1 > depth:
                    continue
                r = rows.setdefault(p, {"module": p, "nodes": 0, "fwd_flops": 0.0, "bwd_flops": 0.0,
                                        "saved_bytes": 0, "output_bytes": 0, "time_s": 0.0})
                r["nodes"] += 1
                r["fwd_flops"] += n.fwd_flops
                r["bwd_flops"] += n.bwd_flops
                r["saved_bytes"] += n.saved_bytes
                r["output_bytes"] += n.output_bytes
                r["time_s"] += n.fwd_time_s + n.bwd_time_s
        return sorted(rows.values(), key=lambda r: r["module"])

    def summary(self) -> dict:
        """A JSON-able summary (what ``cauto-profile --json`` prints)."""
        return {"name": self.name, "settings": self.settings, "device": self.device_model.to_dict(),
                "peak_bytes": self.peak_bytes, "baseline_bytes": self.baseline_bytes, "phases": self.phases,
                "phase_steps": self.phase_steps, "flops": self.flops, "time_s": self.time_s,
                "num_nodes": len(self.nodes), "peak_event": list(self.peak_event) if self.peak_event else None,
                "modelled_effects": self.modelled_effects}

    def retime(self, device_model: DeviceModel | str) -> None:
        """Recompute per-node times for another device model (FLOPs and bytes stay)."""
        dm = get_device_model(device_model, self.settings["device"])
        self.device_model = dm
        for n in self.nodes.values():
            n.fwd_time_s = sum(dm.time(f, b, d) for f, b, d in n.fwd_kernels)
            n.bwd_time_s = sum(dm.time(f, b, d) for f, b, d in n.bwd_kernels)

    def to_graph(self, max_timeline: int = 2000) -> dict:
        """The cauto-plan graph document of this profile (validated by cauto.plan.check_document)."""
        from cauto.profiler.graphdoc import build_graph_document

        return build_graph_document(self, max_timeline=max_timeline)


# ---------------------------------------------------------------------------------------- tracking

class _Tracker(TorchDispatchMode):
    """Counts live storage bytes at the dispatch level and attributes ops to graph nodes."""

    def __init__(self, block: int = 0, count_costs: bool = True, ask_kernels: bool = False):
        super().__init__()
        self.block = block
        #: CPU: ops whose kernels allocate inside themselves are asked what (kernel_allocs)
        self.ask_kernels = ask_kernels
        self.unasked = 0  #: calls of such kernels above the asking limits (not modelled)
        #: f(func, args, kwargs, node name) -> output of a data-dependent op, from size hints
        self.data_dependent: Callable | None = None
        self.special: dict = {}
        #: meta tensors only: op -> 0 (run it), 1 (functional: memoize its output metadata), 2 (in-place)
        self.memoize = False
        #: CPU: a Python number where an op takes a Tensor becomes a wrapped 8-byte CPU tensor, cast
        #: to the op's dtype inside the kernel; both live for the duration of the op
        self.wrapped_scalars = False
        self.scalar_slots: dict = {}
        self.pending = 0
        #: names of the arguments given a Python number since the current forward node began
        self.wrapped_names: set[str] = set()
        self.memo_kind: dict = {}
        self.memo: dict = {}
        self.live: dict[int, tuple[int, str | None, str, int]] = {}  # storage key -> (bytes, node, phase, step)
        self.live_bytes = 0
        self.peak = 0
        self.peak_event: tuple | None = None
        self.phase = "setup"
        self.step = 0
        self.node: str | None = None  # forward node being run (or recomputed)
        self.recompute: str | None = None
        self.events = 0
        self.timeline: list[tuple[int, str, str | None, int]] = []
        self.phase_peak: dict[str, int] = {}
        self.phase_step_peak: dict[str, int] = {}
        self.node_alloc: dict[str | None, int] = defaultdict(int)
        self.seq_ends: list[int] = []  # max autograd sequence number created by each forward node
        self.seq_nodes: list[str] = []
        self.count_costs = count_costs
        self.costs: dict[tuple[str | None, str], list] = defaultdict(list)
        self.transient: dict[str, int] = {}
        self._win_node: str | None = None
        self._win_start = self._win_max = 0
        #: progress: called with the forward node whose backward runs (None: no progress reported)
        self.on_backward: Callable[[str | None], None] | None = None

    # --- phases -------------------------------------------------------------------------------
    def mark(self, phase: str, step: int) -> None:
        self.begin_node(None)
        self.phase, self.step = phase, step
        self.node = None
        if phase == "forward":
            self.seq_ends, self.seq_nodes = [], []
        self._phase_key = f"{phase}:{step}"
        self._bump_phase()

    def _bump_phase(self) -> None:
        live = self.live_bytes
        if live > self.phase_step_peak.get(self._phase_key, -1):
            self.phase_step_peak[self._phase_key] = live
        if live > self.phase_peak.get(self.phase, -1):
            self.phase_peak[self.phase] = live

    # --- attribution --------------------------------------------------------------------------
    def keep_saved_numbers(self, name: str, outputs) -> None:
        """After a forward node ran: a Python number its autograd node saved for backward (mul's other
        factor, div's divisor) is the wrapped 0-dim CPU tensor the Python argument parser made before
        dispatch; it lives until backward releases the node, inside checkpoint regions too (autograd
        exempts wrapped numbers from saved-tensor hooks). Only the attributes named after arguments
        that got a number are read: unpacking another saved tensor would run checkpoint's hooks."""
        if not self.wrapped_names:
            return
        names, self.wrapped_names = self.wrapped_names, set()
        for t in outputs:
            fn = t.grad_fn if isinstance(t, torch.Tensor) else None
            for arg in names if fn is not None else ():
                v = getattr(fn, f"_saved_{arg}", None)
                if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu" and not is_fake(v):
                    self.register(v, name)

    def note_forward_node(self, name: str, outputs) -> None:
        """After a forward node ran: remember which autograd sequence numbers it created."""
        best = -1
        for t in outputs:
            if isinstance(t, torch.Tensor):
                fn = t.grad_fn
                if fn is not None:
                    s = fn._sequence_nr()
                    if s > best:
                        best = s
        if best >= 0 and (not self.seq_ends or best > self.seq_ends[-1]):
            self.seq_ends.append(best)
            self.seq_nodes.append(name)

    def current_node(self) -> str | None:
        if self.phase != "backward":
            return self.node
        if self.recompute is not None:
            return self.recompute
        fn = torch._C._current_autograd_node()
        if fn is None:
            return None
        s = fn._sequence_nr()
        i = bisect.bisect_left(self.seq_ends, s)
        return self.seq_nodes[i] if i < len(self.seq_nodes) else None

    # --- storages -----------------------------------------------------------------------------
    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is None:
            return
        if not entry[0]:
            return
        self.live_bytes -= entry[0]
        self.events += 1
        self.timeline.append((self.events, self.phase, self.current_node(), self.live_bytes))

    def register(self, t: torch.Tensor, node: str | None, nbytes: int | None = None) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        n = st.nbytes() if nbytes is None else nbytes
        if self.block:
            n = max(self.block, -(-n // self.block) * self.block) if n else 0
        self.live[key] = (n, node, self.phase, self.step)
        f = weakref.finalize(st, self._free, key)
        f.atexit = False
        self.live_bytes += n
        self.node_alloc[node] += n
        self.register_peak(node)

    def register_peak(self, node: str | None) -> None:
        """Note the current live bytes as an event (after an allocation, or a momentary high-water mark)."""
        self.events += 1
        ev = (self.events, self.phase, node, self.live_bytes)
        self.timeline.append(ev)
        if self.live_bytes > self.peak:
            self.peak = self.live_bytes
            self.peak_event = ev
        if self.live_bytes > self._win_max:
            self._win_max = self.live_bytes
        self._bump_phase()

    def adopt(self, t: torch.Tensor) -> None:
        """Know a storage that exists before the run (its bytes are in the baseline)."""
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.live:
            self.live[key] = (0, None, "setup", 0)

    def begin_node(self, name: str | None) -> None:
        """Forward of step 1: close the previous node's transient window, open this one's."""
        if self.phase == "forward" and self.step == 1:
            if self._win_node is not None:
                t = self._win_max - max(self._win_start, self.live_bytes)
                if t > self.transient.get(self._win_node, 0):
                    self.transient[self._win_node] = t
            self._win_node, self._win_start, self._win_max = name, self.live_bytes, self.live_bytes
        self.node = name
        self.wrapped_names.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = self.special.get(func)
        if special is not None:
            return special(self, func, args, kwargs)
        kind = self.memo_kind.get(func)
        if kind is None:
            kind = self.memo_kind[func] = _memo_kind(func) if self.memoize else 0
            self.scalar_slots[func] = _scalar_slots(func) if self.wrapped_scalars else ()
        slots = self.scalar_slots[func]
        self.pending = _wrapped_bytes(args, slots) if slots else 0
        if self.pending and self.phase == "forward" and self.recompute is None:
            arguments = func._schema.arguments
            self.wrapped_names.update(arguments[i].name for i in slots if i < len(args) and _is_number(args[i]))
        if kind == 2:  # in-place op on meta tensors: nothing to compute or allocate
            if self.pending:
                self._momentary(self.pending, self.current_node())
            return args[0]
        key = None
        if kind == 1:
            try:
                key = (func, _key(args), _key(tuple(kwargs.items())) if kwargs else None)
                spec = self.memo.get(key)
            except TypeError:  # unhashable argument
                key = spec = None
            if spec is not None:
                out = _build(spec)
                return self._after(func, args, kwargs, out)
        try:
            if self.data_dependent is not None and func._overloadpacket.__name__ in _DATA_DEPENDENT \
                    and self.phase == "forward":
                raise DynamicOutputShapeException(func)
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if self.data_dependent is None:
                raise
            out = self.data_dependent(func, args, kwargs, self.node)
        if key is not None:
            if _aliases_input(out, args):  # e.g. _unsafe_view: the schema says fresh, the kernel aliases
                self.memo_kind[func] = 0
            else:
                self.memo[key] = _spec(out)
        return self._after(func, args, kwargs, out)

    def _after(self, func, args, kwargs, out):
        node = self.current_node()
        if self.on_backward is not None and self.phase == "backward":
            self.on_backward(node)
        if func.is_view and func is not _LIFT_FRESH:  # torch.tensor(...) literals arrive by lift_fresh
            return out
        asked = self._kernel_allocs(func, args, kwargs, out, node) if self.ask_kernels and func in KERNELS else None
        if asked is None:
            self._register_outputs(out, node)
        else:
            out = asked
        if self.pending:
            self._momentary(self.pending, node)
        if self.count_costs and self.step == 1 and self.phase in ("forward", "backward"):
            self._count(func, args, kwargs, out, node)
        return out

    def _register_outputs(self, out, node: str | None) -> None:
        if type(out) is tuple or type(out) is list:
            for t in out:
                if isinstance(t, torch.Tensor):
                    self.register(t, node)
                elif isinstance(t, (list, tuple)):
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self.register(u, node)
        elif isinstance(out, torch.Tensor):
            self.register(out, node)

    def _kernel_allocs(self, func, args, kwargs, out, node):
        """A kernel that allocates inside itself: its measured in-call peak, then its outputs with
        their real storage bytes and strides; returns the outputs (None when it could not be asked:
        the caller registers them as usual).

        The real kernel's strides replace the meta kernel's where they differ: a oneDNN convolution
        of a channels-last input returns a channels-last output, where the meta kernel says
        contiguous, and the layout decides what the next kernels allocate (ConvNeXt's depthwise
        convolutions' backward)."""
        formula = FLOP_FORMULAS.get(func._overloadpacket)
        try:
            flops = formula(*args, out_val=out, **kwargs) if formula is not None else 0
        except Exception:  # noqa: BLE001 - a formula that does not take these arguments
            flops = 0
        asked = kernel_allocs(func, args, kwargs, out, flops)
        if asked is None:
            self.unasked += 1
            return None
        self.pending = 0  # the measured call already held any wrapped Python numbers
        self._momentary(asked.peak_bytes, node)
        strides = iter(asked.output_strides)

        def as_real(t):
            stride = next(strides, None)
            if stride is None or tuple(t.stride()) == stride:
                return t
            return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)

        out = pytree.tree_map_only(torch.Tensor, as_real, out)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t, nbytes in zip(outs, asked.output_bytes):
            self.register(t, node, nbytes)
        return out

    def _momentary(self, nbytes: int, node: str | None) -> None:
        """Bytes alive only inside the current kernel (no storage the dispatcher can see)."""
        self.live_bytes += nbytes
        self.register_peak(node)
        self.live_bytes -= nbytes
        self.events += 1
        self.timeline.append((self.events, self.phase, node, self.live_bytes))

    def _count(self, func, args, kwargs, out, node) -> None:
        formula = FLOP_FORMULAS.get(func._overloadpacket)
        flops = formula(*args, out_val=out, **kwargs) if formula is not None else 0
        nbytes = 0
        dtype = None
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                nbytes += tensor_bytes(t)
                dtype = t.dtype
        self.costs[(node, self.phase)].append((flops, nbytes, dtype))


_CPU_CHOICES: dict = {}


_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "unique_dim",
                   "argwhere", "repeat_interleave"}
_NOT_MEMOIZABLE = {"resize_", "resize_as_", "set_", "_local_scalar_dense", "nonzero", "masked_select", "unique",
                   "_unique2", "unique_consecutive", "unique_dim", "item", "_fused_sdp_choice"}


def _memo_kind(func) -> int:
    """How the tracker may shortcut an op on meta tensors (meta kernels depend only on metadata)."""
    schema = func._schema
    name = func._overloadpacket.__name__
    if name in _NOT_MEMOIZABLE or func.is_view or "out" in func._overloadname or torch.Tag.nondeterministic_seeded in func.tags:
        return 0
    returns = schema.returns
    if schema.is_mutable:
        first = schema.arguments[0] if schema.arguments else None
        if (len(returns) == 1 and returns[0].alias_info is not None and first is not None
                and first.alias_info is not None and first.alias_info.is_write and name.endswith("_")
                and returns[0].alias_info.before_set == first.alias_info.before_set):
            return 2
        return 0
    if not returns or any(r.alias_info is not None for r in returns):
        return 0
    if not all(str(r.type) in ("Tensor", "Tensor[]", "Tensor?") for r in returns):
        return 0
    return 1


def _scalar_slots(func) -> tuple:
    """Positions of Tensor-typed arguments (where a Python number gets wrapped into a tensor)."""
    return tuple(i for i, a in enumerate(func._schema.arguments) if str(a.type) == "Tensor" and not a.kwarg_only)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _wrapped_bytes(args, slots) -> int:
    total = 0
    other = None
    for a in args:
        if isinstance(a, torch.Tensor):
            other = a.dtype
            break
    for i in slots:
        if i < len(args) and isinstance(args[i], (int, float)) and not isinstance(args[i], bool):
            total += 8
            wrapped = torch.float64 if isinstance(args[i], float) else torch.int64
            if other is not None and other != wrapped:
                total += other.itemsize if (other.is_floating_point or isinstance(args[i], int)) else 8
    return total


def _aliases_input(out, args) -> bool:
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    if not outs:
        return False
    ins = {a.untyped_storage()._cdata for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)}
    return any(o.untyped_storage()._cdata in ins for o in outs)


def _key(x):
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.device.type, x.requires_grad)
    if isinstance(x, (tuple, list)):
        return tuple(_key(v) for v in x)
    if isinstance(x, float) and x != x:
        return "nan"
    return x


def _spec(out):
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape), tuple(out.stride()), out.dtype, out.device, out.untyped_storage().nbytes())
    if isinstance(out, (tuple, list)):
        return (type(out), tuple(_spec(o) for o in out))
    return ("value", out)


def _build(spec):
    if spec[0] == "value":
        return spec[1]
    if isinstance(spec[0], type):
        return spec[0](_build(s) for s in spec[1])
    shape, stride, dtype, device, nbytes = spec
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if t.untyped_storage().nbytes() != nbytes:
        t = torch.empty(nbytes, dtype=torch.uint8, device=device).view(dtype).as_strided(shape, stride) \
            if nbytes % t.element_size() == 0 else t
    return t


def _sdpa_choice_cpu(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs) -> int:
    """What at::_fused_sdp_choice picks on this CPU: asked of torch itself, on uninitialized real
    tensors with the same sizes, strides, dtypes and requires_grad, under the same grad mode (cached;
    storage pages are never touched). requires_grad matters: CPU flash attention has no gradient for
    the mask, so eager takes the math path for a float mask that requires grad (T5's and Swin's
    learned position bias)."""
    def spec(t):
        return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)

    key = (spec(q), spec(k), spec(v), spec(attn_mask), float(dropout_p), bool(is_causal),
           tuple(sorted(kwargs.items())), torch.is_grad_enabled())
    choice = _CPU_CHOICES.get(key)
    if choice is None:
        with torch._C._DisableTorchDispatch(), torch.utils._python_dispatch._disable_current_modes():
            real = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                    .requires_grad_(t.requires_grad) for t in (q, k, v, attn_mask)]
            choice = int(torch.ops.aten._fused_sdp_choice.default(*real[:3], real[3], dropout_p, is_causal,
                                                                  **kwargs))
        _CPU_CHOICES[key] = choice
    return choice


def _sdpa_choice_cuda(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs) -> int:
    """What at::_fused_sdp_choice picks on an sm80+ GPU (flash for 16-bit without a mask, else
    memory-efficient attention, else math)."""
    d = q.size(-1)
    dims_ok = q.dim() == 4 and q.size(-1) == k.size(-1) and q.stride(-1) == 1 and k.stride(-1) == 1
    gqa_ok = kwargs.get("enable_gqa") or q.size(1) == k.size(1)
    if dims_ok and gqa_ok and q.dtype in (torch.bfloat16, torch.float16) and attn_mask is None \
            and d <= 256 and d % 8 == 0 and v.size(-1) == d:
        return _SDP_FLASH
    if dims_ok and gqa_ok and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and d % 4 == 0 and \
            v.size(-1) % 4 == 0 and q.size(1) == k.size(1):
        return _SDP_EFFICIENT
    return _SDP_MATH


_FLASH_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_SDP_MATH, _SDP_FLASH, _SDP_EFFICIENT = 0, 1, 2


def _sdpa_for(device: str) -> Callable:
    """aten.scaled_dot_product_attention routed to the kernel the modelled device picks.

    On meta tensors the composite op cannot ask the device which kernel it would use (the choice
    is a per-device stub) and falls back to the math path, which saves the attention matrix; the
    real CPU or GPU runs a fused kernel that saves only the output and logsumexp.
    """
    aten = torch.ops.aten
    choose = _sdpa_choice_cuda if device == "cuda" else _sdpa_choice_cpu

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        choice = choose(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa)
        if choice in (_SDP_FLASH, _SDP_EFFICIENT) and attn_mask is not None and attn_mask.dtype == torch.bool:
            # at::convert_boolean_attn_mask: where(mask, 0, -inf) in the query's dtype
            attn_mask = torch.where(attn_mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=q.dtype,
                                                                          device=attn_mask.device))
        if choice == _SDP_FLASH and device == "cpu" and q.size(1) == k.size(1):
            return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                    attn_mask=attn_mask, scale=scale)[0]
        if choice == _SDP_FLASH and device == "cuda" and q.size(1) == k.size(1):
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        if choice == _SDP_EFFICIENT and device == "cuda":
            need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, need_lse, dropout_p, is_causal,
                                                                scale=scale)[0]
        return aten.scaled_dot_product_attention.default(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                         enable_gqa=enable_gqa)

    return sdpa


def _special_ops(device: str) -> dict:
    """Ops the tracker answers itself: the SDPA backend choice (by the modelled device, not by the
    tensors' meta device) and .item() of optimizer step counters."""
    choose = _sdpa_choice_cuda if device == "cuda" else _sdpa_choice_cpu

    def sdp_choice(tracker, func, args, kwargs):
        return choose(*args, **kwargs)

    def local_scalar(tracker, func, args, kwargs):
        t = args[0]
        if tracker.phase in ("optimizer", "zero_grad"):  # optimizer step counters; the value is irrelevant
            return 1.0 if t.is_floating_point() else 1
        if tracker.data_dependent is None:
            raise CaptureError(".item() of a tensor value cannot be known symbolically")
        return tracker.data_dependent(func, args, kwargs, tracker.node)

    ops = {torch.ops.aten._fused_sdp_choice.default: sdp_choice,
           torch.ops.aten._local_scalar_dense.default: local_scalar}
    if device == "cpu":
        ops.update(dict.fromkeys(_CPU_NORMS, _norm_cpu))
    return ops


_aten = torch.ops.aten
#: CPU norm kernels: op -> (positions of weight and bias, whether a `training` flag is args[5]).
_CPU_NORMS = {_aten.native_layer_norm.default: ((2, 3), False),
              _aten.native_group_norm.default: ((1, 2), False),
              _aten.native_batch_norm.default: ((1, 2), True),
              _aten._native_batch_norm_legit.default: ((1, 2), True),
              _aten._native_batch_norm_legit_functional.default: ((1, 2), True),
              _aten._native_batch_norm_legit_no_training.default: ((1, 2), False)}


def _norm_cpu(tracker, func, args, kwargs):
    """A norm op with the saved statistics the CPU kernel returns (outputs 1 and 2), which the meta
    kernels get wrong for bf16/fp16: ATen's param_scalar_type keeps them in the input's dtype, or
    in float when weight or bias has another dtype (meta: always float for layer and batch norm,
    always the input's for group norm). Batch norm outside training saves empty statistics, and
    the functional variant returns the new running statistics in their own dtype."""
    outs = list(func(*args, **kwargs))
    x = args[0]
    (w, b), has_flag = _CPU_NORMS[func]
    params = [p for p in (args[w] if len(args) > w else kwargs.get("weight"),
                          args[b] if len(args) > b else kwargs.get("bias")) if isinstance(p, torch.Tensor)]
    dtype = x.dtype
    if params and params[0].dtype != x.dtype and x.dtype in (torch.bfloat16, torch.float16):
        dtype = torch.float32
    training = args[5] if has_flag and len(args) > 5 else kwargs.get("training", True)
    empty = func is _aten._native_batch_norm_legit_no_training.default or (has_flag and not training)
    for i in (1, 2):
        if outs[i].dtype != dtype or (empty and outs[i].numel()):
            outs[i] = torch.empty((0,) if empty else outs[i].shape, dtype=dtype, device=outs[i].device)
    if func is _aten._native_batch_norm_legit_functional.default:
        for i, stat in ((3, args[3]), (4, args[4])):
            if outs[i].dtype != stat.dtype:
                outs[i] = torch.empty_like(outs[i], dtype=stat.dtype)
    return tracker._after(func, args, kwargs, tuple(outs))


# ---------------------------------------------------------------------------------------- executor

class _Executor:
    """Runs the captured forward graph over fake tensors, node by node, freeing values at last use."""

    def __init__(self, cap: Capture, env0: dict[str, torch.Tensor], tracker: _Tracker, train: bool,
                 rng_bytes: int = 0, device: str = "meta", device_model: str = "cpu"):
        self.cap, self.env0, self.tracker, self.train = cap, env0, tracker, train
        self.rng_bytes = rng_bytes
        self.device = torch.device(device)
        graph = cap.graph
        self.nodes = [n for n in graph.nodes if n.op == "call_function"]
        for n in graph.nodes:
            if n.op == "get_attr":  # submodules of higher-order ops (autocast / set_grad regions)
                env0[n] = operator.attrgetter(n.target)(cap.exported.graph_module)
        (self.output,) = [n for n in graph.nodes if n.op == "output"]
        # The graph was traced on meta: factory ops carry device=meta; they run on the fake CPU.
        meta, cpu = torch.device("meta"), self.device
        self.node_args: dict = {}
        for n in (self.nodes if cpu != meta else []):
            flat = pytree.tree_leaves((n.args, n.kwargs))
            if any(isinstance(a, torch.device) and a.type == "meta" for a in flat):
                self.node_args[n] = pytree.tree_map_only(torch.device, lambda d: cpu if d == meta else d,
                                                         (n.args, n.kwargs))
        sdpa = _sdpa_for(device_model)
        self.targets = {n: sdpa for n in self.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default}
        regions = cap.checkpoint_regions()
        # items: ("node", node) or ("region", [nodes])
        items: list = []
        for n in self.nodes:
            r = regions.get(n.name)
            if r is not None and items and items[-1][0] == "region" and items[-1][2] == r:
                items[-1][1].append(n)
            elif r is not None:
                items.append(("region", [n], r))
            else:
                items.append(("node", n, None))
        self.items = items
        #: progress: called with the forward nodes run so far in this step (None: no progress reported)
        self.on_forward: Callable[[int], None] | None = None
        self.nodes_through = list(itertools.accumulate(len(what) if kind == "region" else 1
                                                       for kind, what, _ in items))
        # last use of every value, in terms of item index; a value nothing uses dies where it is
        # made (as in the GraphModule's generated code, which the real run executes)
        last: dict[torch.fx.Node, int] = {}
        for i, (kind, what, _) in enumerate(items):
            for n in (what if kind == "region" else [what]):
                if kind == "node" and not n.users:
                    last[n] = i
                for a in n.all_input_nodes:
                    last[a] = i
        self.free_after: list[list[torch.fx.Node]] = [[] for _ in items]
        outs = set(self.output.all_input_nodes)
        for n, i in last.items():
            if n.op != "placeholder" and n not in outs:
                self.free_after[i].append(n)
        self.region_io = {}
        for i, (kind, what, _) in enumerate(items):
            if kind != "region":
                continue
            inside = set(what)
            ext = []
            for n in what:
                for a in n.all_input_nodes:
                    if a not in inside and a not in ext:
                        ext.append(a)
            used_after = [n for n in what if any(u not in inside for u in n.users)]
            inner_last: dict[torch.fx.Node, int] = {}
            for j, n in enumerate(what):
                if not n.users:
                    inner_last[n] = j
                for a in n.all_input_nodes:
                    if a in inside:
                        inner_last[a] = j
            inner_free = [[] for _ in what]
            for a, j in inner_last.items():
                if a not in used_after:
                    inner_free[j].append(a)
            self.region_io[i] = (ext, used_after, inner_free)

    def _run_node(self, n: torch.fx.Node, env: dict) -> None:
        args, kwargs = torch.fx.node.map_arg(self.node_args.get(n) or (n.args, n.kwargs), lambda a: env[a])
        out = self.targets.get(n, n.target)(*args, **kwargs)
        env[n] = out
        if self.train and n.target is not operator.getitem:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.tracker.note_forward_node(n.name, outs)
            if self.tracker.wrapped_scalars:
                self.tracker.keep_saved_numbers(n.name, outs)

    def _run_region(self, i: int, env: dict) -> None:
        nodes = self.items[i][1]
        ext, used_after, inner_free = self.region_io[i]
        tracker = self.tracker

        def region(*values):
            local = dict(zip(ext, values))
            recompute = tracker.phase == "backward"
            if recompute and self.rng_bytes:
                # torch.random.fork_rng saves the CPU RNG state for the recomputation
                fork_state = torch.empty(self.rng_bytes, dtype=torch.uint8, device=self.device)  # noqa: F841
            try:
                for j, n in enumerate(nodes):
                    if recompute:
                        tracker.recompute = n.name
                    else:
                        tracker.begin_node(n.name)
                    args, kwargs = torch.fx.node.map_arg(self.node_args.get(n) or (n.args, n.kwargs),
                                                         lambda a: local[a])
                    out = self.targets.get(n, n.target)(*args, **kwargs)
                    local[n] = out
                    if not recompute and self.train and n.target is not operator.getitem:
                        outs = out if isinstance(out, (tuple, list)) else (out,)
                        tracker.note_forward_node(n.name, outs)
                        if tracker.wrapped_scalars:
                            tracker.keep_saved_numbers(n.name, outs)
                    for a in inner_free[j]:
                        del local[a]
            finally:
                if recompute:  # checkpoint's early stop ends a recomputation by raising inside it
                    tracker.recompute = None
            return tuple(local[n] for n in used_after)

        if self.train and torch.is_grad_enabled():
            if self.rng_bytes:
                # checkpoint(preserve_rng_state=True) keeps the CPU RNG state until recomputation; it
                # lives as long as the checkpoint frame, which holds ``region``
                region.rng_state = torch.empty(self.rng_bytes, dtype=torch.uint8, device=self.device)
            results = torch.utils.checkpoint.checkpoint(region, *[env[a] for a in ext], use_reentrant=False)
        else:
            results = region(*[env[a] for a in ext])
        for n, v in zip(used_after, results):
            env[n] = v

    def forward(self) -> torch.Tensor:
        env: dict = dict(self.env0)
        tracker = self.tracker
        for i, (kind, what, _) in enumerate(self.items):
            if kind == "node":
                tracker.begin_node(what.name)
                try:
                    self._run_node(what, env)
                except Exception as exc:
                    if what.target is torch.ops.aten._assert_scalar.default:
                        raise CaptureError(f"a size hint breaks a constraint of the model ({exc}); "
                                           f"hints in effect: {current_hints()}") from exc
                    raise CaptureError(f"node {what.name} ({what.target}) in module "
                                       f"{module_path(what) or '<root>'!r} failed under fake tensors: {exc}") from exc
            else:
                self._run_region(i, env)
            for a in self.free_after[i]:
                env.pop(a, None)
            if self.on_forward is not None:
                self.on_forward(self.nodes_through[i])
        tracker.begin_node(None)
        loss = pytree.tree_leaves(self.output.args)[0]
        value = env[loss]
        env.clear()
        return value


# ----------------------------------------------------------------------------------------- profile

def _fake_state(cap: Capture, mode: FakeTensorMode | None) -> tuple[dict, list, list]:
    """Fake tensors for every placeholder, sharing storage where the model's tensors do."""
    exported = cap.exported
    user_inputs = [t for t in pytree.tree_leaves((cap.args, cap.kwargs)) if isinstance(t, torch.Tensor)]
    specs = exported.graph_signature.input_specs
    placeholders = [n for n in cap.graph.nodes if n.op == "placeholder"]
    env: dict = {}
    by_storage: dict[int, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    inputs: list[torch.Tensor] = []
    ui = 0
    state = exported.state_dict
    consts = exported.constants
    for node, spec in zip(placeholders, specs):
        kind, target = cap.placeholders[node.name]
        if kind == "input":
            source = user_inputs[ui]
            ui += 1
        elif spec.target in state:
            source = state[spec.target]
        else:
            source = consts.get(spec.target)
        if not isinstance(source, torch.Tensor):
            env[node] = source
            continue
        key = source.untyped_storage()._cdata
        with mode if mode is not None else contextlib.nullcontext():
            if key in by_storage and by_storage[key].shape == source.shape and by_storage[key].stride() == source.stride():
                fake = by_storage[key]
            else:
                fake = torch.empty_strided(tuple(source.shape), tuple(source.stride()), dtype=source.dtype,
                                           device="cpu" if mode is not None else "meta")
                if kind == "param" and source.requires_grad:
                    fake.requires_grad_(True)
                by_storage.setdefault(key, fake)
        env[node] = fake
        if kind == "param":
            params[target] = fake
        elif kind == "input":
            inputs.append(fake)
    ordered = []
    seen = set()
    for name, p in cap.model.named_parameters():
        f = params.get(name)
        if f is not None and p.requires_grad and id(f) not in seen:
            seen.add(id(f))
            ordered.append(f)
    return env, ordered, inputs


def _modelled_effects(device: str, unasked: int = 0) -> list[str]:
    effects = ["storage-level live bytes (views and tied parameters share storage)",
               "autograd saved tensors and their release during backward",
               "gradient accumulation and set_to_none zero_grad",
               "lazy optimizer state (step 2 peaks higher than step 1)",
               "non-reentrant torch.utils.checkpoint recomputation",
               "previous step's loss alive until the next forward returns"]
    if device == "cuda":
        effects += ["CUDA caching allocator: every block rounded up to 512 bytes (memory_allocated semantics)",
                    "SDPA backend by dtype: flash (bf16/fp16) or memory-efficient (fp32) attention, "
                    "saving only output and logsumexp, never the attention matrix",
                    "optimizer foreach path (CUDA default)",
                    "NOT modelled: 2 MiB segment granularity (reserved memory), cuBLAS/cuDNN workspaces, "
                    "fused kernels' internal scratch"]
    else:
        effects += ["SDPA backend picked by torch's own CPU choice (flash saves output and logsumexp)",
                    "per-parameter optimizer loop (CPU default)",
                    "Python numbers wrapped into 8-byte CPU tensors (and their cast) during an op, and until "
                    "backward where autograd saves them",
                    "checkpoint's saved CPU RNG state per region",
                    f"kernels' internal CPU allocations (oneDNN convolution reorders and scratchpads, "
                    f"bf16/fp16 matmul scratchpads, flash attention, norm and reduction temporaries): "
                    f"asked of the real kernel once per op and metadata on this CPU ({cpu_description()})"]
        if unasked:
            effects.append(f"NOT modelled: internal allocations of {unasked} such kernel calls above the asking "
                           f"limits ({MAX_FLOPS:.0e} FLOPs or {MAX_BYTES // 2**20} MiB of tensors)")
    return effects


def profile(fn: Callable, *, train: bool = True, optimizer: str = "adamw", device: str = "cpu",
            dtype: torch.dtype | str | None = None, autocast: str | None = None, steps: int = 2,
            device_model: DeviceModel | str | None = None, name: str | None = None,
            cap: Capture | None = None, size_hints: dict[str, int] | None = None,
            tensors: str | None = None, progress: ProgressFn | None = None) -> Profile:
    """Profile ``steps`` training steps of the model ``fn()`` returns, without allocating it.

    ``fn()`` returns ``(model, inputs)`` and is called on the meta device. ``dtype`` casts the model
    and floating inputs before capture; ``autocast`` ('bf16') runs forward under CPU autocast;
    ``train=False`` profiles forward passes under no_grad. ``device='cuda'`` models the CUDA
    caching allocator and SDPA kernels (see ``Profile.modelled_effects``). ``cap`` reuses a capture
    of the same factory (with the same dtype). ``size_hints`` sizes data-dependent ops
    (see :mod:`cauto.profiler.hints`). ``tensors`` is 'meta' (default: fastest) or 'fake'
    (FakeTensorMode; used for autocast, which only applies to tensors on a real device type); both
    give the same bytes: the tracker picks the SDPA kernel the modelled device would.
    ``progress(phase, done, total)``, when given, hears the capture and the symbolic steps as they
    go (:mod:`cauto.profiler.progress`); without it nothing is counted.
    """
    if size_hints:
        with size_hint(**size_hints):
            return profile(fn, train=train, optimizer=optimizer, device=device, dtype=dtype, autocast=autocast,
                           steps=steps, device_model=device_model, name=name, cap=cap, tensors=tensors,
                           progress=progress)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = _DTYPES[dtype]
    if autocast not in _AUTOCAST:
        raise ValueError(f"unknown autocast {autocast!r}; expected 'bf16' or 'fp16'")
    name = name or getattr(fn, "__name__", "model")
    if cap is None:
        if progress is not None:
            progress("capture", 0, 1)
        cap = capture(with_dtype(fn, dtype), device=device, autocast=_AUTOCAST[autocast])
    if progress is not None:
        progress("capture", 1, 1)
    dm = get_device_model(device_model, device)

    tracker = _Tracker(block=_CUDA_BLOCK if device == "cuda" else 0,
                       ask_kernels=device == "cpu")
    tensors = tensors or ("fake" if autocast else "meta")
    if tensors not in ("meta", "fake"):
        raise ValueError(f"tensors must be 'meta' or 'fake', not {tensors!r}")
    if autocast and tensors == "meta":
        raise ValueError("autocast needs tensors='fake' (autocast ignores meta tensors)")
    mode = FakeTensorMode(allow_non_fake_inputs=False) if tensors == "fake" else None
    tensor_device = "cpu" if mode is not None else "meta"
    env0, params, _inputs = _fake_state(cap, mode)
    tracker.special = _special_ops(device)
    tracker.memoize = mode is None
    tracker.wrapped_scalars = device == "cpu"
    baseline_sources = [*cap.model.parameters(), *cap.model.buffers(),
                        *[t for t in pytree.tree_leaves((cap.args, cap.kwargs)) if isinstance(t, torch.Tensor)]]
    baseline = unique_storage_bytes(baseline_sources)
    if tracker.block:
        baseline = _rounded_baseline(baseline_sources, tracker.block)
    # checkpoint's saved RNG states are CPU tensors: host memory, not GPU memory
    rng_bytes = torch.get_rng_state().numel() if device == "cpu" else 0
    executor = _Executor(cap, env0, tracker, train, rng_bytes=rng_bytes, device=tensor_device,
                         device_model=device)
    counter = None
    if progress is not None:
        counter = StepProgress(progress, [n.name for n in executor.nodes], steps, train, optimizer != "none")
        executor.on_forward, tracker.on_backward = counter.forward_done, counter.backward_at
    by_name = {n.name: n for n in cap.graph.nodes}

    def data_dependent(func, args, kwargs, node_name):
        node = by_name.get(node_name)
        val = node.meta.get("val") if node is not None else None
        if isinstance(val, torch.Tensor):
            shape = [concrete_int(d, cap) for d in val.shape]
            return torch.empty(shape, dtype=val.dtype, device=tensor_device)
        if isinstance(val, (torch.SymInt, int)):
            return concrete_int(val, cap)
        raise CaptureError(f"{func} in node {node_name} has a data-dependent result that no size hint covers "
                           "(see cauto.profiler.size_hint)")

    tracker.data_dependent = data_dependent
    ac = _AUTOCAST[autocast]

    def forward():
        if ac is not None:
            with torch.autocast("cpu", dtype=ac):
                return executor.forward()
        return executor.forward()

    ctx = mode if mode is not None else contextlib.nullcontext()
    with ctx:
        opt = make_optimizer(optimizer, params, device=device) if train else None
    with ctx, tracker:
        # Pre-existing storages (parameters, buffers, inputs) are the baseline, counted from the
        # model's own tensors exactly as the ground truth counts them.
        for v in env0.values():
            if isinstance(v, torch.Tensor):
                tracker.adopt(v)
        tracker.live_bytes = tracker.peak = baseline
        saved_at_backward: dict[str, int] = {}

        def mark(phase: str, step: int) -> None:
            if phase == "backward" and step == 1:
                for nbytes, node, ph, st in list(tracker.live.values()):
                    if ph == "forward" and st == 1 and node is not None:
                        saved_at_backward[node] = saved_at_backward.get(node, 0) + nbytes
            tracker.mark(phase, step)
            if counter is not None:
                counter.mark(phase, step)

        run_steps(forward, opt, steps=steps, train=train, mark=mark)
    del opt, env0, params
    executor.env0 = {}  # let the fake/meta state go

    nodes = _node_stats(cap, tracker, saved_at_backward, dm)
    phases = {k: v for k, v in tracker.phase_peak.items() if k not in ("setup", "end")}
    phase_steps = {k: v for k, v in tracker.phase_step_peak.items() if not k.startswith("end")}
    settings = {"train": train, "optimizer": optimizer if train else "none",
                "dtype": str(dtype or _model_dtype(cap)).removeprefix("torch."), "device": device,
                "autocast": autocast, "steps": steps}
    return Profile(name=name, capture=cap, settings=settings, device_model=dm, peak_bytes=tracker.peak,
                   baseline_bytes=baseline, phases=phases, phase_steps=phase_steps, nodes=nodes,
                   timeline=tracker.timeline, modelled_effects=_modelled_effects(device, tracker.unasked),
                   peak_event=tracker.peak_event)


def _rounded_baseline(tensors, block: int) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            n = st.nbytes()
            total += max(block, -(-n // block) * block) if n else 0
    return total


def _model_dtype(cap: Capture) -> torch.dtype:
    for p in cap.model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _node_stats(cap: Capture, tracker: _Tracker, saved: dict[str, int], dm: DeviceModel) -> dict[str, NodeStats]:
    nodes: dict[str, NodeStats] = {}
    for n in cap.value_nodes():
        outs = output_tensors(n)
        st = NodeStats(n.name, str(n.target) if n.op != "placeholder" else cap.placeholders[n.name][0],
                       module_path(n) if n.op != "placeholder" else "",
                       output_bytes=sum(tensor_bytes(t) for t in outs))
        nodes[n.name] = st
    getitem_parent = {}
    for n in cap.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            getitem_parent[n.name] = n.args[0].name
    for (node, phase), kernels in tracker.costs.items():
        while node in getitem_parent:
            node = getitem_parent[node]
        st = nodes.get(node)
        if st is None:
            continue
        if phase == "forward":
            st.fwd_kernels.extend(kernels)
        else:
            st.bwd_kernels.extend(kernels)
    for st in nodes.values():
        st.fwd_flops = float(sum(k[0] for k in st.fwd_kernels))
        st.bwd_flops = float(sum(k[0] for k in st.bwd_kernels))
        st.fwd_bytes = float(sum(k[1] for k in st.fwd_kernels))
        st.bwd_bytes = float(sum(k[1] for k in st.bwd_kernels))
        st.fwd_time_s = sum(dm.time(f, b, d) for f, b, d in st.fwd_kernels)
        st.bwd_time_s = sum(dm.time(f, b, d) for f, b, d in st.bwd_kernels)
        st.saved_bytes = saved.get(st.id, 0)
        st.transient_bytes = tracker.transient.get(st.id, 0)
        st.allocated_bytes = tracker.node_alloc.get(st.id, 0)
    return nodes
