"""The plan's program lowered to plain local tensors: one forward and one backward graph per rank.

``execute.build`` writes the plan as a program on DTensors. Run as it is, every ATen op of it pays
DTensor's sharding propagation and wrapping in Python, forward and backward (the interpreter cost
measured in tools/bench/bench_runtime_overhead.py). ``LocalProgram`` traces that program once,
before the first step, with AOTAutograd: DTensor parameters and inputs are unwrapped into their local
shards, each DTensor op is replaced by the local ATen ops DTensor would run, and each
redistribution by the functional collectives it issues (``_c10d_functional.all_gather_into_tensor``,
``all_reduce``, ``reduce_scatter_tensor``, ... each followed by its ``wait_tensor`` where the result is
first used). The joint graph is partitioned into a forward and a backward graph, so the backward's
collectives are explicit lines too. What runs per step is those two graphs on plain tensors, with
one autograd node for the whole step; DTensor remains only at the boundary: parameters, their
gradients and optimizer state stay DTensors (``state_dict``, ``torch.distributed.checkpoint`` and torch
optimizers keep working), unwrapped on entry and wrapped on exit.

Why AOTAutograd rather than a hand-written local-rule per op: the local graph is exactly what
DTensor executes (same kernels, same collectives, same order), so parity, the plan's collective
counts and its memory predictions carry over unchanged; the tracing costs about a second once.

``compile=True`` hands both graphs to inductor (``torch.compile``'s backend) instead of running them
as Python. The text of each graph, collective lines annotated with their mesh axis and bytes, is
what runs (``execute.compile_with_comments``) and what ``cauto codegen`` shows.

Mixed precision (plan ``execution.mixed_precision``): the program is traced under
``torch.autocast(device, compute_dtype)``, so the casts autocast would make in eager are explicit
``_to_copy`` lines of the forward graph (fp32 parameters in, bf16 copies into matmuls), and their
backward casts the gradients back to the parameters' fp32; the graphs then run without autocast.
Where such an op's fp32 input is redistributed (an all-gathered parameter or activation), the program
(execute.py) casts the shard first and moves bf16 (``redistribute(forward_dtype=bf16)``, cauto.plan.precision):
half the bytes, one bf16 copy shared by the op's readers; the gradient's collective runs in fp32.
Autocast, the plan's and any the caller has entered around the call, is part of the trace key: an
fp32 and a bf16 lowering never share an entry.

A lowered program is traced for one set of input shapes and dtypes and one grad mode; a call with
others traces again (a few per model at most: training and evaluation). Gradient accumulation
(``ParallelModule.no_sync``) traces a second training variant whose backward leaves the plain
parameters' gradients unreduced (``reduce_grads=False``): micro-batches accumulate local gradients,
and GradSync reduces the accumulated ones in buckets after the last micro-batch's backward.
"""

from __future__ import annotations

import contextlib
import copy as _copy
import functools

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cauto.profiler.capture import tensor_bytes
from cauto.runtime.grad_sync import reduction_dtype

COLLECTIVE_NAMESPACE = "_c10d_functional"


def autocast_state(device_type: str) -> tuple:
    """The caller's autocast on ``device_type`` as a trace key: (enabled, dtype), (False, None) when off."""
    if not torch.is_autocast_enabled(device_type):
        return (False, None)
    return (True, torch.get_autocast_dtype(device_type))


def _signature(x) -> tuple:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.requires_grad, x.device.type)
    return (type(x).__name__,)


def mesh_axis_of_group(mesh: DeviceMesh, group_name: str) -> int | None:
    """The axis of ``mesh`` whose process group is ``group_name``, or has its ranks: None for another name.

    DTensor caches a redistribution's plan by mesh equality, so in a process that built an equal mesh
    before (a second ``autoparallelize`` of the same plan, a notebook, a test session) the program may
    issue a collective on the earlier mesh's group of the same ranks: the same axis."""
    import torch.distributed as dist

    for axis in range(mesh.ndim):
        if mesh.get_group(axis).group_name == group_name:
            return axis
    try:
        ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group_name))
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return None
    return next((axis for axis in range(mesh.ndim)
                 if dist.get_process_group_ranks(mesh.get_group(axis)) == ranks), None)


