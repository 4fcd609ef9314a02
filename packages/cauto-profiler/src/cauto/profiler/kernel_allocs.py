"""What CPU kernels allocate inside themselves, out of the dispatcher's sight: asked of the kernel.

Some CPU kernels allocate through the CPU allocator while they run; no dispatch-level tracker sees
those buffers, but the allocator (and so the ground truth) does. Found per op in real training
steps of the zoo (torch 2.13, oneDNN 3.12, see ``tools/bench/hidden_allocations.py``):

- oneDNN convolutions (fp32 and bf16, forward and backward): the source, weights and destination
  (or their diffs) reordered to blocked layouts (channels padded to the ISA's block), the primitive's
  scratchpad, and for bf16 an output copied to the suggested memory format;
- oneDNN matmuls (bf16/fp16 ``mm``/``addmm``/``bmm``/``baddbmm``; fp32 ones go to MKL, whose
  buffers are its own): the brgemm scratchpad, whose A/B copy buffers and fp32 accumulators are
  sized by oneDNN's blocking heuristics (ISA, L2 size, thread count), so they jump with the shape;
- ATen temporaries: CPU flash attention's per-thread blocks, batch norm's per-channel statistics
  and its backward's input-sized buffer, layer norm backward's partial sums, a reduced-precision
  ``mean`` summed through an fp32 copy of its input, ``mse_loss``'s input-sized result storage, a
  contiguous copy of non-contiguous indices in ``embedding`` and its backward.

Their sizes follow no closed form short of re-implementing oneDNN's heuristics, so the rule is
asked of the kernel itself: :func:`kernel_allocs` runs the op once on zero-filled CPU tensors with
the same sizes, strides, dtypes and requires_grad, the same non-tensor arguments, grad mode and
thread count (below autograd and autocast, as the real call runs), and reads the allocator's events
(torch.profiler memory events, like the ground truth). The answer is cached per key. Every buffer
seen is freed before the kernel returns, so one number describes it: the highest bytes the call
had allocated at once (its outputs included). The real outputs' strides come back too: the tracker
gives the outputs the real kernel's layout where the meta kernel's differs (a oneDNN convolution of
a channels-last input is channels-last; the meta kernel says contiguous). Calls above :data:`MAX_FLOPS` or :data:`MAX_BYTES`
are not run (too slow or too big to ask); the profile counts them as not modelled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from cauto.profiler.memory_session import quiet_fd2

_aten = torch.ops.aten

#: CPU kernels that allocate inside themselves (see the module docstring for what each allocates).
KERNELS = frozenset(
    getattr(getattr(_aten, packet), overload)
    for packet, overload in (
        ("convolution", "default"), ("convolution_backward", "default"),
        ("mm", "default"), ("addmm", "default"), ("bmm", "default"), ("baddbmm", "default"),
        ("_scaled_dot_product_flash_attention_for_cpu", "default"),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", "default"),
        ("native_batch_norm", "default"), ("native_batch_norm_backward", "default"),
        ("_native_batch_norm_legit", "default"), ("_native_batch_norm_legit_functional", "default"),
        ("native_layer_norm_backward", "default"),
        ("mean", "dim"), ("mse_loss", "default"), ("embedding", "default"),
        ("embedding_dense_backward", "default"), ("cumsum", "default"),
    )
    if hasattr(_aten, packet) and hasattr(getattr(_aten, packet), overload))

#: Calls with more FLOPs than this are not run to ask (about 15 ms of AMX bf16 or 0.1 s of fp32 on one core).
MAX_FLOPS = 1e10
#: Calls whose tensors (inputs and outputs) take more bytes than this are not run to ask.
MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class KernelAllocs:
    """What one call allocated on the CPU allocator, measured on a real run of the kernel."""

    peak_bytes: int  #: most bytes it had allocated at once, its outputs included
    output_bytes: tuple[int | None, ...]  #: storage bytes of each output tensor (pytree leaf order)
    output_strides: tuple[tuple[int, ...], ...]  #: strides of each output tensor (the real kernel's layout)
    retained_bytes: int  #: bytes it left allocated that are not its outputs' storages (0 when seen)


_CACHE: dict = {}


def kernel_allocs(func, args, kwargs, out=None, flops: float = 0.0) -> KernelAllocs | None:
    """Ask the real CPU kernel of ``func`` what it allocates for arguments with this metadata.

    ``args``/``kwargs`` and ``out`` (the outputs the tracker computed) may hold meta or fake tensors:
    only their metadata is used. None when the call is above the limits or cannot be asked (a
    profiler is already running, or the op fails on the stand-ins).
    """
    key = (func, _key(args), _key(kwargs), torch.get_num_threads(), torch.is_grad_enabled())
    if key in _CACHE:
        return _CACHE[key]
    tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    if flops > MAX_FLOPS or sum(_extent_bytes(t) for t in tensors) > MAX_BYTES \
            or torch._C._autograd._profiler_enabled():
        return None
    result = _CACHE[key] = _measure(func, args, kwargs)
    return result


def _measure(func, args, kwargs) -> KernelAllocs | None:
    with torch._C._DisableTorchDispatch(), _disable_current_modes():
        real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, _real, (args, kwargs))
        holder: list = []
        session = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with torch._C._AutoDispatchBelowAutograd(), torch._C._DisableAutocast(), quiet_fd2(), session as prof:
            try:
                holder.append(func(*real_args, **real_kwargs))
            except Exception:  # noqa: BLE001 - an op the zero-filled stand-ins cannot run: not modelled
                return None
        outs = [t for t in pytree.tree_leaves(holder) if isinstance(t, torch.Tensor)]
        fresh = {}
        live = peak = 0
        sizes: dict[int, int] = {}
        for _, ptr, size in _allocator_events(prof):
            if size > 0:
                sizes[ptr] = size
                live += size
            elif ptr in sizes:
                live -= sizes.pop(ptr)
            peak = max(peak, live)
        output_bytes = []
        for t in outs:
            ptr = t.untyped_storage().data_ptr()
            n = sizes.get(ptr)
            output_bytes.append(t.untyped_storage().nbytes() if n is not None else None)
            if n is not None:
                fresh[ptr] = n
        retained = live - sum(fresh.values())
    return KernelAllocs(peak, tuple(output_bytes), tuple(tuple(t.stride()) for t in outs), retained)


def cpu_description() -> str:
    """What the measured sizes depend on: the CPU's ISA as torch and oneDNN use it, and threads."""
    isa = torch.backends.cpu.get_cpu_capability()
    features = (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"),
                ("AMX-FP16", "_is_amx_fp16_supported"))
    extras = [name for name, probe in features if getattr(torch.cpu, probe, lambda: False)()]
    onednn = re.search(r"MKL-DNN (v[\d.]+)", torch.__config__.show())
    return (f"{' + '.join([isa, *extras])}, oneDNN {onednn.group(1) if onednn else 'absent'}, "
            f"{torch.get_num_threads()} thread(s)")


def _allocator_events(prof) -> list[tuple[int, int, int]]:
    """(time, ptr, signed size) of every CPU allocator event of a torch.profiler session, in order."""
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == torch._C._profiler._EventType.Allocation:
            if e.typed[1].device.type == "cpu":
                events.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size))
        stack.extend(e.children)
    events.sort()
    return events


def _real(t: torch.Tensor) -> torch.Tensor:
    """A zero-filled CPU tensor with ``t``'s sizes, strides, dtype and requires_grad."""
    base = torch.zeros(_extent(t), dtype=t.dtype)
    real = base.as_strided(tuple(t.shape), tuple(t.stride()))
    if t.requires_grad and (t.is_floating_point() or t.is_complex()):
        real.requires_grad_(True)
    return real


def _extent(t: torch.Tensor) -> int:
    """Elements of storage the strided view spans."""
    if any(s == 0 for s in t.shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _extent_bytes(t: torch.Tensor) -> int:
    return _extent(t) * t.element_size()


def _key(x):
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
    if isinstance(x, (tuple, list)):
        return tuple(_key(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _key(v)) for k, v in x.items())
    if isinstance(x, float) and x != x:
        return "nan"
    return (type(x), x) if isinstance(x, (int, float, bool)) else x
