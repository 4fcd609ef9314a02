"""The profiler's errors: a model that cannot be captured."""

from __future__ import annotations


class CaptureError(RuntimeError):
    """The model could not be captured; the message says why and what to do."""


class CustomFunctionError(CaptureError):
    """The model calls a custom ``torch.autograd.Function`` that capture cannot keep as one node with its own
    backward (see :func:`cauto.profiler.capture.keep_autograd_functions`)."""
