"""FLOPs per ATen op: torch's formula registry, plus the CPU flash-attention kernels it counts as 0."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count


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
