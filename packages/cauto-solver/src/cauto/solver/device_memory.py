"""A plan's memory per device, check point by check point: the timeline behind its predicted peak.

``MemoryModel.predict`` (memory.py) returns only the maximum over a training step; the plan stores
that maximum (``predictions.peak_bytes``) with its model state and activation parts. Given the
graph the plan was solved for, ``device_timeline(plan, graph)`` rebuilds the same memory model (the
strategies the plan names, calibrated on the graph's unsharded memory section exactly as ``solve``
does) and keeps every check point of that walk, in step order:

* ``forward``, per op: state + bytes saved so far + the op's transient bytes;
* ``backward``, per op in reverse: state + everything saved + what that op's backward adds
  (``backward_extra_bytes``; the model keeps all saved bytes until the end of backward);
* ``grad_sync``: state + gradients as autograd leaves them + synchronized copies;
* ``optimizer``: state + stored gradients + the optimizer step's temporaries.

Its maximum is ``predict``'s peak, so for a plan without checkpoint regions it equals
``predictions.peak_bytes`` (a plan with regions predicts model state + the simulated activation
peak of its schedule instead; the timeline then shows the step without recomputation). A plan
with chunked state (an ``offload`` section) is walked with offload.py's memory model: chunked
parameters hold nothing but the chunk working set, which is always live.
The walk mirrors ``MemoryModel.breakdown``; the tests hold the two to the same peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cauto.plan import GraphDocument, check_document, check_plan_matches_graph, split_ref
from cauto.plan.errors import DocumentError
from cauto.solver.errors import SolverError
from cauto.solver.groups import enumerate_strategies
from cauto.solver.memory import MemoryModel, redistributed_saves
from cauto.solver.strategies import Strategy

PHASES = ("forward", "backward", "grad_sync", "optimizer")


@dataclass
class DeviceTimeline:
    """Predicted live bytes on one device at each check point of a training step."""

    points: list[tuple[str, str | None, int]]
    """(phase, node id or None, live bytes per device), in step order."""
    state_bytes: int
    """Always-live bytes per device: parameter shards, optimizer state, inputs, buffers."""
    checkpointed: bool = False
    """The plan recomputes checkpoint regions, which this timeline does not model."""

    @property
    def peak_bytes(self) -> int:
        """The highest check point (``MemoryModel.predict``'s peak)."""
        return max((b for _, _, b in self.points), default=self.state_bytes)

    def phase_peaks(self) -> dict[str, int]:
        """phase -> its highest check point, for the phases the step has."""
        peaks: dict[str, int] = {}
        for phase, _, live in self.points:
            peaks[phase] = max(peaks.get(phase, 0), live)
        return peaks


def _graph(graph: GraphDocument | Mapping) -> GraphDocument:
    if isinstance(graph, GraphDocument):
        return graph
    try:
        return GraphDocument.from_dict(check_document(dict(graph), "graph"))
    except DocumentError as exc:
        raise SolverError(f"invalid graph document: {exc}") from None


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
    g = _graph(graph)
    check_plan_matches_graph(dict(plan), g)
    mesh = tuple(plan["mesh"]["shape"])
    train = bool(g.settings.get("train", True))
    strategies = enumerate_strategies(g, mesh, tuple(plan["mesh"]["axis_names"]))
    memory = MemoryModel(mesh, g.settings.get("optimizer", "adamw"), train)
    nodes = [n for n in g.nodes if n.kind != "output"]
    memory.calibrate(nodes, {n.id: strategies[n.id][0] for n in nodes}, int(g.memory.get("peak_bytes", 0)), g.memory)
    chosen = plan_strategies(plan, g, strategies)
    offload = plan.get("offload")
    if offload and any(p.get("state") == "chunked" for p in plan["params"].values()):
        from cauto.solver.memory import numel
        from cauto.solver.offload import OffloadModel

        numels = [numel(n) for n in nodes if n.kind == "param" and not n.tied_to and n.requires_grad is not False]
        chunks = OffloadModel(None, int(offload["device_budget_bytes"]), int(offload["chunk_elems"]),
                              max(numels, default=0))  # the working set needs no cluster
        memory = chunks.memory_model(memory)
    return _walk(memory, nodes, chosen, bool((plan.get("checkpoint") or {}).get("regions")))


def _walk(memory: MemoryModel, nodes: list, chosen: dict[str, Strategy], checkpointed: bool) -> DeviceTimeline:
    """MemoryModel.breakdown(exact=True), keeping every check point."""
    by_id = {n.id: n for n in nodes}

    def owner_pl(src, o: int = 0):
        if src.kind == "param" and src.tied_to:
            return chosen[src.tied_to].outputs[0]
        return chosen[src.id].outputs[o]

    state = memory.predict(nodes, chosen)[1]  # always-live bytes, as the model (or a subclass) counts them
    ops = [n for n in nodes if n.kind == "op" and n.id in chosen]
    moved, direct = redistributed_saves(nodes, chosen)
    points: list[tuple[str, str | None, int]] = []
    cum = 0
    for n in ops:
        s = chosen[n.id]
        cum += memory._saved_moved(n, s, moved, direct)
        for k, ref in enumerate(n.inputs):
            src = by_id.get(split_ref(ref)[0])
            if src is not None and src.kind == "param" and k < len(s.inputs):
                cum += memory.gathered_bytes(n, src, owner_pl(src), s.inputs[k])
        points.append(("forward", n.id, state + cum + memory.transient_bytes(n, s)))
    if memory.train and ops:
        points += [("backward", n.id, state + cum + memory.backward_extra_bytes(n, chosen[n.id]))
                   for n in reversed(ops)]
        computed, stored_all, synced = memory._gradients(nodes, chosen, by_id)
        points.append(("grad_sync", None, state + computed + synced))
        points.append(("optimizer", None, state + stored_all + memory._optimizer_extra(nodes, chosen)))
    return DeviceTimeline(points, state, checkpointed)
