"""PlanOptions: everything planning takes besides the graph and the cluster, in one checked value.

The API (``cauto.api.autoparallelize`` / ``plan_for``), the ``cauto-solve`` command and the solver's
entry (``cauto.solver.plan``) all take it whole. It is torch-free and frozen: build it once, where
the user's choices come in; ``dataclasses.replace`` derives a variant.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Literal, get_args

Checkpoint = Literal["none", "auto", "rotor", "chen"]
Offload = Literal["none", "auto", "chunked"]
Solver = Literal["cbc", "highs"]
MixedPrecision = Literal["none", "bf16"]
ReduceDtype = Literal["fp32", "bf16"]
CHECKPOINT_METHODS: tuple[str, ...] = get_args(Checkpoint)
OFFLOAD_MODES: tuple[str, ...] = get_args(Offload)
SOLVERS: tuple[str, ...] = get_args(Solver)
MIXED_PRECISIONS: tuple[str, ...] = get_args(MixedPrecision)
REDUCE_DTYPES: tuple[str, ...] = get_args(ReduceDtype)


class OptionsError(ValueError):
    """A planning option out of range; the message names the option and what it may be."""


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """The choices of one planning run (each field below)."""

    memory_budget_bytes: int | None = None
    """Bytes per device that model state and activations must fit in; None: the device's memory
    (resolved by the solver from the cluster, in one place: ``cauto.solver.planning.budget_bytes``)."""
    checkpoint: Checkpoint = "none"
    """Activation checkpointing: "none" (every activation stored), or solved jointly with the sharding:
    "auto" (rotor or Chen, whichever is faster, or none), "rotor", "chen"."""
    offload: Offload = "none"
    """Model state in chunks moved between device and host: "none"; "auto" (only where no device-only
    plan fits); "chunked" (always). With ``checkpoint`` other than "none" the chunked plans are searched
    jointly with checkpoint regions too: all three levers in one plan (cauto.solver.planning)."""
    offload_axes: tuple[int, ...] | None = None
    """The mesh axes chunked state is ZeRO-sharded over, the others left to tensor parallelism; None:
    every axis and each axis alone are tried, the fastest plan wins. Needs ``offload``."""
    mixed_precision: MixedPrecision = "none"
    """"none" (train in the parameters' dtype) or "bf16": the step runs under bf16 autocast over fp32 master
    parameters and optimizer state, profiled and planned under the same autocast (plan
    ``execution.mixed_precision``). "fp16" is refused: it needs loss scaling, which cauto does not do."""
    reduce_dtype: ReduceDtype = "fp32"
    """dtype of the parameters' gradient reductions under mixed precision: "fp32" (as FSDP2's
    ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``); "bf16": half the bytes, each gradient bucket
    (and each gathered parameter's reduce-scatter) cast to bf16 before the collective and back to fp32
    after it, as FSDP2's ``reduce_dtype=torch.bfloat16``. Needs mixed_precision."""
    regather: bool = False
    """Where no plan that keeps its gathered parameter copies from forward to backward fits the budget,
    also search plans that gather them again in backward (plan ``execution.regather_params``, FSDP's
    reshard after forward): one more all-gather per such parameter, for the copies' bytes. Off by default:
    the second search doubles the planning time of a budget nothing keeping its copies fits."""
    solver: Solver = "cbc"
    """The ILP solver: "cbc" or "highs"."""
    time_limit_s: float = 60.0
    """Wall-clock limit of each ILP solve, seconds."""

    def __post_init__(self):
        budget = self.memory_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Integral)
                                   or budget <= 0):
            raise OptionsError(f"memory budget {budget!r} is not a positive number of bytes; give a size such as "
                               "70GiB (or 75161927680), or none for the device's memory")
        if self.checkpoint not in CHECKPOINT_METHODS:
            raise OptionsError(f"checkpoint method {self.checkpoint!r} is not one of {', '.join(CHECKPOINT_METHODS)}")
        if self.offload not in OFFLOAD_MODES:
            raise OptionsError(f"offload {self.offload!r} is not one of {', '.join(OFFLOAD_MODES)}")
        if self.offload_axes is not None:
            if self.offload == "none":
                raise OptionsError("offload axes name the axes chunked state is ZeRO-sharded over: they need offload "
                                   "'auto' or 'chunked'")
            object.__setattr__(self, "offload_axes", tuple(self.offload_axes))
        if self.mixed_precision == "fp16":
            raise OptionsError("mixed precision 'fp16' needs loss scaling, which cauto does not implement; use "
                               "mixed precision 'bf16' (no loss scaling needed) or 'none'")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise OptionsError(f"mixed precision {self.mixed_precision!r} is not one of {', '.join(MIXED_PRECISIONS)}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise OptionsError(f"reduce dtype {self.reduce_dtype!r} is not one of {', '.join(REDUCE_DTYPES)}")
        if self.reduce_dtype != "fp32" and self.mixed_precision == "none":
            raise OptionsError(f"reduce dtype {self.reduce_dtype!r} is a mixed-precision choice: it needs mixed "
                               "precision 'bf16'")
        if not isinstance(self.regather, bool):
            raise OptionsError(f"regather {self.regather!r} is not true or false")
        if self.solver not in SOLVERS:
            raise OptionsError(f"unknown solver {self.solver!r}; use one of {SOLVERS}")
        if isinstance(self.time_limit_s, bool) or not isinstance(self.time_limit_s, numbers.Real) \
                or not self.time_limit_s >= 0:
            raise OptionsError(f"time_limit_s {self.time_limit_s!r} is not a number of seconds (0 or more)")

    def record(self) -> dict:
        """Every field, as the plan's ``options`` section records them (JSON types)."""
        return {"memory_budget_bytes": self.memory_budget_bytes, "checkpoint": self.checkpoint,
                "offload": self.offload,
                "offload_axes": None if self.offload_axes is None else [int(a) for a in self.offload_axes],
                "mixed_precision": self.mixed_precision, "reduce_dtype": self.reduce_dtype, "solver": self.solver,
                "time_limit_s": float(self.time_limit_s), "regather": self.regather}

    def to_dict(self) -> dict:
        """The options as the plan cache keys them: budget and checkpoint always; offload and its axes
        only when set, so that keys of plans cached before offload existed stay valid; mixed precision and
        its reduce dtype likewise only when not the default (an fp32 and a bf16 plan never share a key). The solver and
        its time limit are not part of the key (a cached plan is reused whichever solver found it)."""
        out: dict = {"budget": self.memory_budget_bytes, "checkpoint": self.checkpoint}
        if self.offload != "none":
            out["offload"] = self.offload
        if self.offload_axes is not None:
            out["offload_axes"] = list(self.offload_axes)
        if self.mixed_precision != "none":
            out["mixed_precision"] = self.mixed_precision
            out["reduce_dtype"] = self.reduce_dtype
        if self.regather:
            out["regather"] = True
        return out
