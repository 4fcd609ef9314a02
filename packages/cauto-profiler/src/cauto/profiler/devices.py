"""Device models for the roofline time estimate: peak FLOP/s, memory bandwidth, per-kernel floor.

Presets ``a100``, ``h100``, ``h200`` come from NVIDIA datasheets (dense bf16 Tensor Core FLOP/s,
dense TF32 for fp32 matmuls, HBM bandwidth). ``cpu`` is measured on this machine by
:func:`calibrate_cpu` (a matmul and a large copy) and cached per process and on disk.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DeviceModel:
    """What the roofline needs: time(op) = max(flops / peak, bytes / bandwidth) + kernel_floor_s."""

    name: str
    peak_flops: float  #: dense FLOP/s for 16-bit floating point (bf16/fp16)
    peak_flops_fp32: float  #: dense FLOP/s for fp32 (TF32 on GPUs)
    memory_bandwidth_bytes_per_s: float
    kernel_floor_s: float
    memory_bytes: int = 0

    def flops_for(self, dtype: torch.dtype | None) -> float:
        """Peak FLOP/s for ops producing ``dtype``."""
        return self.peak_flops if dtype in (torch.bfloat16, torch.float16) else self.peak_flops_fp32

    def time(self, flops: float, nbytes: float, dtype: torch.dtype | None = None) -> float:
        """Roofline time of one kernel."""
        return max(flops / self.flops_for(dtype), nbytes / self.memory_bandwidth_bytes_per_s) + self.kernel_floor_s

    def to_dict(self) -> dict:
        """The graph document's ``device`` object."""
        return {"name": self.name, "peak_flops": self.peak_flops,
                "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
                "kernel_floor_s": self.kernel_floor_s, "memory_bytes": self.memory_bytes}


GiB = 1 << 30
#: A100 SXM 80GB: 312 TFLOP/s bf16 dense, 156 TF32, 2.039 TB/s HBM2e
A100 = DeviceModel("a100", 312e12, 156e12, 2.039e12, 4e-6, 80 * GiB)
#: H100 SXM: 989 TFLOP/s bf16 dense, 495 TF32, 3.35 TB/s HBM3
H100 = DeviceModel("h100", 989e12, 495e12, 3.35e12, 4e-6, 80 * GiB)
#: H200 SXM: same compute as H100, 4.8 TB/s HBM3e, 141 GB
H200 = DeviceModel("h200", 989e12, 495e12, 4.8e12, 4e-6, 141 * 10**9)

PRESETS = {"a100": A100, "h100": H100, "h200": H200}
_CPU: DeviceModel | None = None
_CACHE = Path(os.environ.get("CAUTO_CACHE", Path.home() / ".cache" / "cauto")) / "cpu_device.json"


def _best(fn, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate_cpu(*, use_cache: bool = True) -> DeviceModel:
    """Measure this CPU: fp32/bf16 matmul FLOP/s, copy bandwidth, and a tiny op's latency (≈0.3 s).

    The result is cached for the process and in ``~/.cache/cauto/cpu_device.json`` (keyed by the
    thread count); pass ``use_cache=False`` to measure again.
    """
    global _CPU
    key = f"threads={torch.get_num_threads()}"
    if use_cache and _CPU is not None:
        return _CPU
    if use_cache and _CACHE.exists():
        try:
            data = json.loads(_CACHE.read_text())
            if data.get("key") == key:
                _CPU = DeviceModel(**data["model"])
                return _CPU
        except (OSError, ValueError, TypeError):
            pass
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    fp32 = 2 * n**3 / _best(lambda: a @ b)
    ab, bb = a.bfloat16(), b.bfloat16()
    bf16 = 2 * n**3 / _best(lambda: ab @ bb)
    src = torch.empty(16 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / _best(lambda: dst.copy_(src))  # read + write
    x = torch.randn(8)
    floor = _best(lambda: [x.add(1) for _ in range(100)]) / 100
    _CPU = DeviceModel("cpu", max(bf16, 1.0), max(fp32, 1.0), bw, floor, 0)
    try:
        _CACHE.parent.mkdir(parents=True, exist_ok=True)
        _CACHE.write_text(json.dumps({"key": key, "model": asdict(_CPU)}))
    except OSError:
        pass
    return _CPU


def get_device_model(spec: str | DeviceModel | None, device: str = "cpu") -> DeviceModel:
    """A DeviceModel from a preset name ('cpu', 'a100', 'h100', 'h200') or an instance.

    None picks 'cpu' for device="cpu" and 'h100' for device="cuda".
    """
    if isinstance(spec, DeviceModel):
        return spec
    if spec is None:
        spec = "cpu" if device == "cpu" else "h100"
    spec = spec.lower()
    if spec == "cpu":
        return calibrate_cpu()
    if spec not in PRESETS:
        raise ValueError(f"unknown device model {spec!r}; expected one of {['cpu', *PRESETS]}")
    return PRESETS[spec]
