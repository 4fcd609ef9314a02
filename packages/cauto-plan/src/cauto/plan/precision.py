"""Which values a mixed-precision step moves in its compute dtype: one rule for the solver and the runtime.

Under autocast an op on autocast's lower-precision list (linear, matmul, convolution, attention...)
casts each floating fp32 input to the compute dtype (bf16) on entry and computes in it; its floating
outputs come out bf16. The captured graph shows this without naming autocast: the op takes an fp32
input and gives only bf16 (or fp16) floating outputs. When such an input has to be redistributed,
casting first and moving second gives the same values (a cast is elementwise) with half the bytes on
the wire and one bf16 copy shared by every consumer at that placement, where moving first would
move fp32 and leave one bf16 cast per consumer. So the runtime casts before it moves (DTensor's
``redistribute(..., forward_dtype=)``, the gradient still reduced in fp32 unless the plan asks for
bf16), and the solver prices that edge, and the copy its consumers save, at the compute dtype.

Parameters follow the same rule: a parameter stored sharded and gathered for a linear moves in bf16,
as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` gathers it, while the same tensor read by an
embedding (a tied head) moves in fp32 for that reader. (A runtime redistribution at the parameter
itself, before any reader, moves in bf16 only when every reader casts it: ``common_cast``.)

0-dim inputs are left alone: they take no part in type promotion, and an op may compute with them in
fp32 (a scalar factor), so casting one first would change a result.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cauto.plan.dtypes import ITEMSIZE, is_floating

#: bytes per element of the floating dtypes, by the names graph documents use
FLOAT_ITEMSIZE = {dtype: size for dtype, size in ITEMSIZE.items() if is_floating(dtype)}
#: the dtypes autocast computes in
LOWER_DTYPES = ("bfloat16", "float16")


def cast_on_entry(input_dtype: str, input_ndim: int, output_dtypes: Sequence[str]) -> str | None:
    """The dtype an op casts this input to as it starts (module doc), or None where it takes the
    input as it is. ``output_dtypes``: the op's output dtypes (non-floating ones are ignored)."""
    if input_dtype != "float32" or input_ndim == 0:
        return None
    floats = {d for d in output_dtypes if d in FLOAT_ITEMSIZE}
    if len(floats) != 1:
        return None
    (out,) = floats
    return out if out in LOWER_DTYPES else None


def common_cast(casts: Iterable[str | None]) -> str | None:
    """The dtype a value read by several ops moves in: the one cast every reader makes, else None."""
    seen = set(casts)
    if len(seen) != 1:
        return None
    return next(iter(seen))


def bytes_as(nbytes: int, dtype: str, as_dtype: str | None) -> int:
    """``nbytes`` of a ``dtype`` tensor, counted as the same elements in ``as_dtype`` (None: unchanged)."""
    if as_dtype is None or as_dtype == dtype or dtype not in FLOAT_ITEMSIZE:
        return nbytes
    return nbytes // FLOAT_ITEMSIZE[dtype] * FLOAT_ITEMSIZE[as_dtype]


__all__ = ["FLOAT_ITEMSIZE", "LOWER_DTYPES", "bytes_as", "cast_on_entry", "common_cast"]
