"""Per-device memory: the peak of live bytes over a steady-state training step, per phase.

What a rank holds (the runtime's ``verify`` measures the same: live tensor bytes on one rank over
a training step after the optimizer state exists):

* Always (``state_bytes``): each parameter's storage shard (bytes/k for a placement split into k
  pieces) and, training, its optimizer state (AdamW/Adam: two fp32 tensors, 8 bytes · numel/k; SGD
  without momentum and "none": nothing); inputs (possibly batch-sliced) and buffers. Tied
  parameters count once. Gradients are NOT always live: ``zero_grad`` sets them to None.
* Forward, node by node in order t (Alpa's per-step check):
  ``state + Σ_{i ≤ t} saved_i + transient_t``. A node's ``saved_bytes`` are its outputs kept for
  backward, scaled by each output's shard count (a Partial output is full size on every rank), and
  anything beyond its output bytes (internal intermediates: cross entropy's log-softmax, layer
  norm's mean and rstd) scaled by the strategy's shard factor, except for ops whose profile shows
  intermediates that the runtime's op does not keep (``KEEPS_ONLY_INPUTS``: mse_loss); ``transient_bytes`` (alive only
  while it runs) by the shard factor. A parameter consumed less sharded than stored (ZeRO:
  all-gather before use) leaves the gathered copy saved for the op's backward (``gathered_bytes``;
  embeddings save only their indices and are exempt). An activation that a consumer saves
  (``saves_input``: matmul-like ops, and any op whose backward reads it, such as RMSNorm's weight
  multiply) and takes through a redistribution is saved at the consumer's placement instead of the
  producer's; a reshape that was a view in the unsharded run but copies because a redistribution
  changed its input's memory layout adds that copy where a reader saves it (layout.py,
  ``relaid_copies``). Both ``predict`` only; the ILP's ``peak`` keeps the producer's. With ``regather``
  (plan ``execution.regather_params``) no gathered copy is saved: it lives while its consumer runs
  and, gathered again, during its consumer's backward where that backward keeps it
  (``regathered_param_bytes``, with the staging ``cat`` of an inner-dimension gather).
* Backward: ``state + Σ saved + max_n backward_extra_n``: what the backward of node ``n`` adds on top
  of everything saved (gradients of activations and parameters it creates, less the saved tensors
  already freed). Taken from the graph's memory section: for every backward event of the unsharded
  run, its live bytes minus what the model above holds (state + all saved, as the profile held
  them: ``KEEPS_ONLY_INPUTS``' intermediates included, since the profile's live bytes include them),
  kept per node (the largest), divided by that node's shard factor. One node per event, not only the unsharded peak:
  a sharding changes where the backward peaks (a replicated loss head whose logits' gradients peak
  at the backward's start beats a sharded MLP whose gradients peak in the middle).
* End of backward (gradient synchronization): ``state + Σ_params grad_computed + Σ_synced grad_stored``:
  every gradient as autograd produced it (the consumer's gradient placement: full size for a
  gathered parameter) plus, for gradients that need synchronization, the flat bucket (or the
  redistributed copy) at the parameter's storage placement. The ILP bounds this by twice the stored
  gradients.
* Optimizer step: ``state + Σ grad_stored + optimizer_extra`` (the per-parameter loop's temporaries:
  the unsharded run's optimizer peak minus params, grads and state, scaled like the largest parameter).

The peak is the maximum over all check points: ``peak`` is exactly the ILP's model (forward,
backward start, gradient bound); ``predict`` refines it where only a full assignment tells
(redistributed activations, gradients as computed, the optimizer step). The plan's prediction is
the larger of ``predict`` and the node-level walk of walk.py (backward node by node,
redistribution staging, checkpoint regions). Without a memory section in the graph
(synthetic graphs) the backward and optimizer extras are 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from cauto.plan import GraphNode, split_ref
from cauto.plan.dtypes import ITEMSIZE
from cauto.plan.precision import bytes_as
from cauto.solver.checkpoint.linearize import op_name
from cauto.solver.checkpoint.recompute import backward_keeps, read_inputs
from cauto.solver.cost.reshard import gather_staging_copies, retained_bytes
from cauto.solver.memory.casts import entry_casts
from cauto.solver.memory.layout import activation_inputs, layout_copies, needs_gradient
from cauto.solver.strategies.node import Strategy, output_placement, shard_count

OPTIMIZER_BYTES_PER_ELEM = {"adam": 8, "adamw": 8, "sgd": 0, "none": 0}

GLOO_GATHER_STAGING_COPIES = 1
"""Result-sized buffers gloo's ``all_gather_into_tensor`` holds beside its result while it runs (measured
on 4 gloo ranks: a 2 MiB shard gathered into 8 MiB peaks at 16 MiB); NCCL writes the result in place.
The meshes that cannot use all-to-all (``all_to_all`` False: the CPU presets) are the gloo ones. Counted
where a regathered copy is made (``regathered_param_bytes``), in backward beside the peak's gradients."""

