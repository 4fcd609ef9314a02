"""A custom torch.autograd.Function is refused by name, never replaced by autodiff of its forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cauto.profiler import CaptureError, capture, profile
from cauto.profiler.errors import CustomFunctionError


class StraightThroughRound(torch.autograd.Function):
    """Forward rounds to quarters; backward passes the gradient through (autodiff would give 0)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Quantize(nn.Module):
    def forward(self, x):
        return StraightThroughRound.apply(x)


class Block(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.quant = Quantize()

    def forward(self, x):
        return self.quant(self.proj(x))


class Net(nn.Module):
    def __init__(self, blocks: int = 1):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


class ReentrantCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Linear(8, 8)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True).sum()


def test_eager_gradient_is_not_autodiff_of_forward():
    """The premise: this Function's backward differs from autodiff of its forward (round has grad 0)."""
    x = torch.randn(4, 8, requires_grad=True)
    StraightThroughRound.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    y = x.detach().requires_grad_(True)
    (torch.round(y * 4) / 4).sum().backward()
    assert torch.equal(y.grad, torch.zeros_like(y))


@pytest.mark.parametrize("blocks", [1, 5])  # 5: the repeated-block (stamped) capture path
def test_profile_refuses_custom_function_by_name_and_module(blocks):
    with pytest.raises(CustomFunctionError) as info:
        profile(lambda: (Net(blocks), torch.randn(4, 8)))
    msg = str(info.value)
    assert "StraightThroughRound" in msg and "'layers.0.quant'" in msg
    assert ".detach()" in msg  # says what to do
    assert isinstance(info.value, CaptureError)
    # the patch is gone after the refusal: eager use of the Function still has its own backward
    x = torch.randn(3, requires_grad=True)
    StraightThroughRound.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(3))


def test_reentrant_checkpoint_is_refused_with_the_non_reentrant_way_out():
    with pytest.raises(CustomFunctionError) as info:
        capture(lambda: (ReentrantCheckpoint(), torch.randn(4, 8)))
    msg = str(info.value)
    assert "CheckpointFunction" in msg and "use_reentrant=False" in msg and "top-level forward" in msg
