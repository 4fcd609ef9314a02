"""Costs in seconds: compute per strategy (roofline) and resharding per edge (forward + backward).

compute_s(node, strategy) = fwd + bwd, each max(flops/k / peak_flops, bytes/k / memory_bandwidth,
kernel_floor_s) with k the strategy's shard factor (its FLOPs and bytes are divided among k
devices). Nodes profiled with times but no FLOPs/bytes use time/k. Backward only when training.

edge_cost_s(src, dst, grad) for a tensor of B bytes flowing from a producer output placed ``src``
into a consumer input that needs ``dst`` and whose backward yields gradient placement ``grad``:

    reshard(src -> dst) + [tensor needs a gradient] · reshard(grad -> backward_target(grad, src))

When src == dst the runtime redistributes nothing in forward, and the second term is the
redistribution the producer's backward (or, for a parameter, gradient synchronization) performs on
a gradient that arrives Partial: all-reduce to Replicate, reduce-scatter to Shard. Autograd sums
the gradients of a tensor's consumers before that reduction, so a tensor read by ``fanout``
consumers charges each no-edge consumer 1/fanout of it: exact when its consumers agree (q, k, v
projections of one normalized input), an underestimate when only some of them leave a Partial
gradient. Each redistribution on an edge has its own backward, priced in full.
"""

from __future__ import annotations

import numpy as np

from cauto.plan import GraphNode
from cauto.plan.precision import bytes_as
from cauto.solver.cluster import ClusterSpec
from cauto.solver.cost.reshard import backward_target, reshard_cost_s
from cauto.solver.strategies.node import Placements, Strategy

#: Ties between equally fast plans go to the one keeping fewer bytes (model state, saved
#: activations): each byte costs TIE_BREAK_SHARE · (one-device compute time) / (one-device peak bytes)
#: seconds, so the whole term stays under 0.01% of the step time (set by ``set_tie_break``).
TIE_BREAK_SHARE = 1e-4


class CostModel:
    """Seconds of compute and of redistributions on one cluster; caches what repeats."""

    def __init__(self, cluster: ClusterSpec, train: bool, reduce_dtype: str | None = None):
        self.cluster = cluster
        self.train = train
        #: the dtype name gradients of parameters and of values moved cast are reduced in, where mixed
        #: precision lowers it ("bfloat16"; the runtime's backward_dtype and bucket casts), None: their own
        self.reduce_dtype = reduce_dtype
        self.mesh_shape = tuple(cluster.mesh_shape)
        self.links = tuple((a.latency_s, a.bandwidth_bytes_per_s) for a in cluster.axes)
        #: per-collective dispatch overhead (the device's kernel floor)
        self.overhead_s = cluster.device.kernel_floor_s
        self.all_to_all = cluster.device.all_to_all
        self.clear_caches()
        self.tie_break_s_per_byte = 0.0

    def clear_caches(self) -> None:
        """Forget every cached edge cost: a model copied from another whose edges cost differently
        (offload/cost.py) starts with empty caches."""
        self._edge_cache: dict = {}
        self._pair_cache: dict = {}

    def set_tie_break(self, compute_s: float, peak_bytes: int) -> None:
        """Scale the memory tie-break from the one-device compute time and peak (module constant)."""
        self.tie_break_s_per_byte = TIE_BREAK_SHARE * compute_s / peak_bytes if peak_bytes > 0 else 0.0

    def _phase_s(self, flops: float, nbytes: float, time_s: float, k: int) -> float:
        dev = self.cluster.device
        if flops <= 0 and nbytes <= 0:
            return time_s / k if time_s > 0 else 0.0
        return max(flops / k / dev.peak_flops, nbytes / k / dev.memory_bandwidth_bytes_per_s, dev.kernel_floor_s)

    def compute_s(self, node: GraphNode, strategy: Strategy) -> float:
        """Forward (+ backward when training) seconds of ``node`` run with ``strategy``."""
        if node.kind != "op":
            return 0.0
        k = strategy.shard_factor
        t = self._phase_s(node.fwd_flops, node.fwd_bytes, node.fwd_time_s, k)
        if self.train:
            t += self._phase_s(node.bwd_flops, node.bwd_bytes, node.bwd_time_s, k)
        return t

    def reshard_s(self, src: Placements, dst: Placements, nbytes: int) -> float:
        """Seconds of redistributing ``nbytes`` from src to dst."""
        return reshard_cost_s(src, dst, nbytes, self.mesh_shape, self.links, self.overhead_s, self.all_to_all)

    def edge_cost_s(self, src: Placements, dst: Placements, grad: Placements, nbytes: int, needs_grad: bool,
                    fanout: int = 1, moved_nbytes: int | None = None, grad_nbytes: int | None = None,
                    regathered: bool = False) -> float:
        """Forward plus backward seconds of one producer->consumer edge (module docstring).
        ``moved_nbytes``: the forward moves fewer bytes than the gradient (mixed precision: the value
        is cast to bf16 before it moves, the gradient is reduced in fp32; memory/casts.py);
        ``grad_nbytes``: the gradient's collective moves fewer bytes (a bf16 reduce dtype);
        ``regathered``: the backward redistributes the value again (a parameter gathered anew for its
        consumer's backward, plan ``execution.regather_params``)."""
        key = (src, dst, grad, nbytes, needs_grad, fanout, moved_nbytes, grad_nbytes, regathered)
        hit = self._pair_cache.get(key)
        if hit is not None:
            return hit
        t = self.reshard_s(src, dst, nbytes if moved_nbytes is None else moved_nbytes)
        if regathered and src != dst:
            t *= 2
        if needs_grad:
            back = self.reshard_s(grad, backward_target(grad, src), nbytes if grad_nbytes is None else grad_nbytes)
            t += back if src != dst else back / fanout
        self._pair_cache[key] = t
        return t

    def reduced_grad_nbytes(self, src: GraphNode, output: int, moved_dtype: str | None) -> int | None:
        """Bytes the gradient collective of output ``output`` of ``src`` moves where the reduce dtype
        lowers them (a parameter's gradient, or the gradient of a value moved cast to ``moved_dtype``),
        else None (its own bytes)."""
        if self.reduce_dtype is None or (src.kind != "param" and moved_dtype is None):
            return None
        meta = src.outputs[output]
        return bytes_as(meta.bytes, meta.dtype, self.reduce_dtype)

    def edge_matrix(self, src_pls: tuple[Placements, ...], consumer: tuple[Strategy, ...], arg: int,
                    nbytes: int, needs_grad: bool, fanout: int = 1, moved_nbytes: int | None = None,
                    grad_nbytes: int | None = None, regathered: bool = False) -> np.ndarray:
        """Cost matrix [producer strategy, consumer strategy] of one edge, in seconds (cached)."""
        key = (src_pls, tuple((s.inputs[arg], s.input_grads[arg]) for s in consumer), nbytes, needs_grad, fanout,
               moved_nbytes, grad_nbytes, regathered)
        hit = self._edge_cache.get(key)
        if hit is not None:
            return hit
        m = np.empty((len(src_pls), len(consumer)))
        for i, src in enumerate(src_pls):
            for j, s in enumerate(consumer):
                m[i, j] = self.edge_cost_s(src, s.inputs[arg], s.input_grads[arg], nbytes, needs_grad, fanout,
                                           moved_nbytes, grad_nbytes, regathered)
        m.setflags(write=False)
        self._edge_cache[key] = m
        return m
