"""Device memory with chunked state: chunked parameters hold nothing but the chunk working set, which
is always live (model.py's docstring has the model)."""

from __future__ import annotations

from cauto.plan import GraphNode
from cauto.solver.memory.model import MemoryModel
from cauto.solver.offload.model import OffloadModel
from cauto.solver.strategies.node import Strategy


class ChunkedMemoryModel(MemoryModel):
    """MemoryModel in which chunked parameters hold nothing but the working set (module docstring)."""

    offload: OffloadModel

    def state_bytes(self, node: GraphNode, strategy: Strategy) -> int:
        return 0 if self.offload.chunks(node, strategy) else super().state_bytes(node, strategy)

    def grad_bytes(self, node: GraphNode, strategy: Strategy) -> int:
        return 0 if self.offload.chunks(node, strategy) else super().grad_bytes(node, strategy)

    def handed_over_grad(self, node: GraphNode, strategy: Strategy) -> bool:
        # the runtime's gradient hook adds a chunked parameter's gradient into its chunk and drops it
        return self.offload.chunks(node, strategy) and super().grad_bytes(node, strategy) > 0

    def breakdown(self, nodes: list[GraphNode], chosen: dict[str, Strategy],
                  exact: bool = True) -> tuple[int, int, int, int, str]:
        peak, state, rest, t, phase = super().breakdown(nodes, chosen, exact)
        if any(n.id in chosen and self.offload.chunks(n, chosen[n.id]) for n in nodes):
            ws = self.offload.working_set_bytes
            return peak + ws, state + ws, rest, t, phase
        return peak, state, rest, t, phase

    def optimizer_extra_bytes(self, nodes, chosen) -> int:
        # the optimizer's temporaries scale with the largest parameter it updates on the device
        on_device = [n for n in nodes if not (n.id in chosen and self.offload.chunks(n, chosen[n.id]))]
        return super().optimizer_extra_bytes(on_device, chosen)


def chunked_memory_model(base: MemoryModel, offload: OffloadModel) -> ChunkedMemoryModel:
    """A copy of the calibrated ``base`` that counts chunked parameters as ``offload`` says."""
    m = ChunkedMemoryModel.__new__(ChunkedMemoryModel)
    m.__dict__.update(base.__dict__)
    m.offload = offload
    return m
