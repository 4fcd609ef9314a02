"""PlanOptions: keyword-only, frozen, every bad choice refused with the option's name and its values."""

from __future__ import annotations

import dataclasses

import pytest

from cauto.plan.options import OptionsError, PlanOptions


def test_defaults_and_cache_key():
    o = PlanOptions()
    assert (o.memory_budget_bytes, o.checkpoint, o.offload, o.offload_axes, o.solver) == (None, "none", "none", None,
                                                                                           "cbc")
    assert o.to_dict() == {"budget": None, "checkpoint": "none"}  # the key plans cached before offload existed had
    o = PlanOptions(memory_budget_bytes=1 << 30, offload="chunked", offload_axes=[1, 0])
    assert o.offload_axes == (1, 0)
    assert o.to_dict() == {"budget": 1 << 30, "checkpoint": "none", "offload": "chunked", "offload_axes": [1, 0]}
    with pytest.raises(TypeError):
        PlanOptions(1 << 30)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.checkpoint = "auto"


@pytest.mark.parametrize("kwargs, says", [
    ({"memory_budget_bytes": 0}, "memory budget 0 is not a positive number of bytes"),
    ({"memory_budget_bytes": True}, "memory budget True"),
    ({"memory_budget_bytes": 1.5}, "memory budget 1.5"),
    ({"checkpoint": "always"}, "checkpoint method 'always' is not one of none, auto, rotor, chen"),
    ({"offload": "sometimes"}, "offload 'sometimes' is not one of none, auto, chunked"),
    ({"offload_axes": (0,)}, "they need offload 'auto' or 'chunked'"),
    ({"solver": "gurobi"}, "unknown solver 'gurobi'; use one of"),
    ({"time_limit_s": -1}, "time_limit_s -1"),
])
def test_bad_options_name_the_field(kwargs, says):
    with pytest.raises(OptionsError, match=says):
        PlanOptions(**kwargs)


def test_mixed_precision_options():
    """bf16 is keyed only when asked for (fp32 keys stay valid); fp16 is refused with what to do; a bf16
    reduce dtype needs mixed precision."""
    assert "mixed_precision" not in PlanOptions().to_dict()
    assert PlanOptions(mixed_precision="bf16").to_dict()["mixed_precision"] == "bf16"
    assert PlanOptions(mixed_precision="bf16").to_dict() != PlanOptions().to_dict()
    with pytest.raises(OptionsError, match="fp16.*loss scaling.*bf16"):
        PlanOptions(mixed_precision="fp16")
    with pytest.raises(OptionsError, match="reduce dtype"):
        PlanOptions(reduce_dtype="bf16")
    both = PlanOptions(mixed_precision="bf16", reduce_dtype="bf16")
    assert both.to_dict()["reduce_dtype"] == "bf16" and both.to_dict() != PlanOptions(mixed_precision="bf16").to_dict()
