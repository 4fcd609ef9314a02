"""The user's inputs of one call, in the order the capture's graph takes them."""

from __future__ import annotations


def flat_inputs(args: tuple, kwargs: dict, kwarg_order: list[str], input_names: list[str]) -> list:
    """Positional inputs, then keyword inputs in capture order; TypeError naming what does not fit."""
    extra = set(kwargs) - set(kwarg_order)
    if extra:
        raise TypeError(f"unexpected inputs {sorted(extra)}; the model was captured with {kwarg_order}")
    flat = list(args) + [kwargs[k] for k in kwarg_order if k in kwargs]
    if len(flat) != len(input_names):
        raise TypeError(f"the model was captured with {len(input_names)} inputs {input_names}, got {len(flat)}")
    return flat
