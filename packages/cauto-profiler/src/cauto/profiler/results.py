"""What ``profile()`` returns: a ``Profile`` of the training step, with one ``NodeStats`` per graph node."""

from __future__ import annotations

from dataclasses import dataclass, field

from cauto.profiler.capture import Capture
from cauto.profiler.devices import DeviceModel, get_device_model


@dataclass
class NodeStats:
    """Per-graph-node costs (forward from step 1, backward from step 1)."""

    id: str
    op: str
    module: str
    output_bytes: int = 0
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    fwd_kernels: list = field(default_factory=list)  #: (flops, bytes, dtype) per kernel
    bwd_kernels: list = field(default_factory=list)
    fwd_time_s: float = 0.0
    bwd_time_s: float = 0.0
    saved_bytes: int = 0
    transient_bytes: int = 0
    bwd_workspace_bytes: int = 0  #: in-kernel scratch of its backward (tracker.bwd_workspace)
    allocated_bytes: int = 0  #: bytes allocated while this node ran (all phases, all steps)

    def row(self) -> dict:
        return {k: getattr(self, k) for k in ("id", "op", "module", "output_bytes", "fwd_flops", "bwd_flops",
                                               "fwd_bytes", "bwd_bytes", "fwd_time_s", "bwd_time_s",
                                               "saved_bytes", "transient_bytes")}


@dataclass
class Profile:
    """What ``profile()`` found. Bytes are per device; FLOPs are per training step (fwd + bwd)."""

    name: str
    capture: Capture
    settings: dict
    device_model: DeviceModel
    peak_bytes: int
    baseline_bytes: int
    phases: dict[str, int]
    phase_steps: dict[str, int]
    nodes: dict[str, NodeStats]
    timeline: list[tuple[int, str, str | None, int]]
    modelled_effects: list[str]
    peak_event: tuple[int, str, str | None, int] | None = None
    #: the peak of cauto's runtime program (the captured graph, every value freed at its last use: what
    #: plans predict and the solver calibrates on); ``peak_bytes`` is the user's eager step, where the
    #: model's Python may keep values longer (None: the same as ``peak_bytes``)
    program_peak_bytes: int | None = None
    program_peak_event: tuple[int, str, str | None, int] | None = None
    #: the program's peak per phase (``phases`` are the eager step's); ``timeline`` and ``nodes`` are the program's
    program_phases: dict[str, int] | None = None
    program_phase_steps: dict[str, int] | None = None

    def __post_init__(self):
        if self.program_peak_bytes is None:
            self.program_peak_bytes = self.peak_bytes
            self.program_peak_event = self.peak_event
        if self.program_phases is None:
            self.program_phases = dict(self.phases)
        if self.program_phase_steps is None:
            self.program_phase_steps = dict(self.phase_steps)

    @property
    def peaks_differ_because(self) -> str | None:
        """One line on why the eager peak and the program's peak differ, or None when they do not."""
        if self.program_peak_bytes == self.peak_bytes:
            return None
        where = f" at node {self.peak_event[2]} ({self.peak_event[1]})" if self.peak_event else ""
        return (f"the model's Python keeps tensors past their last use (a local read late, a cache object), "
                f"{self.peak_bytes - self.program_peak_bytes:+d} bytes at the eager peak{where}; "
                f"cauto's program frees each at its last use")

    @property
    def flops(self) -> float:
        """Total forward + backward FLOPs of one step."""
        return sum(n.fwd_flops + n.bwd_flops for n in self.nodes.values())

    @property
    def time_s(self) -> float:
        """Roofline estimate of one step's forward + backward compute time on the device model."""
        return sum(n.fwd_time_s + n.bwd_time_s for n in self.nodes.values())

    def node_table(self) -> list[dict]:
        """One row per graph node, in execution order."""
        return [n.row() for n in self.nodes.values()]

    def module_table(self, depth: int | None = None) -> list[dict]:
        """Roll-up per module path prefix (every prefix of every node's module path, '' = whole model).

        With ``depth``, only prefixes of at most that many dotted components.
        """
        rows: dict[str, dict] = {}
        for n in self.nodes.values():
            parts = n.module.split(".") if n.module else []
            prefixes = [""] + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            for p in prefixes:
                if depth is not None and p and p.count(".") + 1 > depth:
                    continue
                r = rows.setdefault(p, {"module": p, "nodes": 0, "fwd_flops": 0.0, "bwd_flops": 0.0,
                                        "saved_bytes": 0, "output_bytes": 0, "time_s": 0.0})
                r["nodes"] += 1
                r["fwd_flops"] += n.fwd_flops
                r["bwd_flops"] += n.bwd_flops
                r["saved_bytes"] += n.saved_bytes
                r["output_bytes"] += n.output_bytes
                r["time_s"] += n.fwd_time_s + n.bwd_time_s
        return sorted(rows.values(), key=lambda r: r["module"])

    def summary(self) -> dict:
        """A JSON-able summary (what ``cauto-profile --json`` prints)."""
        return {"name": self.name, "settings": self.settings, "device": self.device_model.to_dict(),
                "peak_bytes": self.peak_bytes, "program_peak_bytes": self.program_peak_bytes,
                "baseline_bytes": self.baseline_bytes, "phases": self.phases,
                "phase_steps": self.phase_steps, "flops": self.flops, "time_s": self.time_s,
                "num_nodes": len(self.nodes), "peak_event": list(self.peak_event) if self.peak_event else None,
                "modelled_effects": self.modelled_effects}

    def retime(self, device_model: DeviceModel | str) -> None:
        """Recompute per-node times for another device model (FLOPs and bytes stay)."""
        dm = get_device_model(device_model, self.settings["device"])
        self.device_model = dm
        for n in self.nodes.values():
            n.fwd_time_s = sum(dm.time(f, b, d) for f, b, d in n.fwd_kernels)
            n.bwd_time_s = sum(dm.time(f, b, d) for f, b, d in n.bwd_kernels)

    def to_graph(self, max_timeline: int = 2000) -> dict:
        """The cauto-plan graph document of this profile (validated by cauto.plan.check_document)."""
        from cauto.profiler.graphdoc import build_graph_document

        return build_graph_document(self, max_timeline=max_timeline)

