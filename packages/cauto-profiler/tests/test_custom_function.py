"""A custom torch.autograd.Function is kept as one node with its own backward, or refused by name; never
replaced by autodiff of its forward."""

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
def test_custom_function_is_one_node_with_its_own_backward(blocks):
    """The Function is one node (its forward's round is not in the graph), the profile's peak is the eager
    step's byte for byte, and the gradient through the captured program is the Function's (straight
    through: ones), not autodiff of its forward (zeros). Before: refused at capture."""
    from cauto.profiler.ground_truth import measure

    def fn():
        torch.manual_seed(0)
        return Net(blocks), torch.randn(4, 8)

    cap = capture(fn)
    targets = [str(n.target) for n in cap.graph.nodes if n.op == "call_function"]
    kept = [t for t in targets if t.startswith("cauto_kept.")]
    assert len(kept) == blocks and "aten.round.default" not in targets
    assert profile(fn).peak_bytes == measure(fn).peak_bytes
    # the captured program, run for real: the gradient reaching the Function's input is the user's
    from cauto.profiler.capture import LossWrapper, keep_autograd_functions

    model, x = Net(blocks), torch.randn(4, 8)
    wrapper = LossWrapper(model)
    with keep_autograd_functions(wrapper):
        program = torch.export.export(wrapper, (x,), strict=False).module()
    program(x).backward()
    from_program = model.layers[0].proj.weight.grad.clone()
    model.zero_grad()
    wrapper(x).backward()
    assert torch.equal(from_program, model.layers[0].proj.weight.grad)
    assert from_program.abs().sum() > 0  # autodiff of round would give exactly 0 here


class TensorOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.kept = x * 2  # a tensor outside save_for_backward
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.kept


def test_function_that_cannot_be_kept_is_refused_by_name_module_and_reason():
    class Uses(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return TensorOnCtx.apply(self.proj(x)).sum()

    with pytest.raises(CustomFunctionError) as info:
        profile(lambda: (Uses(), torch.randn(4, 8)))
    msg = str(info.value)
    assert "TensorOnCtx" in msg and "top-level forward" in msg and "save_for_backward" in msg
    assert ".detach()" in msg  # says what to do
    assert isinstance(info.value, CaptureError)
    # the patch is gone after the refusal: eager use of a Function still has its own backward
    x = torch.randn(3, requires_grad=True)
    StraightThroughRound.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(3))


def test_reentrant_checkpoint_is_refused_with_the_non_reentrant_way_out():
    with pytest.raises(CustomFunctionError) as info:
        capture(lambda: (ReentrantCheckpoint(), torch.randn(4, 8)))
    msg = str(info.value)
    assert "CheckpointFunction" in msg and "use_reentrant=False" in msg and "top-level forward" in msg


@torch.library.custom_op("cauto_test::scaled_copy", mutates_args=())
def scaled_copy(x: torch.Tensor) -> torch.Tensor:
    """A library op whose registered backward (3 * grad) is not autodiff of its forward (2 * x)."""
    return x * 2


@scaled_copy.register_fake
def _(x):
    return torch.empty_like(x)


def _scaled_copy_backward(ctx, grad):
    return grad * 3


torch.library.register_autograd("cauto_test::scaled_copy", _scaled_copy_backward)


class LibraryOpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return scaled_copy(self.proj(x)).sum()


def test_library_op_with_registered_autograd_is_one_node_not_a_refused_function():
    """torch runs a library op's registered autograd through a generated autograd.Function
    (torch._library.autograd): that is no user Function; the graph keeps the op as one node, whose
    backward is the registered formula (before: refused as CustomFunctionError, Mixtral's experts)."""
    cap = capture(lambda: (LibraryOpNet(), torch.randn(4, 8)))
    targets = [str(n.target) for n in cap.graph.nodes if n.op == "call_function"]
    assert "cauto_test.scaled_copy.default" in targets
    assert "aten.mul.Tensor" not in targets  # its forward was not inlined


class DeviceBranch(nn.Module):
    """Counts like transformers' experts: a float copy on CPU, int32 elsewhere (histc has no CPU int)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        ids = self.proj(x).argmax(-1)
        counts = torch.histc(ids.float() if ids.device.type == "cpu" else ids.int(), bins=4, min=0, max=3)
        return (self.proj(x).sum(-1) * counts.sum()).sum()


# meta stands for "not CPU" here: fake CUDA tensors need a CUDA build of torch
@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), ("meta", torch.int32)])
def test_capture_sees_the_device_the_program_runs_on(device, dtype):
    """The model is built on meta but traced as fake tensors on the target device, so code that
    branches on the device takes that device's branch (on meta it took the int32 one, which CPU's
    histc cannot run); the program's device arguments stay meta."""
    cap = capture(lambda: (DeviceBranch(), torch.randn(4, 8)), device=device)
    (histc,) = [n for n in cap.graph.nodes if str(n.target) == "aten.histc.default"]
    assert histc.args[0].meta["val"].dtype == dtype
    devices = [a for n in cap.graph.nodes for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
               if isinstance(a, torch.device)]
    assert devices and all(d.type == "meta" for d in devices)
    assert all(p.device.type == "meta" for p in cap.model.parameters())
    assert all(t.device.type == "meta" for t in cap.exported.state_dict.values())