def _axis_label(mesh: DeviceMesh, axis: int) -> str:
    return f"mesh axis {axis} ({(mesh.mesh_dim_names or [str(a) for a in range(mesh.ndim)])[axis]})"


def _node_bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return tensor_bytes(val) if isinstance(val, torch.Tensor) else 0


def annotate_collectives(gm: torch.fx.GraphModule, mesh: DeviceMesh) -> list[dict]:
    """Give each collective node of ``gm`` a comment (op, mesh axis, bytes); return them as records."""
    records = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or COLLECTIVE_NAMESPACE not in str(node.target):
            continue
        op = str(node.target).split(".")[1].rstrip("_")  # all_reduce_ (in place) is an all_reduce
        if op == "wait_tensor":
            node.meta["cauto_comment"] = "wait for the collective above: first use of its result"
            continue
        axis = next((a for a in (mesh_axis_of_group(mesh, x) for x in node.args if isinstance(x, str))
                     if a is not None), None)
        nbytes = _node_bytes(node)
        where = _axis_label(mesh, axis) if axis is not None else "a group outside the mesh"
        node.meta["cauto_comment"] = f"COLLECTIVE {op} over {where}: {nbytes} bytes out"
        records.append({"op": op, "axis": where, "bytes": nbytes, "node": node.name})
    return records


def _partition_with_regions(joint: torch.fx.GraphModule, joint_inputs, *, regather: bool = False, **kwargs):
    """AOTAutograd's default partition (save what backward needs), except that every op of a plan's
    checkpoint region (annotated by ``ops.checkpointed`` while tracing) is recomputed in backward from
    the region's inputs instead of saved: the region's activations are freed after forward. With
    ``regather`` (plan ``execution.regather_params``), each gathered parameter is gathered again in
    backward too (``_mark_regathered``)."""
    from torch._functorch.partitioners import default_partition
    from torch.utils.checkpoint import CheckpointPolicy

    from cauto.runtime.ops import REGION_ANNOTATION

    regions: dict[str, int] = {}
    region_of: dict[torch.fx.Node, str] = {}
    for node in joint.graph.nodes:
        region = (node.meta.get("custom") or {}).get(REGION_ANNOTATION)
        if region is not None and node.op == "call_function":
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = regions.setdefault(region, len(regions))
            region_of[node] = region
            _unseed(node)
    # A region's output read by a forward op outside every region is saved, as torch.utils.checkpoint
    # keeps what its function returns: recomputing it would rerun the whole region for that consumer's
    # backward, ahead of the region's own (solver memory/walk.py counts it saved until that backward).
    backward = _tangent_dependents(joint)
    for node in region_of:
        if any(user not in region_of and user not in backward and user.op == "call_function"
               for user in node.users):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    if regather:
        _mark_regathered(joint, backward, first_id=len(regions))
    return default_partition(joint, joint_inputs, **kwargs)


