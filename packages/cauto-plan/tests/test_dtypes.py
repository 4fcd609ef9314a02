"""The dtype rules the solver's stages share (cauto.plan.dtypes)."""

from __future__ import annotations

import pytest

from cauto.plan.dtypes import has_gradient, is_floating


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "float8_e4m3fn"])
def test_floating_dtypes_are_floating_and_have_gradients(dtype):
    assert is_floating(dtype) and has_gradient(dtype)


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_dtypes_have_gradients_but_are_not_real_floating(dtype):
    assert has_gradient(dtype) and not is_floating(dtype)


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8", "bool"])
def test_integer_and_bool_dtypes_have_no_gradient(dtype):
    assert not is_floating(dtype) and not has_gradient(dtype)
