"""cauto.runtime: execute a cauto plan with DTensor on torch.distributed, and show the code that runs."""

from cauto.runtime.apply import ChunkedParallelModule, ParallelModule, PlanMismatchError, apply
from cauto.runtime.dist_utils import init_distributed, make_mesh

__all__ = ["ChunkedParallelModule", "ParallelModule", "PlanMismatchError", "apply", "init_distributed", "make_mesh"]
