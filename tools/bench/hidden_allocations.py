"""Which CPU kernels allocate inside themselves: the evidence behind cauto.profiler.kernel_allocs.

    OMP_NUM_THREADS=1 python tools/bench/hidden_allocations.py cnn --dtype bf16
    OMP_NUM_THREADS=1 python tools/bench/hidden_allocations.py hf_gpt2 --kw checkpoint=True --all

Runs real training steps of a zoo model (the loop the profiler simulates) under a dispatch mode
that wraps every ATen op the Python dispatcher sees in a profiler range, with torch.profiler memory
events on. An allocation inside an op's range whose storage is not one of the op's outputs is
hidden: no dispatch-level tracker sees it (oneDNN reorders and scratchpads, ATen temporaries).
Prints every op call with hidden bytes (``--all``; else only calls with at least 64 hidden bytes),
then the total per op, and flags ops that kernel_allocs.KERNELS does not list. Python numbers
wrapped into 8-byte tensors inside an op show up too; the profiler models those separately.
"""

from __future__ import annotations

import argparse
import ast
import collections

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from cauto.profiler import zoo
from cauto.profiler.capture import LossWrapper, split_inputs
from cauto.profiler.kernel_allocs import KERNELS
from cauto.profiler.training import cast_inputs, make_optimizer, run_steps

_PREFIX = "cauto_op:"


class _OpRanges(TorchDispatchMode):
    """Wraps every op in a profiler range and remembers the storages of its outputs."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []  # (op, arg shapes, dtypes, output storage pointers, phase)
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        i = len(self.calls)
        with torch.profiler.record_function(f"{_PREFIX}{i}"):
            out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        ptrs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
        self.calls.append((func, [tuple(t.shape) for t in tensors[:4]],
                           sorted({str(t.dtype).removeprefix("torch.") for t in tensors}), ptrs, self.phase))
        return out


def hidden_allocations(name: str, kw: dict, dtype: torch.dtype | None, steps: int) -> list[tuple]:
    """(op, arg shapes, dtypes, phase, hidden allocation sizes in order) of every call with any."""
    torch.manual_seed(0)
    model, inputs = zoo.ZOO[name](**kw)
    if dtype is not None:
        model, inputs = model.to(dtype), cast_inputs(inputs, dtype)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
    args, kwargs = split_inputs(inputs)
    wrapper = LossWrapper(model)
    opt = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], device="cpu")
    ops = _OpRanges()

    def mark(phase: str, step: int) -> None:
        ops.phase = f"{phase}:{step}"

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with ops:
            run_steps(lambda: wrapper(*args, **kwargs), opt, steps=steps, mark=mark)
    allocs: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)

    def walk(event, call):
        if event.typed[0] == torch._C._profiler._EventType.Allocation:
            a = event.typed[1]
            if a.device.type == "cpu" and a.alloc_size > 0 and call is not None:
                allocs[call].append((event.start_time_ns, a.ptr, a.alloc_size))
            return
        if event.name.startswith(_PREFIX):
            call = int(event.name[len(_PREFIX):])
        for child in event.children:
            walk(child, call)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    found = []
    for i, events in sorted(allocs.items()):
        func, shapes, dtypes, ptrs, phase = ops.calls[i]
        hidden = [size for _, ptr, size in sorted(events) if ptr not in ptrs]
        if hidden:
            found.append((func, shapes, dtypes, phase, hidden))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(zoo.ZOO))
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--kw", nargs="*", default=[], help="factory keyword arguments, e.g. checkpoint=True")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--all", action="store_true", help="list calls with fewer than 64 hidden bytes too")
    args = ap.parse_args()
    kw = {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in args.kw)}
    found = hidden_allocations(args.model, kw, {"fp32": None, "bf16": torch.bfloat16}[args.dtype], args.steps)
    totals: dict = collections.Counter()
    for func, shapes, dtypes, phase, hidden in found:
        totals[func] += sum(hidden)
        if args.all or sum(hidden) >= 64:
            print(f"{phase:12s} {func} {shapes} {dtypes} hidden={hidden}")
    print(f"\nhidden bytes per op ({args.model} {args.dtype} {kw or ''}, {torch.get_num_threads()} thread(s)):")
    for func, total in totals.most_common():
        note = "" if func in KERNELS else "   (not in kernel_allocs.KERNELS)"
        print(f"  {str(func):60s} {total:>10d}{note}")


if __name__ == "__main__":
    main()
