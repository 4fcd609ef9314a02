"""Size hints for data-dependent ops.

Ops whose output size depends on tensor values (``nonzero``, ``masked_select``, ``unique``,
``.item()`` feeding a size) cannot be sized from shapes alone. torch.export captures them with an
unbacked size symbol; the profiler needs a number for it. Give one per op name::

    with cauto.profiler.size_hint(masked_select=4096, nonzero=128):
        prof = cauto.profiler.profile(factory)

    cauto.profiler.profile(factory, size_hints={"masked_select": 4096})   # the same
    cauto-profile model.py:factory --size-hint masked_select=4096           # from the command line

The number is the data-dependent size: elements selected by ``masked_select``, rows of
``nonzero``, the value of ``.item()``. Every occurrence of that op uses it; ``name=N`` with the
node name (e.g. ``masked_select_1=N``) overrides one occurrence. Without a hint, capture fails with
a CaptureError naming the op, its node and module path. Python control flow on a data-dependent
value (``int(t.item())`` used to slice, ``if t.sum() > 0``) cannot be captured at all: torch.export
refuses it before any hint could apply; make the size static or use ``torch._check``.
"""

from __future__ import annotations

import contextlib
import contextvars

_HINTS: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("cauto_size_hints", default=None)


@contextlib.contextmanager
def size_hint(**sizes: int):
    """Within this block, capture and profile use these sizes for data-dependent ops (see module doc)."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"size hint {name}={value!r} must be a non-negative integer")
    token = _HINTS.set({**(_HINTS.get() or {}), **sizes})
    try:
        yield
    finally:
        _HINTS.reset(token)


def current_hints() -> dict[str, int]:
    """The size hints in effect (op or node name -> size)."""
    return dict(_HINTS.get() or {})
