"""Device memory with chunked state: chunked parameters hold nothing but the chunk working set, which
is always live (model.py's docstring has the model), and, during a checkpoint region's backward, the
chunks its recomputation fetched again (``recompute_pinned_bytes``)."""

from __future__ import annotations

from cauto.plan import GraphNode, split_ref
from cauto.plan.chunking import chunk_indices
from cauto.solver.memory.model import MemoryModel
from cauto.solver.offload.model import PARAM_ITEMSIZE, OffloadModel, local_numel, registration_order
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

    def recompute_pinned_bytes(self, by_id: dict, chosen: dict[str, Strategy], region: set[str]) -> int:
        """Bytes of the parameter chunks a region's recomputation fetches again and keeps pinned until their
        parameters' gradients are in (the runtime's chunks/model.py): every chunk holding a chunked
        parameter an op of ``region`` reads, packed as the runtime packs them (``registration_order``, local shards)."""
        mesh = tuple(self.mesh_shape)
        params = [n for n in registration_order(list(by_id.values()))
                  if n.id in chosen and self.offload.chunks(n, chosen[n.id])]
        (indices,) = chunk_indices([[local_numel(n, chosen[n.id].outputs[0], mesh) for n in params]],
                                   self.offload.chunk_elems)
        chunk_of = {n.id: i for n, i in zip(params, indices)}
        read = {chunk_of[owner] for node_id in region for ref in by_id[node_id].inputs
                if (src := by_id.get(split_ref(ref)[0])) is not None and src.kind == "param"
                and (owner := src.tied_to or src.id) in chunk_of}
        return len(read) * self.offload.chunk_elems * PARAM_ITEMSIZE

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
