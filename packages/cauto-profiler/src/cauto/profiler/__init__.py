"""cauto.profiler: capture a model once and profile its training step symbolically."""

from cauto.profiler.capture import Capture, CaptureError, capture, loss_of
from cauto.profiler.devices import DeviceModel, calibrate_cpu, get_device_model
from cauto.profiler.hints import size_hint
from cauto.profiler.kept_functions import declare_elementwise
from cauto.profiler.results import Profile
from cauto.profiler.symbolic import profile

__all__ = ["Capture", "CaptureError", "DeviceModel", "Profile", "calibrate_cpu", "capture", "declare_elementwise",
           "get_device_model", "loss_of", "profile", "size_hint"]
