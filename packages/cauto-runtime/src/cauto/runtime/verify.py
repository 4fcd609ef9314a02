"""``--verify``: what the plan predicted against what a training step really did, on this rank.

* Collectives: one step runs under ``CommDebugMode``; executed collectives are counted per op type
  and phase (forward; backward including the bucketed gradient all-reduces) and compared with
  ``plan.predictions.collectives``. The plan's gradient-sync entries are per parameter; the runtime
  sends them in buckets, so they are compared as launched buckets and as bytes.
* Peak memory: what the plan's ``peak_bytes`` predicts, the peak of live tensor bytes on this rank
  over a steady-state training step (forward, backward with the bucketed gradient sync, optimizer
  step, ``zero_grad``), after earlier steps created the optimizer state. The step runs under
  ``torch.profiler.profile(profile_memory=True)`` and the peak of live bytes over its allocation
  events is added to the bytes already live when it started: parameters, gradients (None after
  ``zero_grad``), buffers, optimizer state, and this rank's shard of the input batch as the plan
  places it (in global-batch mode the caller also holds the rest of the batch: the caller's data,
  not counted). In multi-process gloo runs a tensor freed on a gloo worker thread has no free
  event (ENVIRONMENT.md): the step runs under ``StorageDeaths``, which sees the storages the ops
  return freed on any thread, and ``allocation_peak`` dates each such free at that death (a block no
  op returned keeps the older dating, see there). The step is measured twice, keeping the lower peak. On CUDA, ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from cauto.profiler.memory_session import memory_session
from cauto.runtime.dist_utils import local_slices, to_placements
from cauto.runtime.storage_deaths import StorageDeaths

_OP_NAMES = {"all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather", "all_gather": "all_gather", "allgather_": "all_gather",
             "_allgather_base_": "all_gather", "all_reduce": "all_reduce", "allreduce_": "all_reduce",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
             "_reduce_scatter_base_": "reduce_scatter", "all_to_all_single": "all_to_all", "alltoall_": "all_to_all",
             "alltoall_base_": "all_to_all", "broadcast_": "broadcast", "scatter_": "scatter"}


def executed_counts(mode: CommDebugMode) -> Counter:
    """Collectives counted by ``mode``, keyed by plan op names (all_gather, all_reduce, ...)."""
    out: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        out[_OP_NAMES.get(name, name)] += n
    return out


def predicted_counts(plan, phases: tuple[str, ...]) -> Counter:
    """Collectives of ``plan.predictions.collectives`` in ``phases``, counted per op."""
    return Counter(c["op"] for c in plan.predictions["collectives"] if c.get("phase", "forward") in phases)


def live_state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's parameters, gradients, buffers and optimizer state, each storage counted
    once (the gradients of one bucket view its flat buffer: lowering.bucket_gradient_reductions)."""
    storages: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())

    for p in module.parameters():
        add(p)
        add(p.grad)
    for b in module.buffers():
        add(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                add(v)
    return sum(storages.values())


def input_shard_bytes(module) -> int:
    """Bytes of this rank's shard of the user inputs, placed as the plan says (local-batch mode)."""
    total = 0
    for node in module.capture.graph.nodes:
        if node.op != "placeholder" or module.capture.placeholders[node.name][0] != "input":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        placements = to_placements(tuple(module.plan.nodes[node.name]["outputs"][0]))
        index = local_slices(tuple(val.shape), placements, module.mesh)
        numel = 1
        for s in index:
            numel *= s.stop - s.start
        total += numel * val.element_size()
    return total


def measured_peak_bytes(step, module, optimizer, repeats: int = 2) -> int:
    """Run ``step()`` ``repeats`` times; return this rank's peak of live bytes in one step (module docstring)."""
    if torch.cuda.is_available() and module.mesh.device_type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    lowered = getattr(module, "lowered", None)
    # inductor's compiled code runs eagerly under a Python dispatch mode: a compiled step keeps the
    # profiler's dating (its buffers bypass the dispatcher anyway)
    watch = lowered is None or not lowered.compile
    peaks = []
    for _ in range(max(1, repeats)):
        base = live_state_bytes(module, optimizer) + input_shard_bytes(module)
        peaks.append(base + step_allocation_peak(step, watch_storages=watch))
    return min(peaks)


def step_allocation_peak(step, watch_storages: bool = True) -> int:
    """Run ``step()`` once; the peak of bytes it allocated and still held (module docstring): profiler
    allocation events, frees on other threads dated by ``StorageDeaths`` when ``watch_storages``."""
    deaths = StorageDeaths() if watch_storages else contextlib.nullcontext()
    with memory_session() as prof, deaths:
        step()
    lifetimes = deaths.lifetimes() if watch_storages else None
    return allocation_peak(prof, steady_state=True, lifetimes=lifetimes)


def allocation_peak(prof, steady_state: bool = False, until_ns: int | None = None, exclude_scope: str = "",
                    lifetimes: dict[int, list[tuple[int, int | None]]] | None = None) -> int:
    """Peak of bytes allocated and still live during a profiled region, from its allocation events.

    ``until_ns``: the region ends there (``time.time_ns()``'s clock, the profiler's), not at the
    session's end: later events are not counted. ``exclude_scope``: no allocation made while a
    ``torch.profiler.record_function`` of that name runs counts (the chunk manager's own buffers,
    chunks/model.py; gloo's, made in its ``gloo:`` events beside the scope, included).

    A free that happened on a gloo worker thread is not reported. A block without a free event was
    freed on another thread: when its address is handed out again (the allocator cannot hand out a
    live address), or, with ``steady_state`` (a training step: nothing allocated in it outlives it),
    still live when the region ends. Such a block counts as freed when the storage an op returned at
    its address died (``lifetimes``: ``StorageDeaths.lifetimes()`` of the same region, every thread's
    frees), else when the innermost collective op
    around its allocation returned (c10d, gloo or a DTensor redistribution: the collective's work,
    which holds it, is done by then; without one, the outermost op), or at the reuse if earlier. Uses the
    profiler's event tree (private in torch 2.13: ``experimental_event_tree``); falls back to summing
    the public ``[memory]`` events, which over-counts such blocks.
    """
    try:
        from torch._C._profiler import _EventType

        allocations = []
        scopes = []  # (start, end) of each exclude_scope event
        stack = [(root, root.end_time_ns) for root in prof.profiler.kineto_results.experimental_event_tree()]
        while stack:
            node, outer_end_ns = stack.pop()
            for child in node.children:  # the end of the innermost collective op, else of the outermost op
                collective = child.tag != _EventType.Allocation and _is_collective(child.name)
                stack.append((child, child.end_time_ns if collective else outer_end_ns))
            if exclude_scope and node.name == exclude_scope:
                scopes.append((node.start_time_ns, node.end_time_ns))
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size,
                                    outer_end_ns))
    except (AttributeError, ImportError, RuntimeError):
        live = peak = 0
        for e in sorted((e for e in prof.events() if e.name == "[memory]"), key=lambda e: e.time_range.start):
            live += e.cpu_memory_usage
            peak = max(peak, live)
        return peak
    allocations.sort(key=lambda a: a[0])
    allocations = _without([a for a in allocations if until_ns is None or a[0] <= until_ns], scopes)
    # match every allocation with its free: a free event on this thread, or none (freed elsewhere)
    frees: list[tuple[int, int, int]] = []  # (time, ptr, -size)
    open_at: dict[int, int] = {}  # ptr -> index of the live allocation there
    for i, (t, ptr, size, _) in enumerate(allocations):
        if size > 0:
            if ptr in open_at:  # reused without a free event: that block was freed on another thread
                frees.append((_implicit_free_ns(allocations[open_at[ptr]], t, lifetimes), ptr, -allocations[open_at[ptr]][2]))
            open_at[ptr] = i
        elif ptr in open_at:
            frees.append((t, ptr, -allocations[open_at.pop(ptr)][2]))
    for ptr, i in open_at.items():  # never freed here: in a steady-state step, freed on another thread
        if steady_state and allocations[i][3] > 0:
            frees.append((_implicit_free_ns(allocations[i], None, lifetimes), ptr, -allocations[i][2]))
    events = [(t, ptr, size) for t, ptr, size, _ in allocations if size > 0] + frees
    events.sort(key=lambda e: (e[0], e[2] > 0))
    live = peak = 0
    for _, _, size in events:
        live += size
        peak = max(peak, live)
    return peak


