"""Stock Hugging Face architectures the plain zoo models do not cover: they profile, and the peak is
the real allocator's (tiny random-weight configs, fp32, 2 AdamW steps, CPU, one thread)."""

from __future__ import annotations

import pytest
import torch

from cauto.profiler import profile, zoo
from cauto.profiler.ground_truth import measure
from cauto.profiler.symbolic import _sdpa_choice_cpu

pytest.importorskip("transformers")


def test_sdpa_choice_follows_the_masks_requires_grad():
    """CPU flash attention has no gradient for the mask: eager takes the math kernel (0) for a float
    mask that requires grad, flash (1) otherwise; the profiler asks with the same flags."""
    q = torch.empty(2, 4, 16, 8, device="meta")
    mask = torch.empty(1, 4, 16, 16, device="meta")
    assert _sdpa_choice_cpu(q, q, q, mask) == 1
    assert _sdpa_choice_cpu(q, q, q, mask.requires_grad_(True)) == 0


@pytest.mark.parametrize("name", ["hf_t5", "hf_swin"])
def test_learned_position_bias_models_profile_with_eagers_kernel(name):
    """T5's and Swin's position bias is a float mask that requires grad: SDPA takes the math kernel,
    as eager does (before: CaptureError, flash attention is not differentiable w.r.t. attn_mask)."""
    fn = zoo.ZOO[name]
    prof = profile(fn)
    eager = measure(fn)
    # T5: +0.26% (traced T5 builds its masks another way); Swin: +1.2% (convolution layout, not yet modelled)
    assert abs(prof.peak_bytes - eager.peak_bytes) <= 0.015 * eager.peak_bytes
