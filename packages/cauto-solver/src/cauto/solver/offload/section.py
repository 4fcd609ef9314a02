"""The plan's ``offload`` section, and what chunked state changes in the sharding section (model.py's
docstring has the model): chunked parameters are marked ``state: "chunked"``, the all-reduces over
the data-parallel axes D of their gradients give way to the chunk manager's all-gathers and
reduce-scatters, the host link traffic adds ``step_time_s.offload``, and a plan the runtime runs as
the model as written gets that execution."""

from __future__ import annotations

from cauto.plan import GraphDocument
from cauto.plan.execution import execution_section, simulated_device_budget_bytes
from cauto.solver.cost.reshard import collective_cost_s
from cauto.solver.document import OffloadSection
from cauto.solver.offload.model import GRAD_ITEMSIZE, PARAM_ITEMSIZE, OffloadModel, registration_order
from cauto.solver.strategies.node import Strategy


def offload_section(model: OffloadModel, sharding: dict, graph: GraphDocument,
                    chosen: dict[str, Strategy], program: bool = False) -> OffloadSection | None:
    """What ``model``'s chunks make of the sharding section ``sharding`` (written with the chunked memory
    model's predictions) for the strategies ``chosen``; None when no parameter is chunked. ``program``:
    the runtime runs it as a program even where the model as written could (checkpoint regions)."""
    params = [n for n in graph.nodes if n.kind == "param"]
    chunked = [n for n in registration_order(graph.nodes) if model.chunks(n, chosen[n.id])]
    if not chunked:
        return None
    ids = {n.id for n in chunked}
    by_id = {n.id: n for n in params}
    plan_params = {pid: {**entry, "state": "chunked"} if (by_id[pid].tied_to or pid) in ids else entry
                   for pid, entry in sharding["params"].items()}
    num_chunks = model.num_chunks(chunked, chosen)
    pred = sharding["predictions"]
    nonmodel = pred["peak_bytes"] - model.working_set_bytes
    arena = model.budget_bytes - nonmodel
    moved = model.traffic_bytes(num_chunks, arena)
    trainable = [n for n in params if not n.tied_to and n.requires_grad is not False]
    plain = model.pure and len(chunked) == len(trainable) and not sharding["edges"] and not program
    data_axes = set(model.mesh_axes)

    def kept(c: dict) -> bool:
        if c.get("phase") in ("grad_sync", "backward") and c.get("op") == "all_reduce" \
                and str(c.get("where", "")).split("->")[0] in ids and c.get("axis") in data_axes:
            return False  # the chunk manager's reduce-scatter over D replaces the gradient's all-reduce
        return not plain or c.get("where") == "loss"

    collectives = [c for c in pred["collectives"] if kept(c)]
    if plain:  # the model as written reduces its loss once, over the whole mesh (ChunkedParallelModule)
        loss = [c for c in collectives if c.get("where") == "loss"]
        if len(loss) > 1:
            axes = tuple(range(len(model.cluster.mesh_shape)))
            collectives = [c for c in collectives if c.get("where") != "loss"] + [
                _flattened(model, axes, "all_reduce", max(c["bytes"] for c in loss), loss[0]["phase"], "loss")]
    collectives += zero_collectives(model, num_chunks, len(chunked))
    communication_s = sum(c["cost_s"] for c in collectives)
    offload_s = moved / model.host_link_bandwidth_bytes_per_s
    times = pred["step_time_s"]
    step_time_s = {**times, "communication": communication_s, "offload": offload_s,
                   "total": times["compute"] + communication_s + offload_s}
    section = {
        "device_budget_bytes": model.budget_bytes, "chunk_elems": model.chunk_elems,
        "mesh_axes": list(model.mesh_axes), "num_chunks": num_chunks,
        "working_set_bytes": model.working_set_bytes, "arena_bytes": int(arena), "moved_bytes": int(moved),
        "host_link_bandwidth_bytes_per_s": model.host_link_bandwidth_bytes_per_s,
    }
    section["simulated_device_budget_bytes"] = simulated_device_budget_bytes(section, pred["peak_bytes"])
    return OffloadSection(
        offload=section, params=plan_params,
        grad_sync=[c for c in sharding.get("grad_sync", []) if kept(c)],
        # the chunk manager runs the model as written (no program, so no program gradient reductions)
        execution=execution_section(len(model.cluster.mesh_shape), section, sharding["edges"], collectives,
                                    program=program),
        predictions={**pred, "step_time_s": step_time_s, "collectives": collectives})