def _without(allocations: list, during: list[tuple[int, int]]) -> list:
    """``allocations`` (time-ordered events) less the blocks made ``during`` one of those (start, end)
    times, and their frees: a free event at an excluded block's address, or a new block there (it was
    freed on another thread). An excluded block stays as a 0-byte event: a free of what was counted at
    its address before (the allocator handed the address out again)."""
    if not during:
        return allocations
    excluded: set[int] = set()  # addresses of excluded blocks still live
    out = []
    for t, ptr, size, dating in allocations:
        if ptr in excluded:
            excluded.discard(ptr)
            if size < 0:
                continue
        if size > 0 and any(start <= t <= end for start, end in during):
            excluded.add(ptr)
            size = 0  # counts nothing, but proves a block counted at ptr was freed
        out.append((t, ptr, size, dating))
    return out


def _is_collective(name: str) -> bool:
    """An op that launches and waits for a collective (its buffers belong to the collective's work)."""
    return name.startswith(("c10d::", "_c10d_functional::", "gloo:")) or "Redistribute" in name


def _implicit_free_ns(allocation: tuple[int, int, int, int], reused_ns: int | None,
                      lifetimes: dict[int, list[tuple[int, int | None]]] | None = None) -> int:
    """When a block freed on another thread (no free event) was freed: when the storage an op
    returned at its address died, if ``lifetimes`` saw it; else when the innermost collective op
    (else the outermost op) that allocated it returned (the collective's work, which holds it, is
    done by then); and no later than when its address was handed out again."""
    start_ns, ptr, _, outer_end_ns = allocation
    for born_ns, died_ns in (lifetimes or {}).get(ptr, ()):
        if born_ns < start_ns or (reused_ns is not None and born_ns > reused_ns):
            continue
        if died_ns is not None:
            return min(died_ns, reused_ns) if reused_ns is not None else died_ns
        break
    end = outer_end_ns if outer_end_ns > start_ns else start_ns
    return min(end, reused_ns) if reused_ns is not None else end


