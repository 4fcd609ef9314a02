"""From a graph to the ILP's decision variables: strategy generation, followers, repeated layers.

Every graph node gets strategies (cached by op, labels, shapes: repeated layers generate once).
Then nodes are mapped onto *variables*; a variable is one one-hot choice among ``size`` options
and each node reads its strategy through ``node_map[node] = (var, index of its strategy per option)``:

* Roots (parameters, inputs, heavy ops) own a variable whose options are their strategies.
* Followers (AutoParallel/Alpa): a light op (no parameters, at most 16 FLOPs per output element:
  views, elementwise, softmax, losses) reuses the variable of the producer of its largest
  non-placeholder input; for each option of that variable it takes its cheapest strategy
  (compute + that edge, memory not considered), ties to the first.
* Repeated layers: nodes carry ``layer`` ("transformer.h.*") and ``layer_index``. Instances whose
  node sequence (kind, op, shapes, labels, in-layer wiring) is identical share variables: root k of
  every instance uses the variable of root k of the first such instance, so a 48-layer model
  solves one layer's worth of variables. Their costs add up (edges between shared variables
  aggregate), memory still counts every instance. Shared layers choose alike: near the memory
  limit a plan mixing strategies across layers (``share_layers=False``) can be faster.

The outputs of this module are plain arrays: ``node_cost[var]`` (seconds per option),
``pair_cost[(a, b)]`` (seconds per option pair, a < b), and the memory terms of memory/model.py mapped onto
variables in node order (``state_terms``, ``step_terms``; a gathered parameter's saved copy depends
on the parameter's and the consumer's choice together, so it is a matrix in ``pair_mem``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cauto.plan import GraphDocument, GraphNode, split_ref
from cauto.plan.dtypes import has_gradient
from cauto.plan.precision import bytes_as
from cauto.solver.checkpoint.recompute import backward_keeps
from cauto.solver.cost.model import CostModel
from cauto.solver.memory.model import MemoryModel
from cauto.solver.strategies.node import Strategy, op_strategies, placeholder_strategies

LIGHT_FLOPS_PER_ELEM = 16


@dataclass
class StepTerms:
    """Memory terms of one op step: saved bytes per option of a variable (``saved``), saved bytes per
    option pair (``pair_saved``: (a, b, index into Problem.pair_mem[(a, b)])) and transient bytes."""

    node_id: str
    saved: list[tuple[int, np.ndarray]]
    pair_saved: list[tuple[int, int, int]]
    transient: tuple[int, np.ndarray]


@dataclass
class Problem:
    """Variables, costs and memory terms of one graph on one mesh (module docstring)."""

    nodes: list[GraphNode]
    strategies: dict[str, list[Strategy]]
    var_sizes: list[int] = field(default_factory=list)
    var_owner: list[str] = field(default_factory=list)
    node_map: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)
    node_cost: list[np.ndarray] = field(default_factory=list)
    pair_cost: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    state_terms: list[tuple[int, np.ndarray]] = field(default_factory=list)
    #: per op node in order: bytes it adds to the saved sum and bytes alive only while it runs
    step_terms: list[StepTerms] = field(default_factory=list)
    #: (a, b) -> the saved-bytes matrices of gathered parameters joining variables a < b (memory/model.py)
    pair_mem: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)
    #: per node: bytes its backward adds to everything saved (memory.backward_extra_bytes), per option
    backward_terms: list[tuple[int, np.ndarray]] = field(default_factory=list)
    #: bytes of gradients at the end of backward (memory.grad_end_bound), per option of a parameter
    grad_terms: list[tuple[int, np.ndarray]] = field(default_factory=list)
    constant_s: float = 0.0

    def strategy_of(self, node_id: str, choice: list[int]) -> Strategy:
        """The strategy of a node given one option index per variable."""
        var, idx = self.node_map[node_id]
        return self.strategies[node_id][int(idx[choice[var]])]


def tensor_requires_grad(graph_nodes: list[GraphNode], train: bool = True) -> dict[str, bool]:
    """node id -> whether its outputs need gradients (params yes; inputs, buffers, integer ops no; nothing
    when not training)."""
    rg: dict[str, bool] = {}
    for n in graph_nodes:
        if n.kind == "param":
            rg[n.id] = train and n.requires_grad is not False
        elif n.kind == "op":
            floating = any(has_gradient(o.dtype) for o in n.outputs)
            rg[n.id] = floating and any(rg.get(split_ref(r)[0], False) for r in n.inputs)
        else:
            rg[n.id] = False
    return rg


def fanouts(graph_nodes: list[GraphNode]) -> dict[str, int]:
    """input reference ('node' or 'node#k') -> how many op inputs read it."""
    count: dict[str, int] = {}
    for n in graph_nodes:
        if n.kind == "op":
            for ref in n.inputs:
                src, k = split_ref(ref)
                key = f"{src}#{k}"
                count[key] = count.get(key, 0) + 1
    return count


def _in_shapes(n: GraphNode, by_id: dict[str, GraphNode]) -> list[tuple[int, ...]]:
    shapes = []
    for ref in n.inputs:
        src, k = split_ref(ref)
        shapes.append(tuple(by_id[src].outputs[k].shape))
    return shapes


def _labels_key(n: GraphNode):
    lab = n.labels
    return None if lab is None else (lab.inputs, lab.outputs, lab.reduce, lab.whole)


def enumerate_strategies(graph: GraphDocument, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...],
                         progress: Callable[[str, int, int], None] | None = None) -> dict[str, list[Strategy]]:
    """Strategies of every non-output node, generated once per distinct (kind, op, labels, shapes).

    ``progress("strategies", done, total)`` hears each node done."""
    by_id = graph.node_map()
    cache: dict = {}
    out: dict[str, list[Strategy]] = {}
    total = sum(n.kind != "output" for n in graph.nodes)
    for n in graph.nodes:
        if n.kind == "output":
            continue
        if progress is not None:
            progress("strategies", len(out), total)
        shapes = _in_shapes(n, by_id)
        key = (n.kind, n.op, _labels_key(n), tuple(shapes), tuple(tuple(o.shape) for o in n.outputs))
        if key not in cache:
            if n.kind == "op":
                cache[key] = op_strategies(n, shapes, mesh_shape, axis_names)
            else:
                cache[key] = placeholder_strategies(n, mesh_shape, axis_names)
        out[n.id] = cache[key]
    if progress is not None:
        progress("strategies", len(out), total)
    return out


def is_light(n: GraphNode) -> bool:
    """A follower candidate: an op without parameters doing little work per output element."""
    if n.kind != "op" or n.params or not n.inputs or n.labels is None:
        return False
    elems = sum(max(1, int(np.prod(o.shape))) for o in n.outputs)
    return n.fwd_flops <= LIGHT_FLOPS_PER_ELEM * elems


def _layer_signatures(nodes: list[GraphNode]) -> dict[str, str]:
    """node id -> id of the node it shares variables with (itself when not shared)."""
    instances: dict[tuple[str, int], list[GraphNode]] = {}
    for n in nodes:
        if n.layer is not None and n.layer_index is not None and n.kind != "output":
            instances.setdefault((n.layer, n.layer_index), []).append(n)
    first_of: dict[tuple, list[GraphNode]] = {}
    rep: dict[str, str] = {}
    for (layer, _), members in instances.items():
        pos = {m.id: i for i, m in enumerate(members)}
        sig = [layer]
        for m in members:
            wiring = tuple(("in", pos[split_ref(r)[0]], split_ref(r)[1]) if split_ref(r)[0] in pos else ("ext",)
                           for r in m.inputs)
            sig.append((m.kind, m.op, _labels_key(m), tuple(tuple(o.shape) for o in m.outputs),
                        tuple(o.dtype for o in m.outputs), wiring, m.fwd_flops, m.bwd_flops, m.saved_bytes,
                        m.transient_bytes, m.requires_grad, m.tied_to is None))
        key = tuple(sig)
        if key in first_of:
            for a, b in zip(members, first_of[key]):
                rep[a.id] = b.id
        else:
            first_of[key] = members
    return rep


def build_problem(graph: GraphDocument, strategies: dict[str, list[Strategy]], cost: CostModel,
                  memory: MemoryModel, *, follow: bool = True, share_layers: bool = True,
                  progress: Callable[[str, int, int], None] | None = None) -> Problem:
    """Map nodes to variables and collect their costs and memory terms (module docstring).

    ``progress("costs", done, total)`` hears each node done."""
    nodes = [n for n in graph.nodes if n.kind != "output"]
    builder = _ProblemBuilder(nodes, strategies, cost, memory, share_layers)
    for done, n in enumerate(nodes):
        if progress is not None:
            progress("costs", done, len(nodes))
        builder.add(n, follow)
    if progress is not None:
        progress("costs", len(nodes), len(nodes))
    return builder.folded()


class _ProblemBuilder:
    """The Problem of build_problem, node by node in graph order: each node becomes a follower or a
    root (``add``), its edges add to the costs of variable pairs and its placeholder or op terms to the
    memory terms; ``folded`` then moves what is separable into node costs."""

    def __init__(self, nodes: list[GraphNode], strategies: dict[str, list[Strategy]], cost: CostModel,
                 memory: MemoryModel, share_layers: bool):
        self.by_id = {n.id: n for n in nodes}
        self.strategies, self.cost, self.memory = strategies, cost, memory
        self.rg = tensor_requires_grad(nodes, cost.train)
        self.fan = fanouts(nodes)
        self.p = Problem(nodes=nodes, strategies=strategies)
        self.shared = _layer_signatures(nodes) if share_layers else {}
        self.compute = {n.id: np.array([cost.compute_s(n, s) for s in strategies[n.id]]) for n in nodes}
        #: (a, b) -> seconds per option pair of variables a < b, before folding
        self.pair: dict[tuple[int, int], np.ndarray] = {}
        self.gathered_cache: dict = {}

    def add(self, n: GraphNode, follow: bool) -> None:
        """Give ``n`` its variable (a follower's leader's, a repeated layer's twin's, or a new one) and
        add its costs and memory terms."""
        step = StepTerms(n.id, [], [], (0, np.zeros(1)))
        leader = self._leader(n) if follow else None
        if leader is not None:
            self._add_follower(n, leader, step)
        else:
            self._add_root(n, step)
        self._add_memory_terms(n, step)

    def _leader(self, n: GraphNode) -> tuple[int, str] | None:
        """(input index, ref) of the input a light op follows: the largest made by an op, first on ties."""
        by_id = self.by_id
        if not (is_light(n) and len(self.strategies[n.id]) > 1):
            return None
        cands = [(by_id[split_ref(r)[0]].outputs[split_ref(r)[1]].bytes, -k, k, r) for k, r in enumerate(n.inputs)
                 if by_id[split_ref(r)[0]].kind == "op"]
        return max(cands)[2:] if cands else None

    def _add_follower(self, n: GraphNode, leader: tuple[int, str], step: StepTerms) -> None:
        """``n`` reads its leader's variable: per option, its cheapest strategy (compute + that edge)."""
        p = self.p
        k0, ref0 = leader
        pv, _, m = self._edge_block(n, k0, ref0)
        total = m + self.compute[n.id][None, :]
        idx = np.argmin(total, axis=1)
        p.node_map[n.id] = (pv, idx)
        p.node_cost[pv] += total[np.arange(len(idx)), idx]
        for k, ref in enumerate(n.inputs):
            if k == k0:
                continue
            src_v, _, m = self._edge_block(n, k, ref)
            self._add_pair(src_v, pv, m[:, idx])
            g = self._gathered(n, k, ref, idx)
            if g is not None:
                self._add_pair_mem(g[0], pv, g[1], step)

    def _add_root(self, n: GraphNode, step: StepTerms) -> None:
        """``n`` owns a variable (or shares its repeated-layer twin's) whose options are its strategies."""
        p = self.p
        strats = self.strategies[n.id]
        twin = self.shared.get(n.id)
        if twin is not None and twin in p.node_map and p.var_owner[p.node_map[twin][0]] == twin:
            v = p.node_map[twin][0]
        else:
            v = len(p.var_sizes)
            p.var_sizes.append(len(strats))
            p.var_owner.append(n.id)
            p.node_cost.append(np.zeros(len(strats)))
        idx = np.arange(len(strats))
        p.node_map[n.id] = (v, idx)
        p.node_cost[v] += self.compute[n.id]
        for k, ref in enumerate(n.inputs):
            src_v, _, m = self._edge_block(n, k, ref)
            self._add_pair(src_v, v, m)
            g = self._gathered(n, k, ref, idx)
            if g is not None:
                self._add_pair_mem(g[0], v, g[1], step)

    def _add_memory_terms(self, n: GraphNode, step: StepTerms) -> None:
        """A placeholder's state and gradient terms, or an op's saved, transient and backward terms (with
        their tie-break costs)."""
        p, memory, cost = self.p, self.memory, self.cost
        strats = self.strategies[n.id]
        v, idx = p.node_map[n.id]
        if n.kind in ("param", "buffer", "input"):
            state = np.array([memory.state_bytes(n, strats[i]) for i in idx], dtype=float)
            p.node_cost[v] += cost.tie_break_s_per_byte * state
            if state.any():
                p.state_terms.append((v, state))
            grads = np.array([memory.grad_end_bound(n, strats[i]) for i in idx], dtype=float)
            if grads.any():
                p.grad_terms.append((v, grads))
        elif n.kind == "op":
            saved = np.array([memory.saved_bytes(n, strats[i]) for i in idx], dtype=float)
            trans = np.array([memory.transient_bytes(n, strats[i]) for i in idx], dtype=float)
            p.node_cost[v] += cost.tie_break_s_per_byte * saved
            step.saved.append((v, saved))
            step.transient = (v, trans)
            p.step_terms.append(step)
            extra = np.array([memory.backward_extra_bytes(n, strats[i]) for i in idx], dtype=float)
            if extra.any():
                p.backward_terms.append((v, extra))

    def _add_pair(self, a: int, b: int, m: np.ndarray) -> None:
        if a == b:
            self.p.node_cost[a] += np.diag(m)
            return
        if a > b:
            a, b, m = b, a, m.T
        self.pair[(a, b)] = self.pair[(a, b)] + m if (a, b) in self.pair else m.copy()

    def _edge_block(self, n: GraphNode, k: int, ref: str) -> tuple[int, np.ndarray, np.ndarray]:
        src, o = split_ref(ref)
        pv, pidx = self.p.node_map[src]
        src_pls = tuple(self.strategies[src][i].outputs[o] for i in pidx)
        meta = self.by_id[src].outputs[o]
        dtype = self.memory.moved_dtypes.get((n.id, k))
        m = self.cost.edge_matrix(src_pls, tuple(self.strategies[n.id]), k, meta.bytes, self.rg[src],
                                  self.fan[f"{src}#{o}"], None if dtype is None else bytes_as(meta.bytes, meta.dtype, dtype),
                                  self.cost.reduced_grad_nbytes(self.by_id[src], o, dtype),
                                  self.memory.regather and self.memory.train and self.by_id[src].kind == "param"
                                  and backward_keeps(n.op or "", len(n.inputs), k))
        return pv, pidx, m

    def _gathered(self, n: GraphNode, k: int, ref: str, cols: np.ndarray) -> tuple[int, np.ndarray] | None:
        """(param variable, bytes[param option, column]) of the saved copy of a gathered parameter."""
        src = self.by_id[split_ref(ref)[0]]
        if src.kind != "param":
            return None
        strategies = self.strategies
        pv, pidx = self.p.node_map[src.tied_to or src.id]
        owner = strategies[src.tied_to or src.id]
        # strategy lists are shared by identical nodes (enumerate_strategies), so their ids key the cache
        key = (id(strategies[n.id]), k, id(owner), src.outputs[0].bytes, n.labels and n.labels.rule,
               pidx.tobytes(), cols.tobytes(), self.memory.saved_casts.get(n.id, {}).get(k))
        mem = self.gathered_cache.get(key)
        if mem is None:
            mem = np.array([[self.memory.gathered_bytes(n, src, owner[i].outputs[0], strategies[n.id][j].inputs[k], k)
                             for j in cols] for i in pidx], dtype=float)
            self.gathered_cache[key] = mem
        return (pv, mem) if mem.any() else None

    def _add_pair_mem(self, a: int, b: int, m: np.ndarray, step: StepTerms) -> None:
        if a == b:
            step.saved.append((a, np.diag(m).copy()))
            return
        if a > b:
            a, b, m = b, a, m.T
        mats = self.p.pair_mem.setdefault((a, b), [])
        mats.append(m)
        step.pair_saved.append((a, b, len(mats) - 1))

    def folded(self) -> Problem:
        """The Problem, with single-option variables and separable matrices folded into node costs
        (pairs with memory terms stay)."""
        p, pair = self.p, self.pair
        for key in p.pair_mem:
            pair.setdefault(key, np.zeros((p.var_sizes[key[0]], p.var_sizes[key[1]])))
        for (a, b), m in sorted(pair.items()):
            if (a, b) in p.pair_mem:
                p.pair_cost[(a, b)] = m
            elif p.var_sizes[a] == 1:
                p.node_cost[b] += m[0]
            elif p.var_sizes[b] == 1:
                p.node_cost[a] += m[:, 0]
            else:
                row, col = m[:, :1], m[:1, :]
                rest = m - row - col + m[0, 0]
                if np.abs(rest).max() <= 1e-15:
                    p.node_cost[a] += row[:, 0] - m[0, 0]
                    p.node_cost[b] += col[0]
                else:
                    p.pair_cost[(a, b)] = m
        return p
