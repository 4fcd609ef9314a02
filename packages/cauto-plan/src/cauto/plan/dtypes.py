"""Dtype names as graph documents write them (torch's names without ``torch.``: "float32", "bfloat16",
"int64", "complex64"...): which are floating and which autograd gives a gradient. Torch-free, so that
the solver's stages ask one rule."""

from __future__ import annotations


def is_floating(dtype: str) -> bool:
    """Whether ``dtype`` is a real floating dtype: float16/32/64, bfloat16, the float8 kinds."""
    return dtype.startswith(("float", "bfloat"))


def has_gradient(dtype: str) -> bool:
    """Whether autograd can give a tensor of ``dtype`` a gradient: floating or complex (torch's rule
    for ``requires_grad``); integer and bool tensors never have one."""
    return is_floating(dtype) or dtype.startswith("complex")


__all__ = ["has_gradient", "is_floating"]