def counting_mode() -> CommDebugMode:
    """CommDebugMode that also counts the in-place functional all-reduce (the local program's gradient
    buckets, lowering.bucket_gradient_reductions), which torch's registry leaves out."""
    mode = CommDebugMode()
    mode.comm_registry.add(torch.ops._c10d_functional.all_reduce_)
    return mode


def count_step_collectives(module, args: tuple, kwargs: dict):
    """Run forward and backward once, counting collectives: (forward mode, backward mode, grad-sync buckets, loss).

    Forward collectives are counted in a no-grad forward: a graph recorded under CommDebugMode cannot
    be differentiated when it contains ops run locally on shards (ops.sdpa) in torch 2.13.
    """
    lowered = getattr(module, "lowered", None)
    # Inductor's compiled code issues collectives below the dispatcher's Python modes, where
    # CommDebugMode cannot see them: the counting step runs the same lowered graphs as Python.
    as_python = lowered.as_python() if lowered is not None and lowered.compile else contextlib.nullcontext()
    with as_python:
        with torch.no_grad(), CommDebugMode() as fwd:
            module(*args, **kwargs)
        loss = module(*args, **kwargs)
        with counting_mode() as bwd:
            loss.backward()
    return fwd, bwd, list(module.grad_sync.last_buckets), loss


def bucketed_in_graph(module) -> tuple[int, list[tuple[int, int]]]:
    """(gradient buckets the local program's backward graph all-reduces itself, (mesh axis, bytes) of the
    plan's backward collectives among their members) for the variant now active (inside or outside
    ``no_sync``); (0, []) on the DTensor interpreter and compiled (no buckets in the graph there).

    A bucket is one all-reduce on the wire. A member that ends a sharded parameter's redistribution
    backward is a collective the plan lists under ``backward`` (lowering.bucket_gradient_reductions):
    verify counts it there, and out of the gradient synchronization's bytes."""
    lowered = getattr(module, "lowered", None)
    if lowered is None or lowered.compile:
        return 0, []
    return len(lowered.grad_buckets), list(lowered.bucketed_edge_reductions)


def _micro_batch(module, i: int, accumulate: int):
    """The context of micro-batch ``i`` of an optimizer step: ``no_sync`` for all but the last."""
    return module.no_sync() if i < accumulate - 1 else contextlib.nullcontext()


