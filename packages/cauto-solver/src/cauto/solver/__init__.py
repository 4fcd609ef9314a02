"""cauto.solver: sharding strategies, the ILP and plan documents; never imports torch.

``solve(graph, cluster)`` returns a plan document; ``cluster_for_mesh(preset_or_file, shape)``
builds the cluster. See ARCHITECTURE.md and ALGORITHMS.md §1–2 for the ideas.
"""

from cauto.solver.cluster import (
           PRESETS,
           AxisLink,
           ClusterSpec,
           DeviceSpec,
           HardwareSpec,
           cluster_for_mesh,
           parse_mesh,
)
from cauto.solver.errors import InfeasibleBudgetError, SolverError
from cauto.solver.planning import CHECKPOINT_METHODS, plan
from cauto.solver.solve import solve

__all__ = ["CHECKPOINT_METHODS", "PRESETS", "AxisLink", "ClusterSpec", "DeviceSpec", "HardwareSpec", "InfeasibleBudgetError", "SolverError",
           "cluster_for_mesh", "parse_mesh", "plan", "solve"]
