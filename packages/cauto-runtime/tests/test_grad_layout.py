"""ops.redistribute gives the gradient its input's memory layout, unless that layout overlaps."""

from __future__ import annotations

import torch
from conftest import fake_world
from torch.distributed.tensor import DTensor, Replicate

from cauto.runtime import ops


def _mesh():
    from cauto.runtime.dist_utils import make_mesh

    fake_world(2)
    return make_mesh((2,), ["dp"])


def test_gradient_of_an_expanded_input_is_dense():
    """An expanded input (a 0 stride, CLIP's broadcast position ids or scale) has no gradient with
    its own strides: the gradient stays dense (before: copy_ into overlapping memory raised)."""
    mesh = _mesh()
    base = torch.randn(1, 6, requires_grad=True)
    x = DTensor.from_local(base.expand(4, 6), mesh, [Replicate()], run_check=False)  # strides (0, 1)
    y = ops.redistribute(x, mesh, "S(0)")
    y.to_local().sum().backward()
    assert base.grad is not None and base.grad.shape == (1, 6)
