"""Chunked model state (ALGORITHMS.md §4, PatrickStar) as the solver plans it: which parameters the
runtime's chunk manager (``cauto.runtime.chunks``) holds, what the device still needs, what moves.

Data-parallel axes. A solve with chunked state names the mesh axes D its chunks are ZeRO-sharded
over (``OffloadModel.mesh_axes``, the plan's ``offload.mesh_axes``; default: every axis). The
group is the W = Π_{a∈D} mesh[a] devices that differ only in their D coordinates. *Pure* means D is
every axis; *mixed* means the other axes are left to the ILP (tensor parallelism there).

Which parameters. A trainable, untied parameter whose storage placement is Replicate on every axis
of D (any placement on the other axes) is *chunked*: its fp32 value, gradient and Adam moments,
of its local shard on the other axes, live in chunks of ``chunk_elems`` elements, ZeRO-sharded
over the group and paged between host and device. Every other parameter keeps its device state.

Which plans (``restrict``): every parameter and buffer Replicate on every axis of D, every user
input Shard(0) on every axis of D of size > 1 (left as enumerated where none is: its batch does
not divide); the other axes are free. So every trainable untied parameter is chunked.

* Pure: the runtime runs the model as written on each rank's slice of the batch
  (``cauto.runtime.apply``), which has no redistribution edges: each costs ``EDGE_PENALTY_S`` (cost.py) in
  the ILP, and a solution that still needs one, or whose predicted peak is over the budget, counts as
  infeasible (``runnable``).
* Mixed: the runtime runs the DTensor program with each parameter's local shard in the chunk
  manager: edges are priced as usual and ``runnable`` only checks the predicted peak.

``planning.plan`` picks D: given, or the fastest feasible of every axis and each single axis of
size > 1 (on a mesh with more than one such axis).

Chunk size: the runtime's own default rule (the least padding over sizes from the largest
parameter up to budget/64 bytes, in steps of max(1024, that bound/2000) elements), over the full
size of every trainable parameter (at least any local shard, which the runtime needs) and groups of
W; the plan records it (``offload.chunk_elems``) and the runtime uses it. ``offload.num_chunks``
counts the chunks of the chunked parameters' local shards (``local_numel``: a dim split on an axis
of size n becomes ceil(dim / n), once per such axis) in graph order, padded to a multiple of W.

Device memory per device (the documented model; ``ChunkedMemoryModel``, memory.py):

* A chunked parameter's value, gradient and optimizer state count nothing in the usual model
  (the solver's memory/model.py): not in the always-live state, not at the end of backward, not in the optimizer step.
* Instead the *working set*, the chunk bytes the device must hold at once, is always live:
  2 parameter chunks (the backward's pinned ring; in forward a module's own parameters) + 1 fp32
  gradient chunk (the one being accumulated): ``chunk_elems · (2·4 + 4)``. The runtime's warm-up
  check (chunks pinned at once) measured 2 parameter chunks on the MLP and GPT of the integration
  test.
* A chunked parameter's gradient as autograd computes it is non-model memory: the runtime's hook
  adds it into its gradient chunk and drops it, so it lives from its last consumer's backward to its
  first's (memory/walk.py, ``MemoryModel.handed_over_grad``), not all step.

So ``peak = non-model + working set ≤ budget``. The runtime gets the whole budget
(``offload.device_budget_bytes``) and sizes its chunk arena as the budget minus the non-model peak
it measures in a warm-up step: the predicted arena is ``budget − (peak − working set)``; what it has
beyond the working set caches chunks.

Host link traffic per step and device (``traffic_bytes``; W: the group size; P: bytes of every
parameter chunk, which each rank uses after the all-gather; G: their fp32 gradient chunks; O: the
Adam moments of the chunks this rank owns, 8 bytes · elements / W; A: the arena; S = A − working set):

* A ≥ P + G + O: everything stays on the device; the other ranks' chunks, which the all-gather
  brings through host memory, arrive, and with W > 1 this rank's own parameter chunk leaves for the
  all-gather (updated on the device) and its reduce-scattered gradient shard (which the collective
  leaves on the host) arrives for the device-side Adam: ``P · (W − 1) / W + (P + G) / W`` (0 when
  W = 1). (Measured on 4 gloo ranks: 0.66 MiB where ``P · (W − 1) / W`` alone predicted 0.40;
  ``tools/bench/bench_chunks_mesh.py``.)
* otherwise every parameter chunk arrives once (after the host-side Adam update or the gather),
  this rank's reduce-scattered gradient shard leaves once, and the parameter chunks the arena
  cannot keep from forward to backward arrive again: ``P + G / W + max(0, P − S)``.

It is an upper bound of the chunk manager's counted traffic: its Belady eviction keeps more than
"every chunk again", and zero-filled gradient chunks never cross (measured on 2 gloo ranks: 2.4-2.9
of 6.1 MB predicted for a 6-layer MLP, 1.25 of 1.90 MB for a 4-layer GPT at a 2 MiB budget; see
integration_tests/test_offload_end_to_end.py). Seconds: bytes / the device's
``host_link_bandwidth_bytes_per_s`` (``step_time_s.offload``, part of the total). The ILP sees one
parameter at a time and prices a chunked one at its traffic without any caching,
``(2 · bytes + 4 · numel / W) / bandwidth`` of its local shard (``ChunkedCostModel``, cost.py): an upper
bound too. (Its gradient's reduction over D stays priced as the base model's all-reduce, which in
the α-β model costs about what the ZeRO all-gather plus reduce-scatter of its bytes cost.)

Collectives (section.py, with the ``offload`` section). The all-reduces over the axes of D of a chunked parameter's gradient, in its
gradient synchronization (``grad_sync``) and in the backward of a redistribution edge that starts
at it, are replaced by the chunk manager's (the runtime's ``chunk_fetch`` leaves the gradient
Partial on D; other collectives, on other axes or gathering a Shard gradient on D, stay): per group of W chunks an all-gather
of W parameter chunks in forward and a reduce-scatter of W fp32 gradient chunks in backward,
and one all-reduce of the per-parameter "has a gradient" flags over D in the optimizer step. Each
is one collective over the flattened group of D (the runtime's ZeRO process group: the whole mesh,
one axis's group, or a group over the ranks that differ only on the axes of D), however many axes
D spans: recorded on the first axis of D of size > 1, priced as the α-β ring over W ranks on the
slowest link of D's axes. When D is every axis, every trainable parameter is chunked and the plan
has no redistribution edges, the runtime runs the model as written on each rank's slice of the
batch: the collectives the DTensor program would run inside ops are dropped, the all-reduce of the
loss stays, as one all-reduce over the whole mesh (the runtime's one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cauto.plan import GraphDocument, GraphNode, split_ref
from cauto.plan.chunking import count_chunks, default_chunk_elems
from cauto.plan.mesh_axes import data_parallel_axes
from cauto.solver.cluster import ClusterSpec
from cauto.solver.errors import SolverError
from cauto.solver.memory.model import MemoryModel, numel
from cauto.solver.memory.walk import predicted_peak_bytes
from cauto.solver.strategies.node import Placements, Strategy, output_placement

#: bytes per element of a chunked parameter, of its gradient chunk, of its Adam moments (fp32)
PARAM_ITEMSIZE, GRAD_ITEMSIZE, ADAM_BYTES_PER_ELEM = 4, 4, 8
#: parameter chunks the runtime pins at once (cauto.runtime.chunks.model.BACKWARD_PINS) and gradient chunks
WORKING_SET_PARAM_CHUNKS, WORKING_SET_GRAD_CHUNKS = 2, 1


def is_chunked(node: GraphNode, strategy: Strategy, mesh_axes: tuple[int, ...] | None = None) -> bool:
    """Whether a parameter stored with ``strategy`` is chunked when the chunks are ZeRO-sharded over
    ``mesh_axes`` (default: every axis; module docstring)."""
    placements = strategy.outputs[0]
    axes = range(len(placements)) if mesh_axes is None else mesh_axes
    return (node.kind == "param" and not node.tied_to and node.requires_grad is not False
            and all(placements[a] == "R" for a in axes))


def registration_order(nodes: list[GraphNode]) -> list[GraphNode]:
    """The parameters among ``nodes`` (untied owners) in the order the runtime's chunk layout packs
    them: the model's registration order, where a tied parameter sits at its first name (the graph
    lists parameters in that order, but names a tied pair's owner at the alias it keeps, which may
    come later: the zoo GPT's token embedding is tied to its head)."""
    params = [n for n in nodes if n.kind == "param"]
    first: dict[str, int] = {}
    for i, n in enumerate(params):
        first.setdefault(n.tied_to or n.id, i)
    owners = [n for n in params if not n.tied_to]
    return sorted(owners, key=lambda n: first[n.id])


