"""Ops the tracker answers itself: the SDPA kernel the modelled device picks, CPU norms' statistics, and
``.item()`` of optimizer step counters."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cauto.profiler.capture import CaptureError

_CPU_CHOICES: dict = {}


def sdpa_choice_cpu(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs) -> int:
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


_SDP_MATH, _SDP_FLASH, _SDP_EFFICIENT = 0, 1, 2


def sdpa_for(device: str) -> Callable:
    """aten.scaled_dot_product_attention routed to the kernel the modelled device picks.

    On meta tensors the composite op cannot ask the device which kernel it would use (the choice
    is a per-device stub) and falls back to the math path, which saves the attention matrix; the
    real CPU or GPU runs a fused kernel that saves only the output and logsumexp.
    """
    aten = torch.ops.aten
    choose = _sdpa_choice_cuda if device == "cuda" else sdpa_choice_cpu

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        choice = choose(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa)
        if choice in (_SDP_FLASH, _SDP_EFFICIENT) and attn_mask is not None and attn_mask.dtype == torch.bool:
            # at::convert_boolean_attn_mask: where(mask, 0, -inf) in the query's dtype
            attn_mask = torch.where(attn_mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=q.dtype,
                                                                          device=attn_mask.device))
        if choice == _SDP_FLASH and device == "cpu" and (q.size(1) == k.size(1) or enable_gqa):
            # the CPU flash kernel takes grouped key/value heads as they are (no repeat)
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


def special_ops(device: str) -> dict:
    """Ops the tracker answers itself: the SDPA backend choice (by the modelled device, not by the
    tensors' meta device) and .item() of optimizer step counters."""
    choose = _sdpa_choice_cuda if device == "cuda" else sdpa_choice_cpu

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
    return tracker.after_op(func, args, kwargs, tuple(outs))