def _mark_regathered(joint: torch.fx.GraphModule, backward: set[torch.fx.Node], first_id: int) -> None:
    """Recompute in backward every gathered copy of a program input (FSDP's reshard after forward; plan
    ``execution.regather_params``): for each primal input of the joint graph (a parameter's local shard,
    or a user input), the forward ops that read nothing but it and each other (its cast, all-gather,
    wait, the reshapes that put the gathered chunks in place, the transpose a linear reads) are
    recomputed where backward first reads them, not saved, when they include an all-gather: the copy
    dies after its last forward use and lives again from just before its consumer's backward to that
    backward's end (the partition reorders recomputed ops to their first backward use, as the autograd
    engine would run them). An input without an all-gather in that chain (replicated, or sharded as it
    is used) is left as it is. Each chain is its own recompute group, numbered after the checkpoint
    regions (``first_id``): torch saves a recomputed value that feeds a later-numbered group, so a
    gathered copy read inside a region is gathered again there rather than kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    group = first_id
    for primal in [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]:
        chain = {primal}
        for node in joint.graph.nodes:
            if node.op == "call_function" and node not in backward and node.all_input_nodes \
                    and all(arg in chain for arg in node.all_input_nodes):
                chain.add(node)
        chain.discard(primal)
        if not any("all_gather" in str(node.target) for node in chain):
            continue
        for node in chain:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = group
        group += 1


def _tangent_dependents(joint: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The joint graph's backward: every node that depends on a tangent input."""
    out: set[torch.fx.Node] = set()
    for node in joint.graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) \
                or any(arg in out for arg in node.all_input_nodes):
            out.add(node)
    return out


def _drop_dead_ops(gm: torch.fx.GraphModule) -> None:
    """Remove ops whose results nothing uses. AOTAutograd keeps two kinds of dead ops in its graphs:
    ops torch tags as random (a second CPU flash-attention forward per layer in the backward graph,
    outputs dropped), in case they advance the RNG, and collectives, in case a rank would skip one
    (a forward all-gather copied into the backward graph, its result waited for and dropped). None of
    our random ops draws a number that matters (attention without dropout), and every rank lowers the
    same program, so every rank drops the same collectives. Mutations (BatchNorm statistics written
    back) stay, and a collective stays unless its one user is a dead wait."""
    graph = gm.graph
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.users or node.op in ("placeholder", "output"):
                continue
            collective = COLLECTIVE_NAMESPACE in str(node.target)
            if collective or not node.is_impure(impure_random=False):
                graph.erase_node(node)
                changed = True
    gm.recompile()


class LoweringError(ValueError):
    """The plan's program cannot be lowered to a local program; the message names the node and what to do."""


def _lowering_failure(exc: BaseException, program: torch.fx.GraphModule | None = None,
                      plan_nodes: dict | None = None) -> str:
    """One line for a trace that failed: the program node whose line raised (plan.nodes id; for a
    redistribution the runtime inserted, the plan node it feeds), its module path and its planned
    placements, and why."""
    import re
    import traceback

    from cauto.profiler.capture import module_path

    name = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith("<eval_with_key"):
            match = re.match(r"\s*(\w+) = ", frame.line or "")
            if match and name is None:
                name = match.group(1)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    where = ""
    if name:
        node = next((n for n in program.graph.nodes if n.name == name), None) if program is not None else None
        planned = (plan_nodes or {}).get(name)
        fed = node
        while planned is None and fed is not None and len(fed.users) == 1:  # an inserted redistribution
            (fed,) = fed.users
            planned = (plan_nodes or {}).get(fed.name)
        details = []
        if fed is not None and fed is not node:
            details.append(f"feeding plan node {fed.name!r}")
        if fed is not None and module_path(fed):
            details.append(f"module {module_path(fed)}")
        if planned is not None:
            pl = lambda xs: " ".join("[" + ",".join(p) + "]" for p in xs)  # noqa: E731
            details.append(f"planned inputs {pl(planned.get('inputs', []))} -> outputs {pl(planned.get('outputs', []))}")
        where = f"at program node {name!r}" + (f" ({'; '.join(details)})" if details else "")
    if "Inductor" in type(exc).__name__ or "BackendCompiler" in type(exc).__name__:
        return (f"torch.compile (inductor) could not compile the local program {where}: {type(exc).__name__}: "
                f"{first}; run without compile (--compile)")
    return (f"the plan cannot run as a program {where}: {type(exc).__name__}: {first}; "
            "the placements there are not ones DTensor can execute: solve the plan again (cauto plan), or "
            "give that module's parameters other placements")


