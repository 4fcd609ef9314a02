"""The ``execution`` section of a plan (since 1.2): what the runtime runs, as the solver decided it.

The runtime reads these fields and derives nothing itself:

* ``execution.mode``: ``"program"`` (the captured graph rewritten for the plan: lowered to a local
  program, or the DTensor interpreter) or ``"chunk_manager"`` (the model as written, every trainable
  parameter in the chunk manager, ZeRO over the whole mesh: chunks over every mesh axis and no
  redistribution edges);
* ``execution.grad_reductions``: the values (``"node:output"``) whose gradient the program reduces
  once, before their producer's backward (the backward collectives the plan lists as
  ``"grad of <value>"``);
* ``offload.simulated_device_budget_bytes``: the chunk manager's budget where the device is
  simulated by host memory (the CPU): ``device_budget_bytes`` capped at what the chunks could ever
  fill, ``2 · predicted peak + 20 · num_chunks · chunk_elems`` (every fp32 chunk list: parameter,
  gradient, reduced gradient, two Adam moments). A plan solved without a budget would otherwise hand
  the simulated device the whole memory of the modelled one.

Documents of 1.0 and 1.1 get the section on read (versioning's upgrader) by the same rules, which
live here and nowhere else.
"""

from __future__ import annotations

#: prefix of the ``where`` of a backward collective that reduces a value's gradient once
GRAD_OF = "grad of "
#: bytes per chunk element over every chunk list (param, grad, reduced grad, Adam m and v; fp32)
ALL_CHUNK_LISTS_BYTES_PER_ELEM = 20

MODES = ("program", "chunk_manager")


def grad_reductions_of(collectives: list[dict]) -> list[str]:
    """The values whose gradient a plan with these predicted collectives reduces once, sorted."""
    return sorted({str(c["where"])[len(GRAD_OF):] for c in collectives
                   if c.get("phase") == "backward" and str(c.get("where", "")).startswith(GRAD_OF)})


def chunk_manager_runs(mesh_ndim: int, offload: dict | None, edges: list) -> bool:
    """Whether the chunk manager runs the model as written: chunks ZeRO-sharded over every mesh axis
    and no redistribution edges (anything else runs as a program)."""
    if not offload:
        return False
    axes = sorted(offload.get("mesh_axes", range(mesh_ndim)))
    return axes == list(range(mesh_ndim)) and not edges


def simulated_device_budget_bytes(offload: dict, peak_bytes: int) -> int:
    """The chunk manager's budget on a simulated device (module docstring)."""
    budget = int(offload["device_budget_bytes"])
    num_chunks = int(offload.get("num_chunks", 0))
    if not num_chunks:
        return budget
    cap = 2 * int(peak_bytes) + ALL_CHUNK_LISTS_BYTES_PER_ELEM * num_chunks * int(offload["chunk_elems"])
    return min(budget, cap)


def execution_section(mesh_ndim: int, offload: dict | None, edges: list, collectives: list[dict]) -> dict:
    """The plan's ``execution`` section from its other sections (module docstring)."""
    mode = "chunk_manager" if chunk_manager_runs(mesh_ndim, offload, edges) else "program"
    return {"mode": mode, "grad_reductions": grad_reductions_of(collectives)}


def add_execution(doc: dict) -> dict:
    """Return ``doc`` (a plan dict of 1.0 or 1.1) with ``execution`` and, where it has chunks,
    ``offload.simulated_device_budget_bytes`` (the 1.1 -> 1.2 upgrade)."""
    doc = dict(doc)
    pred = doc.get("predictions", {})
    offload = doc.get("offload")
    if offload is not None and "simulated_device_budget_bytes" not in offload:
        doc["offload"] = {**offload, "simulated_device_budget_bytes":
                          simulated_device_budget_bytes(offload, pred.get("peak_bytes", 0))}
    if "execution" not in doc:
        doc["execution"] = execution_section(len(doc.get("mesh", {}).get("shape", [])), offload,
                                             doc.get("edges", []), pred.get("collectives", []))
    return doc


__all__ = ["ALL_CHUNK_LISTS_BYTES_PER_ELEM", "GRAD_OF", "MODES", "add_execution", "chunk_manager_runs",
           "execution_section", "grad_reductions_of", "simulated_device_budget_bytes"]
