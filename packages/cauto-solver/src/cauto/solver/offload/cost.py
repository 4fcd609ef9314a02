"""The ILP's costs with chunked state: a chunked parameter costs its host link traffic, and where the
chunks span every mesh axis (pure data parallelism) a redistribution edge costs ``EDGE_PENALTY_S``
more (model.py's docstring has the model)."""

from __future__ import annotations

from cauto.plan import GraphNode
from cauto.solver.cost.model import CostModel
from cauto.solver.offload.model import OffloadModel
from cauto.solver.strategies.node import Strategy

#: ILP seconds charged per redistribution edge: pure data-parallel plans with chunked state run without any
EDGE_PENALTY_S = 1e3


class ChunkedCostModel(CostModel):
    """CostModel whose chunked parameters cost their host link traffic (``OffloadModel.param_transfer_s``)
    and, when the model is pure, whose redistribution edges cost ``EDGE_PENALTY_S`` more."""

    offload: OffloadModel
    base: CostModel

    def compute_s(self, node: GraphNode, strategy: Strategy) -> float:
        if self.offload.chunks(node, strategy):
            return self.offload.param_transfer_s(node, strategy)
        return super().compute_s(node, strategy)

    def edge_cost_s(self, src, dst, grad, nbytes: int, needs_grad: bool, fanout: int = 1,
                    moved_nbytes: int | None = None, grad_nbytes: int | None = None,
                    regathered: bool = False) -> float:
        penalty_s = EDGE_PENALTY_S if self.offload.pure and src != dst else 0.0
        return super().edge_cost_s(src, dst, grad, nbytes, needs_grad, fanout, moved_nbytes, grad_nbytes,
                                   regathered) + penalty_s


def chunked_cost_model(base: CostModel, offload: OffloadModel) -> ChunkedCostModel:
    """``base`` with chunked parameters priced at their traffic and, when pure, edges penalized
    (``base`` stays as ``.base``, the plan's step time)."""
    m = ChunkedCostModel.__new__(ChunkedCostModel)
    m.__dict__.update(base.__dict__)
    m.clear_caches()
    m.offload, m.base = offload, base
    return m