def verify_step(module, inputs: tuple[tuple, dict], optimizer: torch.optim.Optimizer, accumulate: int = 1) -> dict:
    """Run one training step, checked; return predicted vs measured collectives and peak bytes.

    ``accumulate``: micro-batches per optimizer step (``inputs`` each, all but the last under
    ``module.no_sync()``). Collectives are counted over the whole optimizer step: the plan's forward and
    backward collectives once per micro-batch, its gradient synchronization once per step."""
    args, kwargs = inputs

    def step():
        for i in range(accumulate):
            with _micro_batch(module, i, accumulate):
                module(*args, **kwargs).backward()
        optimizer.step()
        optimizer.zero_grad()

    # memory first: a step counted under CommDebugMode leaves the next steps' allocations ~8% higher
    # on a checkpointed plan (measured), an effect of the debug mode, not of the plan
    peak = measured_peak_bytes(step, module, optimizer)
    forward, backward, bucketed = Counter(), Counter(), 0
    for i in range(accumulate):
        with _micro_batch(module, i, accumulate):
            fwd, bwd, buckets, loss = count_step_collectives(module, args, kwargs)
            in_graph, edges = bucketed_in_graph(module)
        forward += executed_counts(fwd)
        # every bucket ran as one all-reduce: the synchronizing micro-batch reports all of them (the graph's
        # and GradSync's), one under no_sync reports none though its graph's buckets ran
        backward += executed_counts(bwd) - Counter({"all_reduce": len(buckets) or in_graph})
        backward += Counter({"all_reduce": len(edges)})
        bucketed += len(edges)
    optimizer.step()
    optimizer.zero_grad()
    plan = module.plan

    def per_step(phase: str) -> dict:
        return {op: n * accumulate for op, n in predicted_counts(plan, (phase,)).items()}

    predicted_sync = [c for c in plan.predictions["collectives"] if c.get("phase") == "grad_sync"]
    return {
        "accumulate": accumulate,
        "forward": {"predicted": per_step("forward"), "executed": dict(forward)},
        "backward": {"predicted": per_step("backward"), "executed": dict(backward),
                     "in_gradient_buckets": bucketed},
        "grad_sync": {"predicted_collectives": len(predicted_sync),
                      "predicted_bytes": sum(c["bytes"] for c in predicted_sync),
                      "executed_buckets": len(buckets),
                      "executed_bytes": sum(b[2] for b in buckets) - sum(nbytes for _, nbytes in edges)},
        "mismatches": {k: {"plan": v[0], "dtensor": v[1]} for k, v in module.executable.mismatches.items()},
        "hidden": module.executable.hidden,
        "peak_bytes": {"predicted": int(plan.predictions["peak_bytes"]), "measured": int(peak)},
        "loss": loss.item(),
    }


def format_report(report: dict, rank: int = 0) -> str:
    """A small predicted-vs-measured table."""
    k = report.get("accumulate", 1)
    lines = [f"[rank {rank}] cauto verify" + (f" (per optimizer step of {k} micro-batches)" if k > 1 else "")]
    for phase in ("forward", "backward"):
        ops = sorted(set(report[phase]["predicted"]) | set(report[phase]["executed"]))
        for op in ops or ["-"]:
            p, e = report[phase]["predicted"].get(op, 0), report[phase]["executed"].get(op, 0)
            lines.append(f"  {phase:9s} {op:15s} predicted {p:4d}  executed {e:4d}  {'ok' if p == e else 'DIFF'}")
        if report[phase].get("in_gradient_buckets"):
            lines.append(f"  {phase:9s} ({report[phase]['in_gradient_buckets']} of its all_reduces ran inside "
                         "gradient buckets)")
    gs = report["grad_sync"]
    lines.append(f"  grad_sync predicted {gs['predicted_collectives']} per-parameter collectives "
                 f"({gs['predicted_bytes'] / 2**20:.2f} MiB); executed {gs['executed_buckets']} buckets "
                 f"({gs['executed_bytes'] / 2**20:.2f} MiB)")
    pk = report["peak_bytes"]
    ratio = pk["measured"] / pk["predicted"] if pk["predicted"] else float("nan")
    lines.append(f"  peak bytes predicted {pk['predicted'] / 2**20:.1f} MiB  measured {pk['measured'] / 2**20:.1f} MiB "
                 f"(measured/predicted {ratio:.2f})")
    if pk.get("measured_per_rank"):
        per_rank = ", ".join(f"{m / 2**20:.2f}" for m in pk["measured_per_rank"])
        worst = max(abs(m / pk["predicted"] - 1) for m in pk["measured_per_rank"]) if pk["predicted"] else float("nan")
        lines.append(f"  peak bytes measured per rank [{per_rank}] MiB; worst |measured/predicted - 1| = {worst:.3f}")
    if report.get("hidden"):
        lines.append(f"  collectives DTensor runs inside ops (not plan edges): {report['hidden']}")
    if report["mismatches"]:
        lines.append(f"  placement mismatches (fixed by a redistribute): {report['mismatches']}")
    return "\n".join(lines)