def local_numel(node: GraphNode, placements: Placements, mesh_shape: tuple[int, ...]) -> int:
    """Elements of one device's shard of a placeholder placed ``placements`` (a dim split on an axis of
    n devices becomes ceil(dim / n), once per such axis)."""
    if not any(p.startswith("S(") for p in placements):
        return numel(node)
    dims = list(node.outputs[0].shape)
    for axis, p in enumerate(placements):
        if p.startswith("S("):
            d = int(p[2:-1])
            dims[d] = -(-dims[d] // mesh_shape[axis])
    return math.prod(dims)


@dataclass(frozen=True)
class OffloadModel:
    """Chunk size, data-parallel axes, group and link of one solve with chunked state (module docstring).

    ``mesh_axes`` (D) defaults to every axis of ``cluster``'s mesh; ``cluster`` may be None where
    only the memory model is needed (memory/timeline.py), and D then stays None: every axis."""

    cluster: ClusterSpec | None
    budget_bytes: int
    chunk_elems: int
    mesh_axes: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.cluster is not None:
            axes = data_parallel_axes(tuple(self.cluster.mesh_shape), self.mesh_axes, error=SolverError)
            object.__setattr__(self, "mesh_axes", axes)

    @classmethod
    def for_graph(cls, graph: GraphDocument, cluster: ClusterSpec, budget_bytes: int,
                  mesh_axes: tuple[int, ...] | None = None) -> OffloadModel:
        """The model for ``graph`` on ``cluster`` under a per-device budget, chunks ZeRO-sharded over
        ``mesh_axes`` (default: every axis)."""
        axes = data_parallel_axes(tuple(cluster.mesh_shape), mesh_axes, error=SolverError)
        numels = [numel(n) for n in registration_order(graph.nodes) if n.requires_grad is not False]
        group_size = math.prod(cluster.mesh_shape[a] for a in axes)
        # the runtime's own default (chunk_module's search, one parameter group, fp32)
        chunk_elems = default_chunk_elems([numels], group_size, budget_bytes, PARAM_ITEMSIZE + GRAD_ITEMSIZE)
        return cls(cluster, int(budget_bytes), chunk_elems, axes)

    @property
    def pure(self) -> bool:
        """Whether D is every mesh axis (pure data parallelism: the runtime runs the model as written)."""
        return len(self.mesh_axes) == len(self.cluster.mesh_shape)

    @property
    def group_size(self) -> int:
        """Devices the chunks are ZeRO-sharded over: the product of the mesh sizes of D."""
        return math.prod(self.cluster.mesh_shape[a] for a in self.mesh_axes)

    def chunks(self, node: GraphNode, strategy: Strategy) -> bool:
        """Whether ``node`` stored with ``strategy`` is chunked in this model (``is_chunked`` over D)."""
        return is_chunked(node, strategy, self.mesh_axes)

    @property
    def host_link_bandwidth_bytes_per_s(self) -> float:
        return float(self.cluster.device.host_link_bandwidth_bytes_per_s)

    @property
    def working_set_bytes(self) -> int:
        """Chunk bytes the device must hold at once (module docstring)."""
        return self.chunk_elems * (WORKING_SET_PARAM_CHUNKS * PARAM_ITEMSIZE + WORKING_SET_GRAD_CHUNKS * GRAD_ITEMSIZE)

    def param_transfer_s(self, node: GraphNode, strategy: Strategy) -> float:
        """The ILP's price of chunking one parameter stored with ``strategy``: the traffic of its local
        shard per step without caching."""
        elems = local_numel(node, strategy.outputs[0], tuple(self.cluster.mesh_shape))
        return (2 * PARAM_ITEMSIZE * elems + GRAD_ITEMSIZE * elems / self.group_size) / self.host_link_bandwidth_bytes_per_s

    def num_chunks(self, chunked: list[GraphNode], chosen: dict[str, Strategy]) -> int:
        """Chunks of the local shards of the ``chunked`` parameters (in ``registration_order``) as ``chosen``
        places them, padded to a multiple of the group size (module docstring)."""
        mesh = tuple(self.cluster.mesh_shape)
        numels = [local_numel(n, chosen[n.id].outputs[0], mesh) for n in chunked]
        return count_chunks([numels], self.chunk_elems, self.group_size)

    def traffic_bytes(self, num_chunks: int, arena_bytes: int) -> int:
        """Host link bytes per step of ``num_chunks`` chunks with an arena of ``arena_bytes`` (module docstring)."""
        w = self.group_size
        p = num_chunks * self.chunk_elems * PARAM_ITEMSIZE
        g = num_chunks * self.chunk_elems * GRAD_ITEMSIZE
        o = num_chunks // w * self.chunk_elems * ADAM_BYTES_PER_ELEM
        if arena_bytes >= p + g + o:
            return p * (w - 1) // w + (p + g) // w if w > 1 else 0
        spare = max(0, arena_bytes - self.working_set_bytes)
        return p + g // w + max(0, p - spare)

    def restrict(self, graph: GraphDocument, strategies: dict[str, list[Strategy]]) -> dict[str, list[Strategy]]:
        """Only the placeholder strategies data parallelism over D allows (module docstring): parameters
        and buffers Replicate on every axis of D, inputs Shard(0) on every axis of D of size > 1."""
        mesh = tuple(self.cluster.mesh_shape)
        out = dict(strategies)
        for n in graph.nodes:
            if n.id not in strategies or n.kind not in ("param", "buffer", "input"):
                continue
            want = "S(0)" if n.kind == "input" else "R"
            axes = [a for a in self.mesh_axes if n.kind != "input" or mesh[a] > 1]
            kept = [s for s in strategies[n.id] if all(s.outputs[0][a] == want for a in axes)]
            if kept:  # an input whose batch does not divide stays as enumerated
                out[n.id] = kept
        return out

    def runnable(self, graph: GraphDocument, chosen: dict[str, Strategy], memory: MemoryModel, budget: int) -> bool:
        """Whether a solution is a plan the runtime runs with chunks: predicted peak within budget and,
        when pure, no edge."""
        nodes = [n for n in graph.nodes if n.kind != "output"]
        if self.pure and _has_edge(graph, nodes, chosen):
            return False
        return predicted_peak_bytes(memory, nodes, chosen) <= budget


def first_edge(graph: GraphDocument, nodes: list[GraphNode], chosen: dict[str, Strategy]) -> tuple[str, str] | None:
    """(producer, consumer) of the first op input that needs a placement its producer does not give
    (a redistribution edge), or None."""
    by_id = graph.node_map()
    for n in nodes:
        for k, ref in enumerate(n.inputs):
            src_id, o = split_ref(ref)
            if output_placement(chosen, by_id[src_id], o) != chosen[n.id].inputs[k]:
                return ref, n.id
    return None


def _has_edge(graph: GraphDocument, nodes: list[GraphNode], chosen: dict[str, Strategy]) -> bool:
    return first_edge(graph, nodes, chosen) is not None


def ilp_budget(budget_bytes: int, offload: OffloadModel | None) -> int:
    """The budget the ILP's memory rows get: the working set is always live when anything is chunked."""
    return budget_bytes - (offload.working_set_bytes if offload is not None else 0)
