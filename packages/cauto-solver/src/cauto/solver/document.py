"""The plan document, assembled once from the sections the stages of a plan return.

Each stage returns its own part and none of them edits a plan after it is made:

* the sharding solve (solve.py): the *sharding section*, every key of a plan that the chosen
  strategies decide (``schema_version`` .. ``predictions``, sharding_section.py) and ``solver``. A
  plan with no other section is exactly it, so a sharding-only plan (what ``solve`` returns, what
  the joint search is handed) serves as the sharding section of a larger one;
* the offload model (offload/section.py), with chunked state: the ``offload`` section and the
  sharding section's ``params``, ``grad_sync``, ``execution`` and ``predictions`` as chunks change
  them (chunked parameters, the chunk manager's collectives in place of the gradients' all-reduces
  over D, ``step_time_s.offload``);
* the checkpoint search (joint.py ``checkpointed``): the ``checkpoint`` section and, where it
  recomputes, the predictions with recomputation (None: the sharding's stand);
* planning.py: ``execution.mixed_precision`` and ``options`` (what the user asked for).

``plan_document`` writes them in that order, the keys of the sharding section first and in place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadSection:
    """What chunked state makes of a sharding section (offload/section.py)."""

    offload: dict
    """The plan's ``offload`` section."""
    params: dict
    """``params`` with chunked parameters marked ``state: "chunked"``."""
    grad_sync: list
    """``grad_sync`` without the all-reduces over D the chunk manager's reduce-scatter replaces."""
    execution: dict
    """``execution`` as the runtime runs chunked state."""
    predictions: dict
    """``predictions`` with the chunk manager's collectives and ``step_time_s.offload``."""


@dataclass(frozen=True)
class CheckpointSection:
    """What the checkpoint search adds to a sharding (joint.py)."""

    checkpoint: dict
    """The plan's ``checkpoint`` section."""
    predictions: dict | None = None
    """The predictions with recomputation; None where nothing is recomputed (the sharding's stand)."""


@dataclass(frozen=True)
class PlanSections:
    """The sections of one plan, each from the stage that made it (module docstring)."""

    sharding: dict
    offload: OffloadSection | None = None
    checkpoint: CheckpointSection | None = None

    @property
    def predictions(self) -> dict:
        """The predictions the plan will carry: the last stage's that has any."""
        if self.checkpoint is not None and self.checkpoint.predictions is not None:
            return self.checkpoint.predictions
        if self.offload is not None:
            return self.offload.predictions
        return self.sharding["predictions"]


def plan_document(sections: PlanSections, *, mixed_precision: dict | None = None,
                  options: dict | None = None) -> dict:
    """The plan document of ``sections`` with planning's ``execution.mixed_precision`` and ``options``
    when given (module docstring); a new dict that shares the sections' values."""
    doc = {key: value for key, value in sections.sharding.items() if key != "solver"}
    if sections.offload is not None:
        doc.update(params=sections.offload.params, grad_sync=sections.offload.grad_sync,
                   execution=sections.offload.execution)
        doc["offload"] = sections.offload.offload
    doc["predictions"] = sections.predictions
    doc["solver"] = sections.sharding["solver"]
    if sections.checkpoint is not None:
        doc["checkpoint"] = sections.checkpoint.checkpoint
    if mixed_precision is not None:
        doc["execution"] = {**doc["execution"], "mixed_precision": mixed_precision}
    if options is not None:
        doc["options"] = options
    return doc
