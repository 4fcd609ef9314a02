"""Activation checkpointing: which activations to recompute, on which schedule (joint.py searches it together with sharding).

* chain.py, linearize.py: a graph document as a chain of stages (per device, per sharding).
* schedule.py, simulate.py: schedules as nested levels; the simulator that judges time and peak.
* rotor.py: the optimal DP (Beaumont et al. 2019); chen.py: the √n baseline.
* api.py: ``plan_checkpoint`` (the plan's ``checkpoint`` section) and ``summary_lines`` for the CLI.
"""

from cauto.solver.checkpoint.api import (
    CheckpointChoice,
    CheckpointInfeasibleError,
    checkpoint_section,
    choose_schedule,
    plan_checkpoint,
    summary_lines,
)
from cauto.solver.checkpoint.chain import Chain
from cauto.solver.checkpoint.linearize import build_chain
from cauto.solver.checkpoint.rotor import least_memory, solve_rotor
from cauto.solver.checkpoint.simulate import simulate

__all__ = [
    "Chain", "CheckpointChoice", "CheckpointInfeasibleError", "build_chain", "checkpoint_section", "choose_schedule",
    "least_memory", "plan_checkpoint", "simulate", "solve_rotor", "summary_lines",
]
