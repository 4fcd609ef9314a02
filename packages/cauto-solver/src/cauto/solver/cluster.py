"""Cluster specs: the device mesh the plan is solved for, per-axis links and per-device numbers.

A spec file (JSON, written by ``tools/calibrate.py`` or by hand) describes hardware, not a mesh::

    {"name": "...", "device": {"name", "memory_bytes", "peak_flops", "memory_bandwidth_bytes_per_s",
     "kernel_floor_s", "host_link_bandwidth_bytes_per_s"}, "devices_per_node": 8,
     "intra_node": {"latency_s", "bandwidth_bytes_per_s"}, "inter_node": {...}}

``cluster_for_mesh`` maps it onto a mesh: mesh axes are laid out row-major over the devices, so the
last axes span consecutive devices. An axis whose devices sit on one node (the product of its size
and every later axis' size divides ``devices_per_node``) uses the intra-node link, others the
inter-node link (the slower link bounds a ring that crosses nodes).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from cauto.plan import write_atomic
from cauto.solver.errors import SolverError


@dataclass(frozen=True)
class AxisLink:
    """α-β parameters of the collectives along one mesh axis."""

    latency_s: float
    """α: fixed cost of one collective step, seconds."""
    bandwidth_bytes_per_s: float
    """1/β: bytes per second one device sends along this axis."""

    def __post_init__(self):
        if self.latency_s < 0 or self.bandwidth_bytes_per_s <= 0:
            raise SolverError(f"link needs latency_s >= 0 and bandwidth_bytes_per_s > 0, got {self}")

    def to_dict(self) -> dict:
        return {"latency_s": self.latency_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s}


#: host<->device copy bandwidth of a device whose spec does not say (PCIe 4.0 x16, achievable)
DEFAULT_HOST_LINK_BANDWIDTH_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU process): memory and roofline numbers."""

    name: str
    memory_bytes: int
    """usable memory per device"""
    peak_flops: float
    """achievable FLOP/s of a large matmul in the training dtype"""
    memory_bandwidth_bytes_per_s: float
    kernel_floor_s: float = 0.0
    """least time of any kernel launch (dispatch overhead)"""
    all_to_all: bool = True
    """whether DTensor can use all-to-all here (False on CPU/gloo: it falls back to all-gather)"""
    host_link_bandwidth_bytes_per_s: float | None = None
    """bytes per second one device copies to or from host memory (PCIe, NVLink-C2C), what offloaded
    (chunked) model state moves over; None: ``min(memory_bandwidth_bytes_per_s, DEFAULT_HOST_LINK_BANDWIDTH_BYTES_PER_S)``"""

    def __post_init__(self):
        if self.memory_bytes <= 0 or self.peak_flops <= 0 or self.memory_bandwidth_bytes_per_s <= 0:
            raise SolverError(f"device {self.name!r} needs positive memory_bytes, peak_flops and bandwidth")
        if self.host_link_bandwidth_bytes_per_s is None:
            object.__setattr__(self, "host_link_bandwidth_bytes_per_s", min(
                self.memory_bandwidth_bytes_per_s, DEFAULT_HOST_LINK_BANDWIDTH_BYTES_PER_S))
        if self.host_link_bandwidth_bytes_per_s <= 0:
            raise SolverError(f"device {self.name!r} needs a positive host_link_bandwidth_bytes_per_s")

    def to_dict(self) -> dict:
        return {"name": self.name, "memory_bytes": int(self.memory_bytes), "peak_flops": self.peak_flops,
                "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
                "kernel_floor_s": self.kernel_floor_s,
                "host_link_bandwidth_bytes_per_s": self.host_link_bandwidth_bytes_per_s}

    def to_spec_dict(self) -> dict:
        """What a spec file holds (the plan's cluster.device plus ``all_to_all``)."""
        return {**self.to_dict(), "all_to_all": self.all_to_all}