@torch.library.custom_op("cauto::flash_attention_cpu_recomputable", mutates_args=())
def flash_attention_cpu_recomputable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     dropout_p: float = 0.0, is_causal: bool = False,
                                     attn_mask: torch.Tensor | None = None,
                                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention without dropout, as an op torch does not tag random: a checkpoint region
    recomputes it in backward with no RNG state to save or restore (``_unseed``), as Python and under
    inductor alike (inductor takes it as an extern kernel)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


@flash_attention_cpu_recomputable.register_fake
def _(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


_RECOMPUTABLE = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
                 torch.ops.cauto.flash_attention_cpu_recomputable.default}


def _unseed(node: torch.fx.Node) -> None:
    """A recomputed op that torch tags as random (CPU flash attention) but that draws no random number
    here (dropout 0) becomes the same computation as an untagged op (``flash_attention_cpu_recomputable``):
    recomputing it needs no saved RNG state. One with dropout cannot be recomputed bit-identically:
    refused."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return
    dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    if target not in _RECOMPUTABLE or dropout != 0.0:
        raise LoweringError(
            f"checkpoint region op {node.name} ({target}) draws random numbers, and the local program cannot "
            "recompute it with the same ones; plan without checkpointing that module, or pass lowering='dtensor'")
    node.target = _RECOMPUTABLE[target]


class _AsReplicated(torch.autograd.Function):
    """A plain (replicated) parameter as a Replicate DTensor for the program. In backward its gradient,
    Partial on the data-parallel axes, is reduced to Replicate right where autograd finishes it: in the
    traced backward graph that is an all-reduce issued as soon as the gradient exists and waited for at
    the end, which ``bucket_gradient_reductions`` then groups into buckets (DDP's overlap). ``record``
    receives the gradient's placements once reduced (Replicate), while tracing."""

    @staticmethod
    def forward(ctx, x, mesh, record, reduce_in_graph):
        from torch.distributed.tensor import Replicate

        ctx.record, ctx.mesh, ctx.reduce_in_graph = record, mesh, reduce_in_graph
        return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import Replicate

        if isinstance(grad, DTensor):
            # Partial on one axis: one all-reduce, bucketed in the graph. On several axes (data parallel
            # over a 2-D mesh) the gradient is left Partial: GradSync reduces it in buckets after backward.
            # Compiled, inductor would get one all-reduce per parameter: GradSync buckets them instead.
            if ctx.reduce_in_graph and sum(not isinstance(g, Replicate) for g in grad.placements) == 1:
                grad = grad.redistribute(ctx.mesh, [Replicate()] * ctx.mesh.ndim)
            ctx.record(tuple(grad.placements))
            grad = grad._local_tensor
        return grad, None, None, None


def bucket_gradient_reductions(gm: torch.fx.GraphModule, mesh: DeviceMesh, bucket_bytes: int,
                               reduce_dtype: torch.dtype | None = None, plain: set[int] | frozenset = frozenset()
                               ) -> tuple[list[tuple], list[tuple[int, int]]]:
    """Group the backward graph's gradient all-reduces (an all-reduce whose waited result is only returned)
    into buckets of at most ``bucket_bytes``, in the order the gradients appear: each bucket is one
    in-place all-reduce of the gradients concatenated into one flat buffer, issued where its last
    gradient is ready and waited for only before the graph returns, so it runs while the rest of
    backward computes; the reduced gradients are views of the buffer (no copy back, and no second
    buffer: the out-of-place functional all-reduce would clone it). The buffer lives as long as the
    gradients that view it: a buffer kept across steps (DDP's) would add its bytes to the peak that
    the plan predicts. ``reduce_dtype`` (mixed precision's bf16 reduction): a floating bucket of another
    dtype is cast to it before the all-reduce and back after the wait (the concatenated buffer is freed
    at the cast; the gradients view the cast-back buffer), as FSDP2's ``reduce_dtype``.

    Two kinds of all-reduce end in a returned gradient: a plain parameter's data-parallel reduction
    (``_AsReplicated``, argument positions ``plain``: the plan's ``grad_sync``), and the last collective of
    a sharded parameter's redistribution backward (a weight stored S(0),R and read R,R by a batch-split
    op: its P,P gradient is reduce-scattered over axis 0, then all-reduced over axis 1: a collective the
    plan lists in ``backward``, under the edge). Both are bucketed alike; the second are reported apart.

    Returns (the buckets as ``("all_reduce", mesh axis, bytes moved)``, in issue order; ``(mesh axis,
    bytes)`` of each member that is a redistribution's backward, not a plain parameter's reduction)."""
    import operator

    aten, funcol = torch.ops.aten, torch.ops._c10d_functional
    axis_of: dict[str, int | None] = {}
    output = gm.graph.output_node()
    members: dict[tuple, list[tuple[torch.fx.Node, torch.fx.Node]]] = {}
    for node in gm.graph.nodes:
        if node.target is not funcol.all_reduce.default or len(node.users) != 1:
            continue
        (wait,) = node.users
        if wait.target is not funcol.wait_tensor.default or any(u is not output for u in wait.users):
            continue
        x, op, group = node.args
        if group not in axis_of:
            axis_of[group] = mesh_axis_of_group(mesh, group)
        if axis_of[group] is None:
            continue
        members.setdefault((group, op, x.meta["val"].dtype), []).append((node, wait))
    # Autograd runs the reductions last (their nodes were created first, at the program's entry); each
    # gradient is ready where its input is computed: buckets follow that order and are issued there.
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    # the backward graph returns one gradient per argument of the program, in argument order
    argument = {x: i for i, x in enumerate(output.args[0]) if isinstance(x, torch.fx.Node)}
    edge_members = [(axis_of[group], ar.args[0].meta["val"].numel()
                     * torch.empty((), dtype=reduction_dtype(dtype, reduce_dtype)).element_size())
                    for (group, _, dtype), pairs in members.items() for ar, wait in pairs
                    if argument.get(wait) not in plain]
    buckets = []
    for (group, op, dtype), pairs in members.items():
        pairs.sort(key=lambda pair: position[pair[0].args[0]])
        chunks, current, size = [], [], 0
        for pair in pairs:
            nbytes = _node_bytes(pair[0])
            if current and size + nbytes > bucket_bytes:
                chunks.append(current)
                current, size = [], 0
            current.append(pair)
            size += nbytes
        if current:
            chunks.append(current)
        for chunk in chunks:
            last = chunk[-1][0].args[0]  # the bucket's last gradient to be computed
            shapes = [list(ar.args[0].meta["val"].shape) for ar, _ in chunk]
            sizes = [ar.args[0].meta["val"].numel() for ar, _ in chunk]
            cursor = last

            def add(target, args, kwargs=None):
                nonlocal cursor
                with gm.graph.inserting_after(cursor):
                    cursor = gm.graph.call_function(target, args, kwargs)
                return cursor

            flats = [add(aten.view.default, (ar.args[0], [-1])) for ar, _ in chunk]
            total = sum(sizes)
            cat = add(aten.cat.default, (flats,))
            cat.meta["val"] = torch.empty(total, dtype=dtype, device="meta")
            moved = reduction_dtype(dtype, reduce_dtype)
            if moved != dtype:
                cat = add(aten._to_copy.default, (cat,), {"dtype": moved})
                cat.meta["val"] = torch.empty(total, dtype=moved, device="meta")
            reduced = add(funcol.all_reduce_.default, (cat, op, group))
            reduced.meta["val"] = torch.empty(total, dtype=moved, device="meta")
            with gm.graph.inserting_before(output):
                waited = gm.graph.call_function(funcol.wait_tensor.default, (reduced,))
                if moved != dtype:
                    waited = gm.graph.call_function(aten._to_copy.default, (waited,), {"dtype": dtype})
                parts = gm.graph.call_function(aten.split_with_sizes.default, (waited, sizes))
                for k, (_, wait) in enumerate(chunk):
                    piece = gm.graph.call_function(operator.getitem, (parts, k))
                    view = gm.graph.call_function(aten.view.default, (piece, shapes[k]))
                    wait.replace_all_uses_with(view)
            for ar, wait in chunk:
                gm.graph.erase_node(wait)
                gm.graph.erase_node(ar)
            buckets.append(("all_reduce", axis_of[group], total * torch.empty((), dtype=moved).element_size()))
    gm.recompile()
    return buckets, edge_members


class LocalProgram(torch.nn.Module):
    """The DTensor ``program`` of a plan, lowered to local forward and backward graphs on first call.

    A module (never registered in the user's model) so that module trackers (CommDebugMode in
    ``--verify``) see the step inside one module call, as they see the DTensor program. Call it with the program's own arguments (parameters and buffers as DTensors, then user inputs);
    it returns what the program returns (the loss), differentiable: ``loss.backward()`` runs the
    lowered backward graph and leaves DTensor gradients on the parameters.
    """

    def __init__(self, program: torch.fx.GraphModule, mesh: DeviceMesh, *, compile: bool = False,
                 plain: set[int] | None = None, bucket_bytes: int = 25 * 2**20, plan_nodes: dict | None = None,
                 autocast_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 regather: bool = False):
        super().__init__()
        #: plan ``execution.regather_params``: gathered parameters are gathered again in backward
        self.regather = regather
        #: the plan's mixed-precision compute dtype: the program is traced under autocast to it (None: off)
        self.autocast_dtype = autocast_dtype
        #: the dtype the backward graph's gradient buckets are all-reduced in (None: the gradients' own)
        self.reduce_dtype = reduce_dtype
        self.__dict__["program"] = program  # not a submodule: its parameters are the model's
        #: the plan's nodes (placements by program node name), for the message of a plan that cannot be lowered
        self.plan_nodes = plan_nodes
        self.mesh = mesh
        #: argument positions of parameters kept as plain tensors (replicated on every mesh axis)
        self.plain = set(plain or ())
        #: whether the next training trace/call reduces the plain parameters' gradients in its backward
        #: graph (False while accumulating micro-batches: ParallelModule.no_sync)
        self.reduce_grads = True
        #: per variant (reducing or not): position -> placements of its gradient as the program leaves it
        #: (Partial on data-parallel axes), and the backward graph's gradient buckets (op, mesh axis, bytes)
        self._grad_placements: dict[bool, dict[int, tuple]] = {True: {}, False: {}}
        self._grad_buckets: dict[bool, list[tuple]] = {True: [], False: []}
        #: per variant: (mesh axis, bytes) of each redistribution-backward all-reduce inside those buckets
        self._bucketed_edge_reductions: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self.bucket_bytes = bucket_bytes
        self.compile = compile
        self._lowered: dict[tuple, object] = {}
        #: the graphs of the training lowering ({"forward", "backward"}), and "inference" once traced without grad
        self.graphs: dict[str, torch.fx.GraphModule] = {}
        #: collectives of the most recent lowering, per graph (op, mesh axis, bytes, node)
        self.collectives: dict[str, list[dict]] = {}
        self.traces = 0
        self._tracing = False

    @property
    def reducing(self) -> bool:
        """Whether the current variant reduces plain gradients in its backward graph (never when compiled:
        inductor would get one all-reduce per parameter, GradSync buckets them instead). Without plain
        parameters both variants are the same graphs: always the reducing one."""
        return (self.reduce_grads or not self.plain) and not self.compile

    @property
    def grad_placements(self) -> dict[int, tuple]:
        """Position -> placements of a plain parameter's gradient as the current variant leaves it."""
        return self._grad_placements[self.reducing]

    @property
    def grad_buckets(self) -> list[tuple]:
        """The plain parameters' gradient all-reduces of the current variant's backward graph, bucketed."""
        return self._grad_buckets[self.reducing]

    @property
    def bucketed_edge_reductions(self) -> list[tuple[int, int]]:
        """(mesh axis, bytes) of the current variant's bucketed all-reduces that end a sharded parameter's
        redistribution backward (``bucket_gradient_reductions``): backward collectives of the plan that run
        inside a gradient bucket."""
        return self._bucketed_edge_reductions[self.reducing]

    def forward(self, *args):
        fn = self._lowered.get(self._key(args))
        if fn is None:
            fn = self._trace(args)
        out = fn(*args)
        return tuple(out) if isinstance(out, list) else out  # a tuple: module backward hooks accept it

    @contextlib.contextmanager
    def as_python(self):
        """Run the lowered graphs as their Python text (not inductor's compiled code) for the duration:
        the same ops and collectives, visible to dispatch modes (``--verify`` counts collectives so)."""
        before, self._tracing = self._tracing, True
        try:
            yield
        finally:
            self._tracing = before

    def _key(self, args) -> tuple:
        grad = torch.is_grad_enabled()
        return (grad, self.reducing or not grad, self.autocast_dtype, autocast_state(self.mesh.device_type),
                tuple(_signature(a) for a in args if not isinstance(a, DTensor)))

    def prepare(self, state: list, inputs: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Lower now, for the training call with the global batch: ``state`` the program's parameters and
        buffers (DTensors), ``inputs`` each user input's (global shape, dtype)."""
        device = torch.device(self.mesh.device_type)
        with torch.enable_grad():
            self._trace([*state, *(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in inputs)],
                        input_device=device)

    def _trace(self, args, input_device: torch.device | None = None):
        """Lower the program for calls like ``args`` (grad mode included) and cache it.

        Traced on fake tensors of the same metadata, outside any debug dispatch mode: nothing runs, no
        collective is issued or counted (CommDebugMode in ``--verify``), and a plan that cannot be
        lowered fails here, before its first step. Forward and backward are both traced now (not the
        backward at the first ``loss.backward()``), so their code is there to read."""

        try:
            return self._trace_or_raise(args, input_device)
        except LoweringError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the trace is a plan the program cannot run
            raise LoweringError(_lowering_failure(exc, self.program, self.plan_nodes)) from exc

    def _trace_or_raise(self, args, input_device: torch.device | None):
        import torch.fx.traceback as fx_traceback
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _disable_current_modes

        grad = torch.is_grad_enabled()
        with _disable_current_modes(), FakeTensorMode(allow_non_fake_inputs=False), \
                torch.set_grad_enabled(grad), fx_traceback.preserve_node_meta():
            before, self._tracing = self._tracing, True
            try:
                fakes = [self._fake_like(a, input_device) for a in args]
                key = self._key(fakes)
                fn = self._lowered[key] = self._lower(training=grad)
                outs = fn(*fakes)
                # AOTAutograd lowers the backward at its first run: run it here on the fakes (their
                # gradients are thrown away with them).
                loss = outs[0] if isinstance(outs, (tuple, list)) else outs
                if grad and isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
            finally:
                self._tracing = before
        return fn

    @staticmethod
    def _fake_like(x, device: torch.device | None = None):
        """A fake tensor like ``x``; a meta ``x`` (codegen: nothing materialized) becomes one on ``device``."""
        if isinstance(x, DTensor):
            dev = x._local_tensor.device
            dev = device if device is not None and dev.type == "meta" else dev
            local = torch.empty_strided(x._local_tensor.shape, x._local_tensor.stride(), dtype=x.dtype, device=dev)
            out = DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                     stride=x.stride())
        elif isinstance(x, torch.Tensor):
            dev = device if device is not None and x.device.type == "meta" else x.device
            out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=dev)
        else:
            return x
        return out.requires_grad_(x.requires_grad)

    def _lower(self, training: bool = True):
        from torch._functorch.aot_autograd import aot_function
        from torch.fx.graph import _BoxedCodeGen

        from cauto.runtime.execute import compile_with_comments

        reducing = self.reducing
        # the graphs shown (codegen) are the reducing variant's; an accumulation variant runs unshown
        shown = reducing or self.compile

        def keep(kind: str):
            def compiler(gm: torch.fx.GraphModule, example_inputs):
                _drop_dead_ops(gm)
                if kind == "backward" and not self.compile:  # (inductor buckets and reorders by itself)
                    self._grad_buckets[reducing][:], self._bucketed_edge_reductions[reducing][:] = \
                        bucket_gradient_reductions(gm, self.mesh, self.bucket_bytes, self.reduce_dtype, self.plain)
                records = annotate_collectives(gm, self.mesh)
                if shown or kind == "inference":
                    self.collectives[kind] = records
                compiled = None
                if self.compile:
                    from torch._inductor.compile_fx import compile_fx_inner
                    # inductor rewrites the graph it gets in place (collectives re-inplaced): it gets a copy,
                    # and the graph shown (and run as Python while tracing or verifying) stays functional
                    copy = torch.fx.GraphModule(gm, _copy.deepcopy(gm.graph))
                    compiled = compile_fx_inner(copy, example_inputs, is_backward=kind == "backward")
                # Boxed: the graph takes its inputs as one list and clears it as it starts, so each saved
                # activation is freed at its last use in backward, not when the whole backward returns.
                gm.graph.set_codegen(_BoxedCodeGen())
                compile_with_comments(gm)
                if shown or kind == "inference":
                    self.graphs[kind] = gm
                def python(args, forward=gm.forward):
                    return forward(args)  # directly: no module hooks, the step is one call of LocalProgram
                python._boxed_call = True
                if compiled is None:
                    return python

                def run(args):
                    # While tracing (fake tensors, no data) the graph runs as Python: compiled kernels
                    # would read the fakes' memory.
                    return python(args) if self._tracing else compiled(args)
                run._boxed_call = True
                return run
            return compiler

        if training and shown:  # the graphs shown are the training step's; an evaluation trace adds "inference"
            self.graphs, self.collectives = {}, {}
        self.traces += 1
        program, plain, mesh, placements = self.program, self.plain, self.mesh, self._grad_placements[reducing]
        mixed = self.autocast_dtype

        def step(*args):
            args = [_AsReplicated.apply(a, mesh, lambda g, i=i: placements.__setitem__(i, g), reducing)
                    if i in plain else a for i, a in enumerate(args)]
            if mixed is None:
                return program.forward(*args)
            with torch.autocast(mesh.device_type, dtype=mixed):
                return program.forward(*args)

        decompositions = None
        if self.compile:  # inductor lowers what its own decomposition table leaves, as torch.compile does
            from torch._inductor.decomposition import select_decomp_table
            decompositions = select_decomp_table()
        return aot_function(step, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            inference_compiler=keep("inference"),
                            partition_fn=functools.partial(_partition_with_regions,
                                                           regather=self.regather and training),
                            decompositions=decompositions)

    def code(self) -> str:
        """Source of the lowered graphs (forward, then backward once traced), as they run."""
        parts = []
        for kind in ("forward", "backward", "inference"):
            gm = self.graphs.get(kind)
            if gm is not None:
                parts.append(f"class Local{kind.title()}(torch.nn.Module):\n"
                             + "\n".join("    " + line for line in gm.code.strip("\n").splitlines()))
        return "\n\n\n".join(parts) + "\n"


__all__ = ["COLLECTIVE_NAMESPACE", "LocalProgram", "LoweringError", "annotate_collectives", "autocast_state"]
