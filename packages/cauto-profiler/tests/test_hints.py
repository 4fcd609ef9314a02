"""Data-dependent ops: a clear error naming op and module, and size hints that work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cauto.profiler import CaptureError, profile, size_hint


class Select(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return torch.masked_select(h, h > 0).sum()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Select()

    def forward(self, x):
        return self.inner(x)


class ItemSlice(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        n = int((h > 0).sum().item())
        return h[:n].sum()


def factory():
    return Outer(), (torch.randn(4, 8),)


def test_data_dependent_op_without_hint_names_op_and_module():
    with pytest.raises(CaptureError) as info:
        profile(factory)
    msg = str(info.value)
    assert "masked_select" in msg and "'inner'" in msg and "size_hint" in msg


def test_size_hint_sizes_the_op():
    with size_hint(masked_select=10):
        prof = profile(factory)
    doc = prof.to_graph()
    (node,) = [n for n in doc["nodes"] if n["op"] == "aten.masked_select.default"]
    assert node["outputs"][0]["shape"] == [10]
    bigger = profile(factory, size_hints={"masked_select": 32})
    assert bigger.phases["forward"] - prof.phases["forward"] >= (32 - 10) * 4
    with pytest.raises(CaptureError, match="size hint breaks a constraint"):
        profile(factory, size_hints={"masked_select": 33})  # more than the 4x8 elements there are


def test_item_in_python_control_flow_is_a_clear_error():
    with pytest.raises(CaptureError) as info:
        profile(lambda: (ItemSlice(), (torch.randn(4, 8),)))
    assert "data-dependent" in str(info.value) and "test_hints.py" in str(info.value)


def test_bad_hint_value():
    with pytest.raises(ValueError):
        with size_hint(nonzero=-1):
            pass