@dataclass(frozen=True)
class ClusterSpec:
    """A device mesh with one link per axis and one device kind."""

    name: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    axes: tuple[AxisLink, ...]
    device: DeviceSpec

    def __post_init__(self):
        if not self.mesh_shape or any(int(s) < 1 for s in self.mesh_shape):
            raise SolverError(f"mesh shape {self.mesh_shape} must be 1 to 3 positive sizes")
        if len(self.mesh_shape) > 3:
            raise SolverError(f"mesh shape {self.mesh_shape} has {len(self.mesh_shape)} axes; at most 3 are supported")
        if len(self.axis_names) != len(self.mesh_shape) or len(set(self.axis_names)) != len(self.axis_names):
            raise SolverError(f"axis names {list(self.axis_names)} must be {len(self.mesh_shape)} distinct names")
        if len(self.axes) != len(self.mesh_shape):
            raise SolverError(f"{len(self.axes)} axis links for a {len(self.mesh_shape)}-D mesh")

    def budget_bytes(self, memory_budget_bytes: int | None) -> int:
        """The per-device memory budget of a plan: ``memory_budget_bytes``, or None: the device's memory
        (the one place the default is resolved)."""
        return int(memory_budget_bytes if memory_budget_bytes is not None else self.device.memory_bytes)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def to_dict(self) -> dict:
        """The plan document's ``cluster`` object."""
        return {"name": self.name, "axes": [a.to_dict() for a in self.axes], "device": self.device.to_dict()}


@dataclass(frozen=True)
class HardwareSpec:
    """What a spec file holds: a device and the two links of a multi-node cluster."""

    name: str
    device: DeviceSpec
    intra_node: AxisLink
    inter_node: AxisLink
    devices_per_node: int
    num_devices: int | None = None
    """devices in the whole cluster (None: as many as the mesh needs)"""

    def to_dict(self) -> dict:
        out = {"name": self.name, "device": self.device.to_spec_dict(), "devices_per_node": self.devices_per_node,
               "intra_node": self.intra_node.to_dict(), "inter_node": self.inter_node.to_dict()}
        if self.num_devices is not None:
            out["num_devices"] = self.num_devices
        return out

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "cluster spec") -> HardwareSpec:
        try:
            dev = DeviceSpec(**d["device"])
            intra = AxisLink(**d["intra_node"])
            inter = AxisLink(**d.get("inter_node", d["intra_node"]))
            num = d.get("num_devices")
            return cls(d.get("name", "custom"), dev, intra, inter, int(d.get("devices_per_node", 1 << 30)),
                       None if num is None else int(num))
        except (KeyError, TypeError) as exc:
            raise SolverError(f"{source}: not a cluster spec ({exc}); expected keys name, device, intra_node, "
                              "inter_node, devices_per_node as written by tools/calibrate.py") from None


_GIB = 1 << 30
#: Hardware presets. GPU numbers: dense bf16 peak at ~70% achievable, NVLink per-direction bus bandwidth,
#: one 400 Gb/s InfiniBand NIC per GPU, host link PCIe 4.0 x16 (A100, 25 GB/s achievable) or 5.0 x16
#: (H100/H200 SXM, 50 GB/s). "cpu-gloo" is the 2-core development machine with 4 gloo ranks
#: on loopback, rounded from tools/calibrate.py runs on a busy machine (alpha 0.7-0.85 ms, 0.12-0.28
#: GB/s, 28-38 GFLOP/s per single-threaded rank, 2.4-6 GB/s copies, also its "host link": the chunk
#: arena and host buffers are both RAM) with DTensor's per-op dispatch (tens of us) as the kernel
#: floor; run tools/calibrate.py to measure the machine you are on.
PRESETS: dict[str, HardwareSpec] = {
    "cpu-gloo": HardwareSpec("cpu-gloo", DeviceSpec("cpu", 24 * _GIB, 3.0e10, 4.0e9, 2e-5, all_to_all=False,
                                                    host_link_bandwidth_bytes_per_s=4.0e9),
                             AxisLink(5e-4, 2.5e8), AxisLink(5e-4, 2.5e8), 1 << 30),
    "a100": HardwareSpec("a100-80g-nvlink-ib", DeviceSpec("A100-80GB", 80 * _GIB, 220e12, 1.6e12, 5e-6,
                                                          host_link_bandwidth_bytes_per_s=25e9),
                         AxisLink(5e-6, 230e9), AxisLink(1e-5, 23e9), 8),
    "h100": HardwareSpec("h100-80g-nvlink-ib", DeviceSpec("H100-80GB", 80 * _GIB, 600e12, 2.6e12, 4e-6,
                                                          host_link_bandwidth_bytes_per_s=50e9),
                         AxisLink(4e-6, 360e9), AxisLink(1e-5, 45e9), 8),
    "h200": HardwareSpec("h200-141g-nvlink-ib", DeviceSpec("H200-141GB", 141 * _GIB, 600e12, 3.8e12, 4e-6,
                                                           host_link_bandwidth_bytes_per_s=50e9),
                         AxisLink(4e-6, 360e9), AxisLink(1e-5, 45e9), 8),
}


