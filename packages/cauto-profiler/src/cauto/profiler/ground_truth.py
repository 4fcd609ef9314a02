"""Measured peak memory of real training steps on CPU: the ground truth for the profiler.

The model is built for real with the same factory, then ``steps`` real steps run (the same loop as
the profiler simulates, :func:`cauto.profiler.training.run_steps`) under
``torch.profiler.profile(profile_memory=True)``. Every allocation and free the CPU allocator
reports is summed (only blocks allocated inside this session: the allocator's own running total
keeps blocks of earlier sessions that were freed while profiling was off); the peak is that maximum plus the bytes of the model's
parameters, buffers and inputs that existed before (counted from their distinct storages). Per-phase
peaks come from record_function markers around each phase.

RSS is useless for this (it includes ~220 MB of torch itself); the allocator's own accounting is
exact on one thread. CPU only: backward runs on the calling thread there.
"""

from __future__ import annotations

import gc
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint

from cauto.profiler.capture import LossWrapper, split_inputs
from cauto.profiler.memory_session import memory_session
from cauto.profiler.training import cast_inputs, make_optimizer, run_steps, unique_storage_bytes

_PREFIX = "cauto_phase:"


@dataclass
class Measured:
    """Peak live bytes of a real run: overall, per phase ('forward' ...) and per (phase, step)."""

    peak_bytes: int
    baseline_bytes: int
    phases: dict[str, int] = field(default_factory=dict)
    phase_steps: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "baseline_bytes": self.baseline_bytes, "phases": dict(self.phases)}


def measure(fn: Callable, *, train: bool = True, optimizer: str = "adamw", dtype: torch.dtype | None = None,
            autocast: str | None = None, steps: int = 2, seed: int = 0, run: str = "eager") -> Measured:
    """Build ``fn()`` for real on CPU and measure the peak live bytes of ``steps`` training steps.

    ``run="eager"`` calls the model as written; ``run="graph"`` exports the real model exactly as
    capture does and runs that graph (what cauto's runtime executes), its checkpointed nodes again
    under non-reentrant torch.utils.checkpoint (export flattens them; capture marks them), exported as
    capture exports (eager's mask paths, :mod:`cauto.profiler.eager_paths`). They differ where eager
    Python keeps values alive past their last use (T5's decoder cache): the truths of
    ``profile().peak_bytes`` and ``profile().program_peak_bytes``.
    """
    torch.manual_seed(seed)
    model, inputs = fn()
    if dtype is not None:
        model = model.to(dtype)
        inputs = cast_inputs(inputs, dtype)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
    model.train()
    args, kwargs = split_inputs(inputs)
    wrapper = LossWrapper(model)
    if run == "graph":
        from cauto.profiler.capture import keep_autograd_functions
        from cauto.profiler.checkpoint_marks import mark_checkpoints
        from cauto.profiler.eager_paths import eager_mask_decisions

        with mark_checkpoints(), eager_mask_decisions(), keep_autograd_functions(wrapper):
            wrapper = torch.export.export(wrapper, args, kwargs, strict=False).module()
        _checkpoint_regions(wrapper)
    elif run != "eager":
        raise ValueError(f"run must be 'eager' or 'graph', not {run!r}")
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], device="cpu") if train else None
    input_tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    baseline = unique_storage_bytes([*model.parameters(), *model.buffers(), *input_tensors])
    ac_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[autocast]

    def forward():
        if ac_dtype is not None:
            with torch.autocast("cpu", dtype=ac_dtype):
                return wrapper(*args, **kwargs)
        return wrapper(*args, **kwargs)

    ranges: list = []

    def mark(phase: str, step: int) -> None:
        if ranges:
            ranges[-1].__exit__(None, None, None)
        if phase != "end":
            rf = torch.profiler.record_function(f"{_PREFIX}{phase}:{step}")
            rf.__enter__()
            ranges.append(rf)

    gc.collect()
    with memory_session() as prof:
        run_steps(forward, opt, steps=steps, train=train, mark=mark)
    return _analyse(prof, baseline)


def _checkpoint_regions(gm: torch.fx.GraphModule) -> None:
    """Put each run of consecutive nodes marked with one checkpoint region (capture's marks) back
    under non-reentrant torch.utils.checkpoint, as the profiler's executor runs it (in place)."""
    from cauto.profiler.checkpoint_marks import CHECKPOINT_KEY

    def region_of(n: torch.fx.Node):
        custom = n.meta.get("custom")
        return custom.get(CHECKPOINT_KEY) if n.op == "call_function" and isinstance(custom, dict) else None

    runs: list[list[torch.fx.Node]] = []
    last = None
    for n in gm.graph.nodes:
        r = region_of(n)
        if r is not None and r == last:
            runs[-1].append(n)
        elif r is not None:
            runs.append([n])
        last = r
    for i, nodes in enumerate(runs):
        _cut_region(gm, nodes, f"cauto_checkpoint_{i}")
    if runs:
        gm.graph.lint()
        gm.recompile()


def _checkpointed(region: torch.nn.Module, *args):
    return torch.utils.checkpoint.checkpoint(region, *args, use_reentrant=False)


def _cut_region(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], attr: str) -> None:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = torch.fx.Graph()
    env = {a: sub.placeholder(a.name) for a in inputs}
    for n in nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    gm.add_submodule(attr, torch.fx.GraphModule(gm, sub))
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_function(_checkpointed, (gm.graph.get_attr(attr), *inputs))
        for k, o in enumerate(outputs):
            o.replace_all_uses_with(gm.graph.call_function(operator.getitem, (call, k)))
    for n in reversed(nodes):
        gm.graph.erase_node(n)


def _analyse(prof, baseline: int) -> Measured:
    raw: list[tuple[int, int, int]] = []  # (time, ptr, signed size)
    spans: list[tuple[int, int, str, int]] = []  # (start, end, phase, step)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        kind = e.typed[0]
        if kind == torch._C._profiler._EventType.Allocation:
            if e.typed[1].device.type == "cpu":
                raw.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size))
        elif e.name.startswith(_PREFIX):
            _, phase, step = e.name.split(":")
            spans.append((e.start_time_ns, e.end_time_ns, phase, int(step)))
        stack.extend(e.children)
    # The allocator's running total (total_allocated) carries blocks from earlier profiling sessions
    # that were freed while profiling was off; count only blocks allocated in this session.
    raw.sort()
    sizes: dict[int, int] = {}
    allocs: list[tuple[int, int]] = []
    total = 0
    for t, ptr, size in raw:
        if size > 0:
            sizes[ptr] = sizes.get(ptr, 0) + size
            total += size
        else:
            known = sizes.pop(ptr, None)
            if known is None:
                continue
            total -= known
        allocs.append((t, total))
    spans.sort()
    peak = max((a for _, a in allocs), default=0)
    phases: dict[str, int] = {}
    phase_steps: dict[str, int] = {}
    j = 0
    for start, end, phase, step in spans:
        while j < len(allocs) and allocs[j][0] < start:
            j += 1
        best = allocs[j - 1][1] if j > 0 else 0  # live bytes when the phase starts
        k = j
        while k < len(allocs) and allocs[k][0] <= end:
            best = allocs[k][1] if best is None else max(best, allocs[k][1])
            k += 1
        key = f"{phase}:{step}"
        phase_steps[key] = baseline + best
        phases[phase] = max(phases.get(phase, 0), baseline + best)
    return Measured(baseline + max(peak, 0), baseline, phases, phase_steps)