def offload_at_peak(model: OffloadModel, offload: dict, peak_bytes: int, pinned_bytes: int = 0) -> tuple[dict, float]:
    """The ``offload`` section of a plan whose predicted peak is ``peak_bytes`` (a checkpointed plan's,
    lower than its sharding's) and whose regions' recomputation pins ``pinned_bytes`` of parameter
    chunks (memory/walk.py, part of the working set then): the arena the runtime will size (budget
    minus the non-model peak) and the traffic with it; and that traffic's seconds (``step_time_s.offload``)."""
    working_set = model.working_set_bytes + int(pinned_bytes)
    arena = model.budget_bytes - (int(peak_bytes) - working_set)
    moved = model.traffic_bytes(int(offload["num_chunks"]), arena - int(pinned_bytes))  # pins hold arena too
    section = {**offload, "working_set_bytes": working_set, "arena_bytes": int(arena), "moved_bytes": int(moved)}
    section["simulated_device_budget_bytes"] = simulated_device_budget_bytes(section, int(peak_bytes))
    return section, moved / model.host_link_bandwidth_bytes_per_s


def _flattened(model: OffloadModel, axes: tuple[int, ...], op: str, nbytes: int, phase: str, where: str) -> dict:
    """One collective ``op`` of ``nbytes`` over the flattened group of the mesh axes ``axes`` (the ranks that
    differ only there): recorded on the first such axis of size > 1, priced as the α-β ring over the group's
    size on the slowest of those axes' links (the group spans them all), plus the kernel floor."""
    mesh = tuple(model.cluster.mesh_shape)
    big = [a for a in axes if mesh[a] > 1]
    n = 1
    for a in big:
        n *= mesh[a]
    links = [model.cluster.axes[a] for a in big]
    latency = max(a.latency_s for a in links)
    bandwidth = min(a.bandwidth_bytes_per_s for a in links)
    cost = model.cluster.device.kernel_floor_s + collective_cost_s(op, nbytes, n, latency, bandwidth)
    return {"op": op, "axis": big[0], "bytes": int(nbytes), "phase": phase, "where": where, "cost_s": cost}


def zero_collectives(model: OffloadModel, num_chunks: int, num_params: int) -> list[dict]:
    """The chunk manager's collectives over D (model.py's docstring): per chunk group an all-gather of
    the parameter chunks in forward and a reduce-scatter of the gradient chunks in backward, and the
    all-reduce of the gradient flags in the optimizer step. Each is one collective over the flattened
    group of D (the runtime's ZeRO process group), however many axes D spans."""
    if model.group_size <= 1:
        return []
    axes = tuple(model.mesh_axes)
    group_param_bytes = model.group_size * model.chunk_elems * PARAM_ITEMSIZE
    group_grad_bytes = model.group_size * model.chunk_elems * GRAD_ITEMSIZE
    out = []
    for g in range(num_chunks // model.group_size):
        where = f"chunk group {g}"
        out.append(_flattened(model, axes, "all_gather", group_param_bytes, "forward", where))
        out.append(_flattened(model, axes, "reduce_scatter", group_grad_bytes, "backward", where))
    out.append(_flattened(model, axes, "all_reduce", 4 * num_params, "optimizer", "chunked gradient flags"))
    return out
