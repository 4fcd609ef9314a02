"""cauto.profiler: capture a model once and profile its training step symbolically."""

from cauto.profiler.capture import Capture, CaptureError, capture, loss_of

__all__ = ["Capture", "CaptureError", "capture", "loss_of"]
