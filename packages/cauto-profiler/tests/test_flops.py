"""FLOPs per node against torch's FlopCounterMode; roofline time from the device model."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from cauto.profiler import profile, zoo
from cauto.profiler.capture import LossWrapper, split_inputs
from cauto.profiler.devices import H100, get_device_model


def _real_flops(fn) -> int:
    torch.manual_seed(0)
    model, inputs = fn()
    args, kwargs = split_inputs(inputs)
    counter = FlopCounterMode(display=False)
    with counter:
        LossWrapper(model)(*args, **kwargs).backward()
    return counter.get_total_flops()


def test_flops_equal_flop_counter_mode_mlp_and_cnn():
    for fn in (zoo.mlp, zoo.cnn):
        prof = profile(fn, steps=1)
        assert prof.flops == _real_flops(fn) > 0


def test_flops_add_cpu_flash_attention_that_flop_counter_misses():
    prof = profile(zoo.gpt, steps=1)
    attn = [n for n in prof.nodes.values() if "scaled_dot_product" in n.op]
    assert attn
    b, h, s, d = 4, 4, 32, 16
    for n in attn:
        assert n.fwd_flops == 4 * b * h * s * s * d  # QK^T and PV
        assert n.bwd_flops == 2 * n.fwd_flops + 2 * b * h * s * s * d
    # everything else is exactly what FlopCounterMode counts on the real CPU run (0 for flash attention)
    assert prof.flops - sum(n.fwd_flops + n.bwd_flops for n in attn) == _real_flops(zoo.gpt)


def test_linear_flops_and_bytes_per_node():
    prof = profile(zoo.mlp, steps=1)
    first, lin = prof.nodes["linear"], prof.nodes["linear_1"]
    assert first.fwd_flops == 2 * 32 * 64 * 256
    assert first.bwd_flops == first.fwd_flops  # the input needs no grad: only the weight's
    assert lin.fwd_flops == 2 * 32 * 256 * 256
    assert lin.bwd_flops == 2 * lin.fwd_flops  # grad input + grad weight
    assert lin.fwd_bytes >= 4 * (32 * 256 + 256 * 256 + 256 + 32 * 256)
    assert lin.fwd_time_s > 0 and lin.bwd_time_s > lin.fwd_time_s / 2


def test_retime_for_a_gpu_preset():
    prof = profile(zoo.gpt, steps=1, device_model="h100")
    assert prof.device_model is H100
    t = prof.time_s
    prof.retime("a100")
    assert prof.time_s > t  # slower GPU
    assert get_device_model("h200").memory_bandwidth_bytes_per_s > H100.memory_bandwidth_bytes_per_s
