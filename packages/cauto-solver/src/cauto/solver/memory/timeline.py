"""A plan's memory per device, check point by check point: the timeline behind its predicted peak.

The plan stores the maximum over a training step (``predictions.peak_bytes``) with its model state
and activation parts. Given the graph the plan was solved for, ``device_timeline(plan, graph)``
rebuilds the same memory model (the strategies the plan names, calibrated on the graph's unsharded
memory section exactly as ``solve`` does) and keeps every check point of the walk that gave that
peak (walk.py ``predicted_points``, with the plan's checkpoint regions), in step order:
``forward`` per op, ``backward`` per op in reverse (a second point for an op whose input came
through a redistribution: that redistribution's backward), ``grad_sync``, ``optimizer``.

Its maximum equals ``predictions.peak_bytes``. A plan with chunked state (an ``offload`` section)
is walked with offload/memory.py's model over the plan's data-parallel axes ``offload.mesh_axes``
(every axis when absent): chunked parameters hold nothing but the chunk working set, which is
always live.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cauto.plan import GraphDocument, check_plan_matches_graph
from cauto.plan.execution import regathers_params
from cauto.solver.errors import SolverError
from cauto.solver.inputs import graph_document
from cauto.solver.memory.model import MemoryModel
from cauto.solver.memory.walk import (
    plan_all_to_all,
    predicted_peak_bytes,
    predicted_points,
    recompute_pinned_bytes,
)
from cauto.solver.offload.memory import chunked_memory_model
from cauto.solver.offload.model import OffloadModel
from cauto.solver.strategies.groups import enumerate_strategies
from cauto.solver.strategies.node import Strategy

PHASES = ("forward", "backward", "grad_sync", "optimizer")


@dataclass
class DeviceTimeline:
    """Predicted live bytes on one device at each check point of a training step."""

    points: list[tuple[str, str | None, int]]
    """(phase, node id or None, live bytes per device), in step order."""
    state_bytes: int
    """Always-live bytes per device: parameter shards, optimizer state, inputs, buffers."""
    checkpointed: bool = False
    """The plan recomputes checkpoint regions (the walk follows them)."""
    pinned_bytes: int = 0
    """With chunked state and regions: the parameter chunks recomputation pins, reserved beside the
    working set (walk.py; part of ``state_bytes``)."""

    @property
    def peak_bytes(self) -> int:
        """The highest check point (the plan's ``predictions.peak_bytes``)."""
        return max((b for _, _, b in self.points), default=self.state_bytes)

    def phase_peaks(self) -> dict[str, int]:
        """phase -> its highest check point, for the phases the step has."""
        peaks: dict[str, int] = {}
        for phase, _, live in self.points:
            peaks[phase] = max(peaks.get(phase, 0), live)
        return peaks


def plan_strategies(plan: Mapping, graph: GraphDocument, strategies: Mapping[str, list[Strategy]]) -> dict[str, Strategy]:
    """node id -> the Strategy the plan chose (matched by name and placements among the node's strategies)."""
    chosen: dict[str, Strategy] = {}
    for node_id, entry in plan["nodes"].items():
        options = strategies.get(node_id, [])
        want = (entry["name"], tuple(map(tuple, entry["inputs"])), tuple(map(tuple, entry["outputs"])))
        match = next((s for s in options if (s.name, s.inputs, s.outputs) == want), None)
        if match is None:
            node = graph.node_map().get(node_id)
            if node is not None and node.tied_to:
                continue  # a tied parameter reads its owner's placement
            raise SolverError(f"the plan's strategy {entry['name']!r} of node {node_id!r} is not one this solver "
                              "generates for the graph: solve the plan again")
        chosen[node_id] = match
    for n in graph.nodes:
        if n.tied_to and n.id in plan["nodes"] and n.id not in chosen and n.tied_to in chosen:
            chosen[n.id] = chosen[n.tied_to]
    return chosen


def device_timeline(plan: Mapping, graph: GraphDocument | Mapping) -> DeviceTimeline:
    """The plan's predicted memory per device over one training step (module docstring).

    Raises SolverError (or cauto.plan's MismatchError) when the plan was not solved for ``graph``."""
    g = graph_document(graph)
    check_plan_matches_graph(dict(plan), g)
    mesh = tuple(plan["mesh"]["shape"])
    train = bool(g.settings.get("train", True))
    strategies = enumerate_strategies(g, mesh, tuple(plan["mesh"]["axis_names"]))
    memory = MemoryModel(mesh, g.settings.get("optimizer", "adamw"), train, plan_all_to_all(plan))
    nodes = [n for n in g.nodes if n.kind != "output"]
    memory.calibrate(nodes, {n.id: strategies[n.id][0] for n in nodes}, int(g.memory.get("peak_bytes", 0)), g.memory)
    chosen = plan_strategies(plan, g, strategies)
    memory.regather = regathers_params(plan.get("execution"))
    memory = with_plan_chunks(plan, nodes, memory)
    return _walk(memory, nodes, chosen, list((plan.get("checkpoint") or {}).get("regions") or []))


def with_plan_chunks(plan: Mapping, nodes: list, memory: MemoryModel) -> MemoryModel:
    """``memory``, or for a plan with chunked state offload/memory.py's model of its chunks."""
    offload = plan.get("offload")
    if not offload or not any(p.get("state") == "chunked" for p in plan["params"].values()):
        return memory
    axes = offload.get("mesh_axes")  # the data-parallel axes D the chunks are ZeRO-sharded over
    chunks = OffloadModel(None, int(offload["device_budget_bytes"]), int(offload["chunk_elems"]),
                          None if axes is None else tuple(axes))  # needs no cluster
    return chunked_memory_model(memory, chunks)


def _walk(memory: MemoryModel, nodes: list, chosen: dict[str, Strategy], regions: list) -> DeviceTimeline:
    points = predicted_points(memory, nodes, chosen, regions)
    pinned = recompute_pinned_bytes(memory, nodes, chosen, regions)
    return DeviceTimeline(points, memory.predict(nodes, chosen)[1] + pinned, bool(regions), pinned)


def device_peak_judge(graph_doc: dict):
    """``(sharding plan document, regions) -> peak bytes per device`` for plans of ``graph_doc``:
    the strategies each plan names, on the memory model calibrated as ``solve`` calibrates it (with a
    plan's chunked state, ``with_plan_chunks``)."""
    g = graph_document(graph_doc)
    nodes = [n for n in g.nodes if n.kind != "output"]
    train = bool(g.settings.get("train", True))
    models: dict[tuple, tuple] = {}

    def judge(plan_doc: dict, regions: list) -> int:
        if not regions:  # nothing recomputed: the plan's own (calibrated) prediction
            return int(plan_doc["predictions"]["peak_bytes"])
        key = (tuple(plan_doc["mesh"]["shape"]), tuple(plan_doc["mesh"]["axis_names"]))
        if key not in models:
            strategies = enumerate_strategies(g, key[0], key[1])
            memory = MemoryModel(key[0], g.settings.get("optimizer", "adamw"), train, plan_all_to_all(plan_doc))
            memory.calibrate(nodes, {n.id: strategies[n.id][0] for n in nodes}, int(g.memory.get("peak_bytes", 0)),
                             g.memory)
            models[key] = (strategies, memory)
        strategies, memory = models[key]
        memory.regather = regathers_params(plan_doc.get("execution"))
        chosen = plan_strategies(plan_doc, g, strategies)
        return predicted_peak_bytes(with_plan_chunks(plan_doc, nodes, memory), nodes, chosen, regions)

    return judge
