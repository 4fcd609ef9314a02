"""The ``execution`` section of a plan (since 1.2): what the runtime runs, as the solver decided it.

The runtime reads these fields and derives nothing itself:

* ``execution.mode``: ``"program"`` (the captured graph rewritten for the plan: lowered to a local
  program, or the DTensor interpreter) or ``"chunk_manager"`` (the model as written, every trainable
  parameter in the chunk manager, ZeRO over the whole mesh: chunks over every mesh axis, no
  redistribution edges and no checkpoint regions; a plan with regions runs as a program);
* ``execution.grad_reductions``: the values (``"node:output"``) whose gradient the program reduces
  once, before their producer's backward (the backward collectives the plan lists as
  ``"grad of <value>"``);
* ``offload.simulated_device_budget_bytes``: the chunk manager's budget where the device is
  simulated by host memory (the CPU): ``device_budget_bytes`` capped at what the chunks could ever
  fill, ``2 · predicted peak + 20 · num_chunks · chunk_elems`` (every fp32 chunk list: parameter,
  gradient, reduced gradient, two Adam moments). A plan solved without a budget would otherwise hand
  the simulated device the whole memory of the modelled one.

* ``execution.mixed_precision`` (since 1.3, optional): ``{"compute_dtype": "bfloat16", "reduce_dtype":
  "float32" | "bfloat16"}``: the step runs under autocast to ``compute_dtype`` (the profile the plan was
  solved from ran under the same autocast, so its dtypes are the ones that run), parameters and optimizer
  state stay in their own dtype (fp32 masters), the parameters' gradients are reduced in ``reduce_dtype``.
  Absent: the step runs in the parameters' dtype, as in every plan before 1.3.
* ``execution.regather_params`` (since 1.4, optional, default false): every parameter the program
  gathers for use (stored sharded, consumed less sharded: ZeRO-3) is freed after its last forward use
  and gathered again in backward, just before the first backward op that reads it (FSDP's reshard
  after forward). One more all-gather per such parameter in backward (the plan's predicted
  collectives list them), for the gathered copies' bytes off the forward-to-backward peak.

Documents of 1.0 and 1.1 get the section on read (versioning's upgrader) by the same rules, which
live here and nowhere else.
"""

from __future__ import annotations

#: prefix of the ``where`` of a backward collective that reduces a value's gradient once
GRAD_OF = "grad of "
#: bytes per chunk element over every chunk list (param, grad, reduced grad, Adam m and v; fp32)
ALL_CHUNK_LISTS_BYTES_PER_ELEM = 20

MODES = ("program", "chunk_manager")
#: the planning options' short dtype names -> the plan's (torch's) dtype names
DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}


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


def mixed_precision_section(mixed_precision: str, reduce_dtype: str) -> dict | None:
    """``execution.mixed_precision`` for the planning options ``mixed_precision`` ("none" | "bf16") and
    ``reduce_dtype`` ("fp32" | "bf16"); None for "none" (module docstring)."""
    if mixed_precision == "none":
        return None
    return {"compute_dtype": DTYPE_NAMES[mixed_precision], "reduce_dtype": DTYPE_NAMES[reduce_dtype]}


def lowered_reduce_dtype(execution: dict | None) -> str | None:
    """The dtype name ("bfloat16") the plan reduces gradients in where mixed precision lowers it below the
    parameters' fp32 (``execution.mixed_precision.reduce_dtype``), else None."""
    mixed = (execution or {}).get("mixed_precision")
    if mixed is None or mixed["reduce_dtype"] == "float32":
        return None
    return mixed["reduce_dtype"]


def execution_section(mesh_ndim: int, offload: dict | None, edges: list, collectives: list[dict],
                      mixed_precision: dict | None = None, program: bool = False) -> dict:
    """The plan's ``execution`` section from its other sections (module docstring); ``program``: a
    program even where the chunk manager could run the model as written (checkpoint regions)."""
    mode = "chunk_manager" if not program and chunk_manager_runs(mesh_ndim, offload, edges) else "program"
    out = {"mode": mode, "grad_reductions": grad_reductions_of(collectives)}
    if mixed_precision is not None:
        out["mixed_precision"] = mixed_precision
    return out


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


__all__ = ["ALL_CHUNK_LISTS_BYTES_PER_ELEM", "DTYPE_NAMES", "GRAD_OF", "MODES", "mixed_precision_section", "add_execution", "chunk_manager_runs",
           "execution_section", "grad_reductions_of", "simulated_device_budget_bytes"]


def regathers_params(execution: dict | None) -> bool:
    """Whether the program gathers parameters again in backward (``execution.regather_params``; absent: no)."""
    return bool((execution or {}).get("regather_params", False))
