"""Per-device memory: a peak over the node order (liveness), not a sum and not parameters only.

Model state is alive for the whole step. Per parameter with storage placement split into k
pieces: its bytes/k, its gradient bytes/k (training), and the optimizer state: AdamW/Adam keep
two fp32 tensors per element (8 bytes · numel/k), SGD (no momentum) and "none" keep nothing.
Tied parameters count once. Inputs (possibly batch-sliced) and buffers count as live too.

Activations follow the forward order t = 0..T−1. Each node's ``saved_bytes`` (held until its
backward) scale by the shard count of its first output; ``transient_bytes`` (alive only while it
runs) by the strategy's shard factor. The live bytes at step t are

    model_state + Σ_{i ≤ t} saved_i + transient_t,

and the plan's peak is the maximum over t (Alpa's per-step constraint). Because the saved sum never
decreases, only steps with a transient term and the last step can set the maximum.

Gathered parameters: when an op needs a parameter less sharded than it is stored (ZeRO: all-gather
before use), the redistributed copy is what autograd saves for the op's backward, so it stays
alive from that op to the end of forward: bytes / shards(needed placement) join the saved sum at the
op's step (``gathered_bytes``; embeddings save only their indices and are exempt).

Calibration: when the graph carries a measured/simulated ``memory.peak_bytes`` for the unsharded
run, activation terms are scaled (within [0.5, 2]) so that the single-device estimate matches it.
"""

from __future__ import annotations

import math

from cauto.plan import GraphNode
from cauto.solver.strategies import Strategy, shard_count

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8}
OPTIMIZER_BYTES_PER_ELEM = {"adam": 8, "adamw": 8, "sgd": 0, "none": 0}


def numel(node: GraphNode) -> int:
    """Elements of a placeholder's (first) output."""
    meta = node.outputs[0]
    if meta.shape or meta.bytes == 0:
        return math.prod(meta.shape)
    return meta.bytes // _ITEMSIZE.get(meta.dtype, 4)


class MemoryModel:
    """Bytes per device of each node under each strategy (see module docstring)."""

    def __init__(self, mesh_shape: tuple[int, ...], optimizer: str, train: bool):
        self.mesh_shape = tuple(mesh_shape)
        self.train = train
        self.opt_bytes_per_elem = OPTIMIZER_BYTES_PER_ELEM.get(optimizer, 8) if train else 0
        self.activation_scale = 1.0

    def state_bytes(self, node: GraphNode, strategy: Strategy) -> int:
        """Always-live bytes of a placeholder: a param with its gradient and optimizer state, an input, a buffer."""
        if node.kind not in ("param", "buffer", "input") or node.tied_to:
            return 0
        k = shard_count(strategy.outputs[0], self.mesh_shape)
        b = node.outputs[0].bytes // k
        if node.kind != "param":
            return b
        grad = b if self.train and node.requires_grad is not False else 0
        opt = self.opt_bytes_per_elem * numel(node) // k if node.requires_grad is not False else 0
        return b + grad + opt

    def saved_bytes(self, node: GraphNode, strategy: Strategy) -> int:
        """Bytes this op keeps for backward, per device."""
        if node.kind != "op" or not node.saved_bytes or not self.train:
            return 0
        k = shard_count(strategy.outputs[0], self.mesh_shape) if strategy.outputs else 1
        return int(node.saved_bytes * self.activation_scale) // k

    def transient_bytes(self, node: GraphNode, strategy: Strategy) -> int:
        """Bytes alive only while this op runs, per device."""
        if node.kind != "op" or not node.transient_bytes:
            return 0
        return int(node.transient_bytes * self.activation_scale) // strategy.shard_factor

    def gathered_bytes(self, consumer: GraphNode, param: GraphNode, stored: tuple[str, ...],
                       needed: tuple[str, ...]) -> int:
        """Bytes of a parameter copy redistributed for ``consumer`` and saved for its backward."""
        if not self.train or param.kind != "param" or stored == needed:
            return 0
        if consumer.labels is not None and consumer.labels.rule == "embedding":
            return 0
        return param.outputs[0].bytes // shard_count(needed, self.mesh_shape)

    def peak(self, nodes: list[GraphNode], chosen: dict[str, Strategy]) -> tuple[int, int, int, int]:
        """(peak bytes, model-state bytes, activation bytes at the peak, index of the peak step)."""
        state = sum(self.state_bytes(n, chosen[n.id]) for n in nodes if n.id in chosen)
        by_id = {n.id: n for n in nodes}
        cum, best, best_t = 0, 0, 0
        for t, n in enumerate(nodes):
            if n.id not in chosen or n.kind != "op":
                continue
            s = chosen[n.id]
            cum += self.saved_bytes(n, s)
            for k, ref in enumerate(n.inputs):
                src = by_id.get(ref.partition("#")[0])
                if src is not None and src.kind == "param":
                    owner = chosen[src.tied_to] if src.tied_to else chosen[src.id]
                    cum += self.gathered_bytes(n, src, owner.outputs[0], s.inputs[k])
            live = cum + self.transient_bytes(n, s)
            if live >= best:
                best, best_t = live, t
        return state + best, state, best, best_t

    def calibrate(self, nodes: list[GraphNode], replicated: dict[str, Strategy], measured_peak: int) -> None:
        """Scale activation terms so the one-device estimate matches ``measured_peak`` (module doc)."""
        self.activation_scale = 1.0
        if not measured_peak:
            return
        _, state, act, _ = self.peak(nodes, replicated)
        if act <= 0 or measured_peak <= state:
            return
        self.activation_scale = min(2.0, max(0.5, (measured_peak - state) / act))
