"""Dataclasses for the two cauto documents, for Python users who prefer attributes to dicts.

``GraphDocument.from_dict(d).to_dict() == d`` for any valid document (fields left unset are omitted).
The JSON Schema files in ``schemas/`` are the contract; these classes mirror them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cauto.plan.execution import add_execution
from cauto.plan.versioning import CURRENT_VERSION, format_version


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype name (e.g. "float32") and size in bytes of one tensor."""

    shape: tuple[int, ...]
    dtype: str
    bytes: int

    @classmethod
    def from_dict(cls, d: dict) -> TensorMeta:
        return cls(shape=tuple(d["shape"]), dtype=d["dtype"], bytes=d["bytes"])

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes}


@dataclass(frozen=True)
class Labels:
    """Einsum-like sharding labels of a node (see graph.schema.json, $defs/labels)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    reduce: str | None = None
    whole: str = ""
    rule: str | None = None

    @classmethod
    def from_dict(cls, d: dict) -> Labels:
        return cls(tuple(d["inputs"]), tuple(d["outputs"]), d.get("reduce"), d.get("whole", ""), d.get("rule"))

    def to_dict(self) -> dict:
        out = {"inputs": list(self.inputs), "outputs": list(self.outputs)}
        if self.reduce is not None:
            out["reduce"] = self.reduce
        if self.whole:
            out["whole"] = self.whole
        if self.rule is not None:
            out["rule"] = self.rule
        return out

    def contracted(self) -> str:
        """Letters that appear in inputs but in no output (splitting one yields Partial outputs)."""
        out_letters = set("".join(self.outputs))
        seen: list[str] = []
        for spec in self.inputs:
            for ch in spec:
                if ch != "." and ch not in out_letters and ch not in seen:
                    seen.append(ch)
        return "".join(seen)


_NODE_NUMBERS = ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "fwd_time_s", "bwd_time_s",
                 "saved_bytes", "transient_bytes")


@dataclass
class GraphNode:
    """One value-producing node of the captured forward graph, with its costs and labels."""

    id: str
    kind: str
    op: str
    module: str
    inputs: list[str]
    outputs: list[TensorMeta]
    target: str | None = None
    tied_to: str | None = None
    requires_grad: bool | None = None
    #: in-kernel scratch of the node's backward, not shrunk by a sharding (graph 1.1; None: none measured)
    bwd_workspace_bytes: int | None = None
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    fwd_time_s: float = 0.0
    bwd_time_s: float = 0.0
    saved_bytes: int = 0
    transient_bytes: int = 0
    params: list[str] = field(default_factory=list)
    labels: Labels | None = None
    layer: str | None = None
    layer_index: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> GraphNode:
        kw = dict(d)
        kw["outputs"] = [TensorMeta.from_dict(o) for o in d["outputs"]]
        kw["inputs"] = list(d["inputs"])
        if d.get("labels") is not None:
            kw["labels"] = Labels.from_dict(d["labels"])
        kw["params"] = list(d.get("params", []))
        return cls(**kw)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {
            "id": self.id, "kind": self.kind, "op": self.op, "module": self.module,
            "inputs": list(self.inputs), "outputs": [o.to_dict() for o in self.outputs],
        }
        for name in ("target", "tied_to", "requires_grad", "bwd_workspace_bytes"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        for name in _NODE_NUMBERS:
            out[name] = getattr(self, name)
        out["params"] = list(self.params)
        if self.labels is not None:
            out["labels"] = self.labels.to_dict()
        out["layer"] = self.layer
        out["layer_index"] = self.layer_index
        return out


def split_ref(ref: str) -> tuple[str, int]:
    """Split an input reference "node#k" into ("node", k); "node" alone means output 0."""
    node, _, index = ref.partition("#")
    return node, int(index) if index else 0


@dataclass
class GraphDocument:
    """The profiled graph: what the solver needs to plan, nothing torch-specific."""

    fingerprint: str
    model: dict
    settings: dict
    device: dict
    nodes: list[GraphNode]
    memory: dict
    schema_version: str = format_version(CURRENT_VERSION["graph"])
    kind: str = "graph"

    @classmethod
    def from_dict(cls, d: dict) -> GraphDocument:
        return cls(
            fingerprint=d["fingerprint"], model=dict(d["model"]), settings=dict(d["settings"]),
            device=dict(d["device"]), nodes=[GraphNode.from_dict(n) for n in d["nodes"]],
            memory=dict(d["memory"]), schema_version=d["schema_version"], kind=d["kind"],
        )

    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version, "kind": self.kind, "fingerprint": self.fingerprint,
            "model": self.model, "settings": self.settings, "device": self.device,
            "nodes": [n.to_dict() for n in self.nodes], "memory": self.memory,
        }

    def node_map(self) -> dict[str, GraphNode]:
        """Return the nodes keyed by id."""
        return {n.id: n for n in self.nodes}


@dataclass
class PlanDocument:
    """A parallel plan; nested objects stay plain dicts shaped as plan.schema.json says."""

    graph_fingerprint: str
    mesh: dict
    cluster: dict
    nodes: dict[str, dict]
    params: dict[str, dict]
    edges: list[dict]
    predictions: dict
    solver: dict
    grad_sync: list[dict] | None = None
    checkpoint: dict | None = None
    offload: dict | None = None
    execution: dict | None = None
    schema_version: str = format_version(CURRENT_VERSION["plan"])
    kind: str = "plan"

    @classmethod
    def from_dict(cls, d: dict) -> PlanDocument:
        """The plan of ``d``; a plan written without ``execution`` gets it by the rules of
        ``cauto.plan.execution`` (the section is optional in the schema)."""
        d = add_execution(d)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        order = ["schema_version", "kind", "graph_fingerprint", "mesh", "cluster", "nodes", "params",
                 "edges", "grad_sync", "checkpoint", "offload", "execution", "predictions", "solver"]
        return _drop_none({k: getattr(self, k) for k in order})
