"""The dispatch-level tracker: live storage bytes, their peak, and per-node costs of every op it sees."""

from __future__ import annotations

import bisect
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from cauto.profiler.capture import tensor_bytes
from cauto.profiler.flops import FLOP_FORMULAS
from cauto.profiler.kernel_allocs import KERNELS, kernel_allocs


class Tracker(TorchDispatchMode):
    """Counts live storage bytes at the dispatch level and attributes ops to graph nodes.

    ``baseline_bytes`` are the bytes alive before the run (parameters, buffers, inputs), where the
    live bytes and the peak start. ``special`` maps ops to ``f(tracker, func, args, kwargs)`` that
    answer them instead of the kernel (:mod:`cauto.profiler.special_ops`).
    """

    def __init__(self, block: int = 0, count_costs: bool = True, ask_kernels: bool = False, *,
                 baseline_bytes: int = 0, special: dict | None = None, memoize: bool = False,
                 wrapped_scalars: bool = False, data_dependent: Callable | None = None,
                 on_backward: Callable[[str | None], None] | None = None):
        super().__init__()
        self.block = block
        #: CPU: ops whose kernels allocate inside themselves are asked what (kernel_allocs)
        self.ask_kernels = ask_kernels
        self.unasked = 0  #: calls of such kernels above the asking limits (not modelled)
        #: f(func, args, kwargs, node name) -> output of a data-dependent op, from size hints
        self.data_dependent = data_dependent
        self.special: dict = special or {}
        #: meta tensors only: op -> 0 (run it), 1 (functional: memoize its output metadata), 2 (in-place)
        self.memoize = memoize
        #: CPU: a Python number where an op takes a Tensor becomes a wrapped 8-byte CPU tensor, cast
        #: to the op's dtype inside the kernel; both live for the duration of the op
        self.wrapped_scalars = wrapped_scalars
        self.scalar_slots: dict = {}
        self.pending = 0
        #: names of the arguments given a Python number since the current forward node began
        self.wrapped_names: set[str] = set()
        self.memo_kind: dict = {}
        self.memo: dict = {}
        self.live: dict[int, tuple[int, str | None, str, int]] = {}  # storage key -> (bytes, node, phase, step)
        self.live_bytes = baseline_bytes
        self.peak = baseline_bytes
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
        #: node -> the largest in-kernel scratch (a measured kernel's peak less its outputs) in its backward
        self.bwd_workspace: dict[str, int] = {}
        self._win_node: str | None = None
        self._win_start = self._win_max = 0
        #: progress: called with the forward node whose backward runs (None: no progress reported)
        self.on_backward = on_backward

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
                return self.after_op(func, args, kwargs, out)
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
        return self.after_op(func, args, kwargs, out)

    def after_op(self, func, args, kwargs, out):
        """What follows every op that made ``out``: its new storages counted (and, for a kernel that
        allocates inside itself, its in-call peak), its costs noted; returns the op's result."""
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
        if func in FIXED_SCRATCH_KERNELS and self.phase == "backward" and node is not None:
            scratch = asked.peak_bytes - sum(b or 0 for b in asked.output_bytes)
            self.bwd_workspace[node] = max(scratch, self.bwd_workspace.get(node, 0))
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



_LIFT_FRESH = torch.ops.aten.lift_fresh.default
#: Kernels whose in-call scratch does not follow the batch, recorded as the graph's ``bwd_workspace_bytes``
#: (the solver counts it whole at any sharding). Measured on this CPU build: oneDNN's convolution backward
#: keeps 559 / 567 / 583 KB of scratch for a bf16 ViT patch embedding at batch 1 / 2 / 4, and an fp32
#: CNN's 147 / 66 / 131 KB (its algorithm choice, not the batch); a bf16 matmul's scratch grows with the
#: rows (38 / 46 / 87 KB), so matmuls stay in the extra that a sharding divides.
FIXED_SCRATCH_KERNELS = frozenset({torch.ops.aten.convolution_backward.default})
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
