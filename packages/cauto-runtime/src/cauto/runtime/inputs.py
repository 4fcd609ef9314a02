"""The user's inputs of one call, in the order the capture's graph takes them."""

from __future__ import annotations

import torch


def flat_inputs(args: tuple, kwargs: dict, kwarg_order: list[str], input_names: list[str],
                constants: dict | None = None) -> list:
    """The graph's inputs of one call: positional inputs, then keyword inputs in capture order, less the
    capture's constants (``Capture.constants``: non-tensor inputs the graph was traced with), which
    must be given with their captured values. TypeError naming what does not fit."""
    constants = constants or {}
    extra = set(kwargs) - set(kwarg_order)
    if extra:
        raise TypeError(f"unexpected inputs {sorted(extra)}; the model was captured with {kwarg_order}")
    given = [*enumerate(args), *((k, kwargs[k]) for k in kwarg_order if k in kwargs)]
    missing = [k for k in constants if k not in dict(given)]
    if missing:
        raise TypeError(f"input {_name(missing[0])} is missing; the model was captured with "
                        f"{_name(missing[0])}={constants[missing[0]]!r} (a constant of the program): pass it")
    flat = []
    for key, value in given:
        if key not in constants:
            flat.append(value)
        elif not _same(value, constants[key]):
            raise TypeError(f"input {_name(key)} is {value!r}, but the model was captured with {constants[key]!r}: "
                            "a non-tensor input is a constant of the captured program; capture and plan again "
                            "with this value")
    if len(flat) != len(input_names):
        raise TypeError(f"the model was captured with {len(input_names)} inputs {input_names}, got {len(flat)}")
    return flat


def _name(key: int | str) -> str:
    return f"#{key} (positional)" if isinstance(key, int) else repr(key)


def _same(value: object, captured: object) -> bool:
    if value is captured:
        return True
    if type(value) is not type(captured) or isinstance(value, torch.Tensor):
        return False
    try:
        return bool(value == captured)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        return False