KEEPS_ONLY_INPUTS = frozenset({"mse_loss"})
"""Ops whose profiled saved bytes beyond their outputs are not what the runtime keeps: the profile runs
on meta tensors, where these ops are decomposed above autograd (``mse_loss``: sub, pow, mean; ``pow``
keeps the difference, a whole input's size), while the runtime runs the aten op, whose backward keeps
only its inputs (checkpoint/recompute.py ``BACKWARD_READS``), which their producers count."""


def numel(node: GraphNode) -> int:
    """Elements of a placeholder's (first) output."""
    meta = node.outputs[0]
    if meta.shape or meta.bytes == 0:
        return math.prod(meta.shape)
    return meta.bytes // ITEMSIZE.get(meta.dtype, 4)


class MemoryModel:
    """Bytes per device of each node under each strategy (see module docstring)."""

    def __init__(self, mesh_shape: tuple[int, ...], optimizer: str, train: bool, all_to_all: bool = True):
        self.mesh_shape = tuple(mesh_shape)
        self.train = train
        #: whether redistributions use all-to-all (False on CPU meshes; reshard.retained_bytes)
        self.all_to_all = all_to_all
        self.opt_bytes_per_elem = OPTIMIZER_BYTES_PER_ELEM.get(optimizer, 8) if train else 0
        #: kept for callers that scale activations (checkpoint planning); 1.0: the model is not fitted
        self.activation_scale = 1.0
        #: node id -> unsharded bytes its backward adds on top of everything saved (module doc); the
        #: node's strategy's shard factor divides them
        self.backward_extras: dict[str, int] = {}
        #: unsharded temporaries of the optimizer step, and the largest parameter's bytes they scale with
        self.optimizer_extra = 0
        self._largest_param = 0
        #: mixed precision (casts.py): op id -> {input index: unsharded bytes of the compute-dtype copy of
        #: that input the op casts on entry and saves}; (op id, input index) -> dtype it moves in
        self.saved_casts: dict[str, dict[int, int]] = {}
        self.moved_dtypes: dict[tuple[str, int], str] = {}
        #: plan ``execution.regather_params``: a gathered parameter copy is not saved for backward but
        #: lives while its consumer runs and again, gathered anew, during its consumer's backward when
        #: that backward reads it (``regathered_param_bytes``)
        self.regather = False

    # ------------------------------------------------------------------ per-node terms
    def state_bytes(self, node: GraphNode, strategy: Strategy) -> int:
        """Always-live bytes of a placeholder: a param with its optimizer state, an input, a buffer."""
        if node.kind not in ("param", "buffer", "input") or node.tied_to:
            return 0
        k = shard_count(strategy.outputs[0], self.mesh_shape)
        b = node.outputs[0].bytes // k
        if node.kind != "param":
            return b
        opt = self.opt_bytes_per_elem * numel(node) // k if node.requires_grad is not False else 0
        return b + opt

    def grad_bytes(self, node: GraphNode, strategy: Strategy) -> int:
        """A parameter's gradient at its storage placement (0 when not training or frozen)."""
        if node.kind != "param" or node.tied_to or not self.train or node.requires_grad is False:
            return 0
        return node.outputs[0].bytes // shard_count(strategy.outputs[0], self.mesh_shape)

    def handed_over_grad(self, node: GraphNode, strategy: Strategy) -> bool:
        """Whether a parameter's gradient, once autograd has it, leaves the memory this model counts
        (chunked state: it is added into its gradient chunk and dropped): never here."""
        return False

    def saved_bytes(self, node: GraphNode, strategy: Strategy, moved_inputs: frozenset[int] = frozenset(),
                    as_profiled: bool = False) -> int:
        """Bytes this op keeps for backward, per device (outputs by their shards, the rest by the shard factor).

        Under mixed precision the compute-dtype copies of inputs the op casts on entry are counted at
        the placement the op reads each input in, except those of ``moved_inputs``: inputs that reach it
        redistributed, whose copy (moved in the compute dtype, shared by its readers) is counted where
        it is made (``saved_after_redistribution``, ``gathered_bytes``)."""
        cast_part, outputs, rest = self.saved_parts(node, strategy, moved_inputs, as_profiled)
        return cast_part + sum(outputs) + rest

    def saved_parts(self, node: GraphNode, strategy: Strategy, moved_inputs: frozenset[int] = frozenset(),
                    as_profiled: bool = False) -> tuple[int, list[int], int]:
        """``saved_bytes`` in its parts, per device: the entry casts' copies, each output's kept bytes
        (the first of the profile's saved bytes, up to the output's size), and the rest (internal
        intermediates; none for ``KEEPS_ONLY_INPUTS`` ops unless ``as_profiled``)."""
        if node.kind != "op" or not node.saved_bytes or not self.train:
            return 0, [], 0
        saved = int(node.saved_bytes * self.activation_scale)
        casts = self.saved_casts.get(node.id)
        cast_part = 0
        if casts and sum(casts.values()) <= saved:
            saved -= sum(casts.values())
            cast_part = sum(int(b * self.activation_scale) // shard_count(strategy.inputs[k], self.mesh_shape)
                            for k, b in casts.items() if k not in moved_inputs and k < len(strategy.inputs))
        outputs, left = [], saved
        for o, meta in enumerate(node.outputs):
            b = min(left, meta.bytes)
            if b <= 0:
                break
            k = shard_count(strategy.outputs[o], self.mesh_shape) if o < len(strategy.outputs) else 1
            outputs.append(b // k)
            left -= b
        if op_name(node.op or "") in KEEPS_ONLY_INPUTS and not as_profiled:
            left = 0
        return cast_part, outputs, left // max(1, strategy.shard_factor)

    def transient_bytes(self, node: GraphNode, strategy: Strategy) -> int:
        """Bytes alive only while this op runs, per device."""
        if node.kind != "op" or not node.transient_bytes:
            return 0
        return int(node.transient_bytes * self.activation_scale) // strategy.shard_factor

    def backward_extra_bytes(self, node: GraphNode, strategy: Strategy) -> int:
        """What the backward of ``node`` adds to everything saved (module doc), per device: the calibrated
        extra divided by the node's shard factor, except the part that is its kernel's in-call scratch
        (``backward_workspace_bytes``), which a sharding does not shrink."""
        extra = self.backward_extras.get(node.id, 0) if self.train else 0
        scratch = min(extra, self.backward_workspace_bytes(node))
        return (extra - scratch) // max(1, strategy.shard_factor) + scratch

    def backward_extra_beside_workspace(self, node: GraphNode, strategy: Strategy) -> int:
        """``backward_extra_bytes`` less the kernel's scratch (walk.py counts the scratch itself)."""
        extra = self.backward_extras.get(node.id, 0) if self.train else 0
        return (extra - min(extra, self.backward_workspace_bytes(node))) // max(1, strategy.shard_factor)

    def backward_workspace_bytes(self, node: GraphNode) -> int:
        """The in-call scratch of the node's backward kernel (graph ``bwd_workspace_bytes``), per device at
        any sharding: measured kernels (oneDNN's convolutions, bf16 matmuls) allocate scratch whose size
        follows their algorithm choice, not the batch (a bf16 convolution's backward: 559 KB at batch 1,
        583 KB at batch 4), so it is counted whole."""
        return int(node.bwd_workspace_bytes or 0) if self.train else 0

    def grad_end_bound(self, node: GraphNode, strategy: Strategy) -> int:
        """ILP bound of a parameter's gradient bytes at the end of backward: computed + synchronized copy."""
        return 2 * self.grad_bytes(node, strategy)

    def gathered_bytes(self, consumer: GraphNode, param: GraphNode, stored: tuple[str, ...],
                       needed: tuple[str, ...], arg: int = -1) -> int:
        """Bytes of a parameter copy redistributed for ``consumer`` (its input ``arg``) and saved for its
        backward: in the dtype the consumer computes with (its entry cast under mixed precision). None
        is saved where the plan gathers parameters again in backward (``regather``)."""
        if self.regather:
            return 0
        return self.gathered_copy_bytes(consumer, param, stored, needed, arg)

    def regathered_param_bytes(self, consumer: GraphNode, by_id: Mapping[str, GraphNode],
                               chosen: Mapping[str, Strategy], backward: bool) -> tuple[int, int]:
        """With ``regather``: (bytes of the parameter copies gathered for ``consumer``, the most bytes
        gathering one of them stages beside it). The copies are live while it runs (``backward`` False:
        every such copy) or while its backward runs (True: the copies its backward reads,
        ``BACKWARD_READS``, gathered again just before it); the staging only while the copy is made:
        cost/reshard.py ``gather_staging_copies`` (an all-gather of an inner dimension gathers the
        chunks stacked on dimension 0, then ``cat``s them into place) or, on gloo, the output-sized
        buffer its all-gather fills first (``GLOO_GATHER_STAGING_COPIES``), whichever is larger.
        (0, 0) without ``regather``."""
        if not self.regather or not self.train:
            return 0, 0
        s = chosen[consumer.id]
        total = staging = 0
        for k, ref in enumerate(consumer.inputs):
            src = by_id.get(split_ref(ref)[0])
            if src is None or src.kind != "param" or k >= len(s.inputs):
                continue
            if backward and not backward_keeps(consumer.op or "", len(consumer.inputs), k):
                continue
            stored = output_placement(chosen, src)
            copy = self.gathered_copy_bytes(consumer, src, stored, s.inputs[k], k)
            total += copy
            staging = max(staging, copy * max(gather_staging_copies(stored, s.inputs[k], self.mesh_shape),
                                              GLOO_GATHER_STAGING_COPIES if not self.all_to_all else 0))
        return total, staging

    def gathered_copy_bytes(self, consumer: GraphNode, param: GraphNode, stored: tuple[str, ...],
                            needed: tuple[str, ...], arg: int = -1) -> int:
        """Bytes per device of a parameter copy redistributed for ``consumer`` (its input ``arg``)
        (``gathered_bytes``, whether saved or not)."""
        if not self.train or param.kind != "param" or stored == needed:
            return 0
        if consumer.labels is not None and consumer.labels.rule == "embedding":
            return 0
        nbytes = param.outputs[0].bytes
        if arg in self.saved_casts.get(consumer.id, {}):
            nbytes = self.saved_casts[consumer.id][arg]
        return nbytes // shard_count(needed, self.mesh_shape)

    # ------------------------------------------------------------------ the peak of a full assignment
    def peak(self, nodes: list[GraphNode], chosen: dict[str, Strategy]) -> tuple[int, int, int, int]:
        """The ILP's model (exactly what its constraints say): (peak bytes, always-live state bytes,
        the rest at the peak, index of the peak step).

        The peak step is the forward node index, or the last op's index for the backward start and
        the phases after it."""
        return self.breakdown(nodes, chosen, exact=False)[:4]

    def predict(self, nodes: list[GraphNode], chosen: dict[str, Strategy]) -> tuple[int, int, int, int]:
        """Like ``peak``, with what only a full assignment shows (the plan's predictions): activations
        saved after a redistribution, gradients as computed and synchronized, the optimizer step."""
        return self.breakdown(nodes, chosen, exact=True)[:4]

    def breakdown(self, nodes: list[GraphNode], chosen: dict[str, Strategy],
                  exact: bool = True) -> tuple[int, int, int, int, str]:
        """``predict`` (``peak`` when not ``exact``) plus the phase holding the peak: "forward",
        "backward", "grad_sync" or "optimizer"."""
        by_id = {n.id: n for n in nodes}
        state = sum(self.state_bytes(n, chosen[n.id]) for n in nodes if n.id in chosen)
        moved, direct = redistributed_saves(nodes, chosen, self.moved_dtypes) if exact else ({}, set())
        copies = relaid_copies(self, nodes, chosen) if exact else {}
        cum, best, best_t = 0, 0, 0
        last_t = 0
        bwd_extra = 0
        for t, n in enumerate(nodes):
            if n.id not in chosen or n.kind != "op":
                continue
            s = chosen[n.id]
            last_t = t
            cum += self.saved_after_redistribution(n, s, moved, direct,
                                                   input_placements(n, by_id, chosen) if exact else None)
            cum += copies.get(n.id, 0)
            for k, ref in enumerate(n.inputs):
                src = by_id.get(split_ref(ref)[0])
                if src is not None and src.kind == "param" and k < len(s.inputs):
                    cum += self.gathered_bytes(n, src, output_placement(chosen, src), s.inputs[k], k)
            again, staging = self.regathered_param_bytes(n, by_id, chosen, backward=True)
            bwd_extra = max(bwd_extra, self.backward_extra_bytes(n, s) + again + staging)
            again, staging = self.regathered_param_bytes(n, by_id, chosen, backward=False)
            live = cum + again + max(self.transient_bytes(n, s), staging)
            if live >= best:
                best, best_t = live, t
        phase = "forward"
        if self.train and cum + bwd_extra > best:
            best, best_t, phase = cum + bwd_extra, last_t, "backward"
        if self.train and not exact:
            grads = sum(self.grad_end_bound(n, chosen[n.id]) for n in nodes if n.id in chosen)
            if grads > best:
                best, best_t, phase = grads, last_t, "grad_sync"
        elif self.train:
            computed, stored_all, synced = self.gradient_bytes(nodes, chosen, by_id)
            if computed + synced > best:
                best, best_t, phase = computed + synced, last_t, "grad_sync"
            opt = stored_all + self.optimizer_extra_bytes(nodes, chosen)
            if opt > best:
                best, best_t, phase = opt, last_t, "optimizer"
        return state + best, state, best, best_t, phase

    def saved_after_redistribution(self, n: GraphNode, s: Strategy, moved: dict, direct: set,
                                   input_placements: list | None = None) -> int:
        """saved_bytes, with outputs that only reach the consumers that save them (``saves_input``) by
        redistribution saved at their placement (in the dtype they move in). ``input_placements``: where each input of ``n`` is
        produced (inputs that reach ``n`` redistributed are counted where they are made)."""
        moved_inputs = frozenset(k for k, pl in enumerate(input_placements or ())
                                 if pl is not None and k < len(s.inputs) and pl != s.inputs[k])
        base = self.saved_bytes(n, s, moved_inputs)
        if n.kind != "op" or not self.train:
            return base
        for o, meta in enumerate(n.outputs):
            key = f"{n.id}#{o}"
            if key not in moved or o >= len(s.outputs):
                continue
            # the consumer saves the whole value at its placement, even when the producer saves none of
            # it (a view: the storage's producer saves it, at its own placement, for its own backward)
            at_src = min(int((n.saved_bytes or 0) * self.activation_scale), meta.bytes) \
                // shard_count(s.outputs[o], self.mesh_shape)
            copies = sum(retained_bytes(s.outputs[o], pl, int(bytes_as(meta.bytes, meta.dtype, dtype)
                                                              * self.activation_scale),
                                        self.mesh_shape, self.all_to_all) for pl, dtype in moved[key])
            base += copies - (0 if key in direct else at_src)
        return base

    def gradient_bytes(self, nodes, chosen, by_id) -> tuple[int, int, int]:
        """(Σ gradients as autograd leaves them, Σ gradients at storage placement, Σ synchronized copies)."""
        computed_pl: dict[str, tuple] = {}
        for n in nodes:
            if n.kind != "op" or n.id not in chosen:
                continue
            s = chosen[n.id]
            for k, ref in enumerate(n.inputs):
                src = by_id.get(split_ref(ref)[0])
                if src is not None and src.kind == "param" and k < len(s.input_grads):
                    computed_pl.setdefault(src.tied_to or src.id, s.input_grads[k])
        computed = stored_all = synced = 0
        for n in nodes:
            if n.kind != "param" or n.id not in chosen:
                continue
            stored = self.grad_bytes(n, chosen[n.id])
            if not stored:
                continue
            stored_all += stored
            grad_pl = computed_pl.get(n.id, chosen[n.id].outputs[0])
            computed += n.outputs[0].bytes // shard_count(grad_pl, self.mesh_shape)
            if grad_pl != chosen[n.id].outputs[0]:
                synced += stored
        return computed, stored_all, synced

    def recompute_pinned_bytes(self, by_id: dict, chosen: dict[str, Strategy], region: set[str]) -> int:
        """Bytes a region's recomputation holds besides activations: none here (parameters stay on the
        device; offload/memory.py's chunks are fetched again)."""
        return 0

    def optimizer_extra_bytes(self, nodes, chosen) -> int:
        """The optimizer step's temporaries per device: the unsharded run's, scaled like the largest
        parameter (module doc)."""
        if not self.optimizer_extra or not self._largest_param:
            return 0
        largest = max((n.outputs[0].bytes // shard_count(chosen[n.id].outputs[0], self.mesh_shape)
                       for n in nodes if n.kind == "param" and n.id in chosen and not n.tied_to), default=0)
        return self.optimizer_extra * largest // self._largest_param

    # ------------------------------------------------------------------ what the unsharded run says
    def _set_casts(self, nodes: list[GraphNode]) -> None:
        """``saved_casts`` and ``moved_dtypes`` of a mixed-precision graph (casts.py): an op that keeps
        its inputs for backward keeps the compute-dtype copies of the ones it casts (those of two or
        more dimensions: activations and weights, not biases)."""
        by_id = {n.id: n for n in nodes}
        casts = entry_casts(nodes)
        self.moved_dtypes = casts
        self.saved_casts = {}
        for (node_id, k), dtype in casts.items():
            n = by_id[node_id]
            src_id, o = split_ref(n.inputs[k])
            meta = by_id[src_id].outputs[o]
            if saves_inputs(n) and len(meta.shape) >= 2:
                self.saved_casts.setdefault(node_id, {})[k] = bytes_as(meta.bytes, meta.dtype, dtype)

    def calibrate(self, nodes: list[GraphNode], replicated: dict[str, Strategy], measured_peak: int,
                  memory: Mapping | None = None) -> None:
        """Take the backward-start and optimizer extras from the graph's memory section (module doc).

        ``memory`` is the graph document's ``memory`` (peak_bytes, phases, timeline); with only
        ``measured_peak`` the backward extra is the part of that peak the model above lacks."""
        self.activation_scale = 1.0
        self.optimizer_extra = 0
        self.backward_extras = {}
        self._set_casts(nodes)
        memory = dict(memory or {})
        phases = memory.get("phases") or {}
        if not self.train:
            return
        ops = [n for n in nodes if n.kind == "op" and n.id in replicated]
        params = [n for n in nodes if n.kind == "param" and not n.tied_to and n.id in replicated]
        state = sum(self.state_bytes(n, replicated[n.id]) for n in nodes if n.id in replicated)
        # as the profile held them: its timeline's live bytes include what KEEPS_ONLY_INPUTS drops
        saved = sum(self.saved_bytes(n, replicated[n.id], as_profiled=True) for n in ops)
        grads = sum(self.grad_bytes(n, replicated[n.id]) for n in params)
        self._largest_param = max((n.outputs[0].bytes for n in params), default=0)
        known = {n.id for n in ops}
        extras: dict[str, int] = {}
        for event in memory.get("timeline") or []:
            _, phase, node_id, live = event
            if phase == "backward" and node_id in known and live - state - saved > extras.get(node_id, 0):
                extras[node_id] = int(live - state - saved)
        if not extras:  # no timeline: the whole backward peak (or the measured one) at the last op
            backward_peak = int(phases.get("backward") or 0) or (0 if phases else int(measured_peak or 0))
            if backward_peak > state + saved and ops:
                extras[ops[-1].id] = backward_peak - state - saved
        self.backward_extras = _undominated(extras, self.mesh_shape)
        optimizer_peak = int(phases.get("optimizer") or 0)
        if optimizer_peak:
            self.optimizer_extra = max(0, optimizer_peak - state - grads)


def input_placements(n: GraphNode, by_id: Mapping[str, GraphNode], chosen: Mapping[str, Strategy]) -> list:
    """Where each input of ``n`` is produced (``output_placement``), None for inputs without a plan."""
    out = []
    for ref in n.inputs:
        src_id, o = split_ref(ref)
        src = by_id.get(src_id)
        known = src is not None and (src.tied_to or src_id) in chosen and src.kind in ("op", "param", "input")
        out.append(output_placement(chosen, src, o) if known else None)
    return out


def redistributed_saves(nodes: list[GraphNode], chosen: Mapping[str, Strategy],
                        moved_dtypes: Mapping[tuple[str, int], str] | None = None,
                        ) -> tuple[dict[str, dict[tuple, str]], set[str]]:
    """Activations a consumer saves after a redistribution (``saves_input``): (producer ref "id#o" ->
    {(placement it is saved at, dtype it moves in or None): the first consumer, in forward order, that
    saves it there}, producer refs some consumer also takes directly)."""
    moved_dtypes = moved_dtypes or {}
    moved: dict[str, dict[tuple, str]] = {}
    direct: set[str] = set()
    grads: dict[str, bool] = {}
    for n in nodes:
        grads[n.id] = needs_gradient(n, grads)
    for n, k, key, taken_as_made in activation_inputs(nodes, chosen):
        if taken_as_made:
            direct.add(key)
        elif saves_input(n, k, grads):
            moved.setdefault(key, {}).setdefault((chosen[n.id].inputs[k], moved_dtypes.get((n.id, k))), n.id)
    return moved, direct


#: at most this many nodes keep a backward extra (each is one memory constraint of the ILP)
MAX_BACKWARD_EXTRAS = 4


def _undominated(extras: dict[str, int], mesh_shape: tuple[int, ...]) -> dict[str, int]:
    """Drop nodes whose extra, even unsharded, is below another's extra fully sharded; keep the
    ``MAX_BACKWARD_EXTRAS`` largest of the rest (the peak node is always kept)."""
    if not extras:
        return {}
    devices = math.prod(mesh_shape) or 1
    floor = max(extras.values()) // devices
    kept = sorted(((b, n) for n, b in extras.items() if b >= floor), reverse=True)[:MAX_BACKWARD_EXTRAS]
    return {n: b for b, n in kept}


def saves_inputs(node: GraphNode) -> bool:
    """Whether an op keeps its (activation) inputs for backward: matmuls, attention, convolutions, norms."""
    lab = node.labels
    return lab is not None and lab.rule in _SAVES_INPUTS


_SAVES_INPUTS = {"matmul", "attention", "convolution", "norm"}


def saves_input(node: GraphNode, k: int, grads: Mapping[str, bool]) -> bool:
    """Whether op ``node`` keeps its input ``k`` for backward: a matmul-like op (``saves_inputs``) its
    activations, any op its backward reads for the gradient of an input that needs one (checkpoint/
    recompute.py ``BACKWARD_READS``; ``grads``: node id -> its outputs need a gradient). RMSNorm's
    weight multiply (a pointwise ``mul``) keeps its activation for the weight's gradient: taken through
    a redistribution, it keeps the redistributed copy."""
    if saves_inputs(node):
        return True
    read = read_inputs(node.op, [grads.get(split_ref(ref)[0], False) for ref in node.inputs])
    return read is not None and k in read


def relaid_copies(memory: MemoryModel, nodes: list[GraphNode], chosen: Mapping[str, Strategy]) -> dict[str, int]:
    """op id -> bytes per device of the copy a reshape makes, and a reader saves, where the plan's
    redistributions changed its input's memory layout (layout.py), when training."""
    return layout_copies(nodes, chosen, memory.mesh_shape, saves_input) if memory.train else {}
