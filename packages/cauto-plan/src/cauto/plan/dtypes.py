"""Dtype names as graph documents write them (torch's names without ``torch.``: "float32", "bfloat16",
"int64", "complex64"...): bytes per element, which are floating and which autograd gives a gradient.
Torch-free, so that the solver's stages and synthetic graphs ask one rule."""

from __future__ import annotations

#: bytes per element of the dtypes the solver meets (a graph's bytes over this give its element count)
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "complex64": 8}


def is_floating(dtype: str) -> bool:
    """Whether ``dtype`` is a real floating dtype: float16/32/64, bfloat16, the float8 kinds."""
    return dtype.startswith(("float", "bfloat"))


def has_gradient(dtype: str) -> bool:
    """Whether autograd can give a tensor of ``dtype`` a gradient: floating or complex (torch's rule
    for ``requires_grad``); integer and bool tensors never have one."""
    return is_floating(dtype) or dtype.startswith("complex")


__all__ = ["ITEMSIZE", "has_gradient", "is_floating"]