def parse_mesh(text: str) -> tuple[int, ...]:
    """'2x4' -> (2, 4); raises SolverError for anything else."""
    if not re.fullmatch(r"\s*\d+(\s*x\s*\d+){0,2}\s*", text or ""):
        raise SolverError(f"mesh {text!r} is not like 4, 2x4 or 2x2x2 (1 to 3 positive sizes joined by 'x')")
    shape = tuple(int(s) for s in text.lower().split("x"))
    if any(s < 1 for s in shape):
        raise SolverError(f"mesh {text!r} has a size below 1")
    return shape


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """('dp',), ('dp', 'tp'), ('pp', 'dp', 'tp')-style default names for a mesh of ndim axes."""
    return {1: ("dp",), 2: ("dp", "tp"), 3: ("a0", "dp", "tp")}[ndim]


def load_hardware(name_or_path: str | Path) -> HardwareSpec:
    """A preset by name or a spec JSON file; SolverError names the presets when neither fits."""
    text = str(name_or_path)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if not path.is_file():
        raise SolverError(f"cluster {text!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a spec file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SolverError(f"{path}: not a JSON cluster spec ({exc})") from None
    if not isinstance(data, dict):
        raise SolverError(f"{path}: not a JSON object")
    return HardwareSpec.from_dict(data, source=str(path))


def cluster_for_mesh(hardware: HardwareSpec | str, mesh_shape: tuple[int, ...],
                     axis_names: tuple[str, ...] | None = None) -> ClusterSpec:
    """Lay a mesh over the hardware (see module docstring) and return its ClusterSpec."""
    hw = load_hardware(hardware) if isinstance(hardware, (str, Path)) else hardware
    mesh_shape = tuple(int(s) for s in mesh_shape)
    world = math.prod(mesh_shape)
    if hw.num_devices is not None and (world > hw.num_devices or hw.num_devices % world):
        raise SolverError(f"mesh {'x'.join(map(str, mesh_shape))} has {world} devices, which does not divide the "
                          f"{hw.num_devices} devices of cluster {hw.name!r}")
    names = tuple(axis_names) if axis_names else default_axis_names(len(mesh_shape)) if 1 <= len(mesh_shape) <= 3 else ()
    links = []
    for i in range(len(mesh_shape)):
        span = math.prod(mesh_shape[i:])
        links.append(hw.intra_node if hw.devices_per_node % span == 0 or span <= 1 else hw.inter_node)
    return ClusterSpec(hw.name, mesh_shape, names, tuple(links), hw.device)


def save_hardware(spec: HardwareSpec, path: str | Path) -> Path:
    """Write a spec file (what tools/calibrate.py produces), atomically."""
    return write_atomic(path, json.dumps(spec.to_dict(), indent=1) + "\n")
