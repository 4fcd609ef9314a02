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

This module keeps ``profile`` and the executor; the dispatch mode is :mod:`cauto.profiler.tracker`,
the ops it answers itself :mod:`cauto.profiler.special_ops`, the FLOP formulas
:mod:`cauto.profiler.flops`, and what ``profile`` returns :mod:`cauto.profiler.results`.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

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
from cauto.profiler.kernel_allocs import MAX_BYTES, MAX_FLOPS, cpu_description
from cauto.profiler.progress import ProgressFn, StepProgress
from cauto.profiler.results import NodeStats, Profile
from cauto.profiler.special_ops import sdpa_for, special_ops
from cauto.profiler.tracker import Tracker
from cauto.profiler.training import OPTIMIZERS, make_optimizer, run_steps, unique_storage_bytes, with_dtype

_AUTOCAST = {None: None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16}
_DTYPES = {None: None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_CUDA_BLOCK = 512


# ---------------------------------------------------------------------------------------- executor

def _forward_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The nodes the executor runs, in order (progress counts them too)."""
    return [n for n in graph.nodes if n.op == "call_function"]


class _Executor:
    """Runs the captured forward graph over fake tensors, node by node, freeing values at last use."""

    def __init__(self, cap: Capture, env0: dict[str, torch.Tensor], tracker: Tracker, train: bool,
                 rng_bytes: int = 0, device: str = "meta", device_model: str = "cpu",
                 on_forward: Callable[[int], None] | None = None, holds: dict[str, str | None] | None = None):
        self.cap, self.env0, self.tracker, self.train = cap, env0, tracker, train
        self.rng_bytes = rng_bytes
        self.device = torch.device(device)
        graph = cap.graph
        self.nodes = _forward_nodes(graph)
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
        sdpa = sdpa_for(device_model)
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
        self.on_forward = on_forward
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
        # ``holds``: eager Python keeps these values past their last use, to a later node or to the
        # forward's return (the eager peak; the runtime program frees at last use)
        item_of = {n.name: i for i, (kind, what, _) in enumerate(items) if kind == "node" for n in [what]}
        for n in list(last):
            if n.name in (holds or {}) and n.name in item_of:
                until = holds[n.name]
                last[n] = len(items) if until is None else max(last[n], item_of.get(until, last[n]))
        self.free_after: list[list[torch.fx.Node]] = [[] for _ in items]
        outs = set(self.output.all_input_nodes)
        for n, i in last.items():
            if n.op != "placeholder" and n not in outs and i < len(items):
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
            # eager holds inside a checkpointed function: to a later node of it, or to its return
            at = {n.name: j for j, n in enumerate(what)}
            for a in list(inner_last):
                if a.name in (holds or {}):
                    until = holds[a.name]
                    inner_last[a] = max(inner_last[a], at.get(until, len(what) - 1) if until is not None
                                        else len(what) - 1)
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
    dtype = _checked_settings(optimizer, device, dtype, autocast)
    name = name or getattr(fn, "__name__", "model")
    cap = _captured(fn, cap, dtype, device, autocast, progress)
    dm = get_device_model(device_model, device)
    mode = _tensor_mode(tensors, autocast)
    tensor_device = "cpu" if mode is not None else "meta"
    baseline = _baseline_bytes(cap, _CUDA_BLOCK if device == "cuda" else 0)
    counter = None
    if progress is not None:
        counter = StepProgress(progress, [n.name for n in _forward_nodes(cap.graph)], steps, train,
                               optimizer != "none")

    def simulate(holds, counter):
        env0, params, _inputs = _fake_state(cap, mode)
        tracker = Tracker(block=_CUDA_BLOCK if device == "cuda" else 0, ask_kernels=device == "cpu",
                          baseline_bytes=baseline, special=special_ops(device), memoize=mode is None,
                          wrapped_scalars=device == "cpu", data_dependent=_data_dependent(cap, tensor_device),
                          on_backward=counter.backward_at if counter is not None else None)
        # checkpoint's saved RNG states are CPU tensors: host memory, not GPU memory
        rng_bytes = torch.get_rng_state().numel() if device == "cpu" else 0
        executor = _Executor(cap, env0, tracker, train, rng_bytes=rng_bytes, device=tensor_device,
                             device_model=device, on_forward=counter.forward_done if counter is not None else None,
                             holds=holds)
        saved = _simulate_steps(executor, tracker, env0, params, optimizer=optimizer, device=device,
                                train=train, steps=steps, mode=mode, autocast=autocast, counter=counter)
        executor.env0 = {}  # let the fake/meta state go
        return tracker, saved

    # the runtime program: every value freed at its last use in the graph
    tracker, saved_at_backward = simulate(None, counter)
    # the user's eager step: values the model's Python keeps longer live longer (a second, silent run)
    # (a value autograd saves lives into backward in both: holding it to a later forward node changes nothing)
    # Capture traced with autograd on, whose graph keeps its saved tensors to the end of the trace: without
    # training (no autograd in eager) a hold to the forward's end may be autograd's alone, and only holds to a
    # node inside the forward are the model's Python for sure.
    holds = {n: until for n, until in (cap.eager_holds or {}).items()
             if n not in saved_at_backward and (train or until is not None)}
    eager = simulate(holds, None)[0] if holds else tracker

    nodes = _node_stats(cap, tracker, saved_at_backward, dm)
    def phases_of(t: Tracker) -> tuple[dict, dict]:
        return ({k: v for k, v in t.phase_peak.items() if k not in ("setup", "end")},
                {k: v for k, v in t.phase_step_peak.items() if not k.startswith("end")})

    phases, phase_steps = phases_of(eager)
    program_phases, program_phase_steps = phases_of(tracker)
    settings = {"train": train, "optimizer": optimizer if train else "none",
                "dtype": str(dtype or _model_dtype(cap)).removeprefix("torch."), "device": device,
                "autocast": autocast, "steps": steps}
    effects = _modelled_effects(device, tracker.unasked)
    effects.append("tensors the model's Python keeps past their last use (locals, cache objects) in the eager "
                   "peak (peak_bytes)" if cap.eager_holds is not None else
                   "NOT modelled in peak_bytes: tensors the model's Python keeps past their last use (the program "
                   "was stamped from short exports, whose Python lifetimes do not name its nodes)")
    return Profile(name=name, capture=cap, settings=settings, device_model=dm, peak_bytes=eager.peak,
                   baseline_bytes=baseline, phases=phases, phase_steps=phase_steps, nodes=nodes,
                   timeline=tracker.timeline, modelled_effects=effects,
                   peak_event=eager.peak_event, program_peak_bytes=tracker.peak,
                   program_peak_event=tracker.peak_event, program_phases=program_phases,
                   program_phase_steps=program_phase_steps)


def _checked_settings(optimizer: str, device: str, dtype: torch.dtype | str | None,
                      autocast: str | None) -> torch.dtype | None:
    """``profile``'s settings checked (ValueError); returns the dtype as a torch dtype."""
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
    return dtype


def _captured(fn: Callable, cap: Capture | None, dtype: torch.dtype | None, device: str, autocast: str | None,
              progress: ProgressFn | None) -> Capture:
    """``cap``, or a new capture of ``fn`` when there is none; the "capture" phase of progress."""
    if cap is None:
        if progress is not None:
            progress("capture", 0, 1)
        cap = capture(with_dtype(fn, dtype), device=device, autocast=_AUTOCAST[autocast])
    if progress is not None:
        progress("capture", 1, 1)
    return cap


def _tensor_mode(tensors: str | None, autocast: str | None) -> FakeTensorMode | None:
    """The FakeTensorMode the state lives in for ``tensors='fake'`` (autocast's default), None for meta."""
    tensors = tensors or ("fake" if autocast else "meta")
    if tensors not in ("meta", "fake"):
        raise ValueError(f"tensors must be 'meta' or 'fake', not {tensors!r}")
    if autocast and tensors == "meta":
        raise ValueError("autocast needs tensors='fake' (autocast ignores meta tensors)")
    return FakeTensorMode(allow_non_fake_inputs=False) if tensors == "fake" else None


def _baseline_bytes(cap: Capture, block: int) -> int:
    """Bytes of the storages that exist before the run (parameters, buffers, inputs), counted from the
    model's own tensors exactly as the ground truth counts them; each rounded up to ``block`` bytes
    when the allocator has blocks."""
    tensors = [*cap.model.parameters(), *cap.model.buffers(),
               *[t for t in pytree.tree_leaves((cap.args, cap.kwargs)) if isinstance(t, torch.Tensor)]]
    if not block:
        return unique_storage_bytes(tensors)
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            n = st.nbytes()
            total += max(block, -(-n // block) * block) if n else 0
    return total


def _data_dependent(cap: Capture, tensor_device: str) -> Callable:
    """The tracker's answer for an op whose output depends on data: the captured node's value with its
    sizes from the size hints (CaptureError where no hint covers it)."""
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

    return data_dependent


def _simulate_steps(executor: _Executor, tracker: Tracker, env0: dict, params: list, *, optimizer: str, device: str,
               train: bool, steps: int, mode: FakeTensorMode | None, autocast: str | None,
               counter: StepProgress | None) -> dict[str, int]:
    """The training steps under the tracker; returns the bytes each forward node left alive for the
    backward of step 1 (its saved tensors)."""
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
        # Pre-existing storages (parameters, buffers, inputs) are the baseline (_baseline_bytes)
        for v in env0.values():
            if isinstance(v, torch.Tensor):
                tracker.adopt(v)
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
    del opt
    return saved_at_backward


def _model_dtype(cap: Capture) -> torch.dtype:
    for p in cap.model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _node_stats(cap: Capture, tracker: Tracker, saved: dict[str, int], dm: DeviceModel) -> dict[str, NodeStats]:
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
        st.bwd_workspace_bytes = tracker.bwd_workspace.get(st.id, 0)
        st.allocated_bytes = tracker.node_alloc.get(st.id, 0)
    return nodes
