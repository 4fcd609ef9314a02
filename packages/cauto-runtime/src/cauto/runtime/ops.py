"""The functions that generated parallel code calls between ATen ops.

Each takes placements as a plan string ("S(0),R": one entry per mesh axis) so that generated code
reads like the plan. They are plain functions of DTensors; the collectives they run are exactly
those DTensor's ``redistribute`` chooses for the two placements.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._python_dispatch import _disable_current_modes

from cauto.runtime.dist_utils import local_slices, placements_text, to_placements


def _tracing() -> bool:
    """True while the program is traced into a local graph (lowering.py), not executed."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None or \
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def redistribute(x: DTensor, mesh: DeviceMesh, placements: str, forward_dtype: torch.dtype | None = None,
                 backward_dtype: torch.dtype | None = None) -> DTensor:
    """``x`` redistributed to ``placements`` (a plan edge): all-gather, all-reduce, reduce-scatter...

    ``forward_dtype``: cast first and move the cast (mixed precision, cauto.plan.precision: the
    consumer would cast on entry anyway); the gradient's collective runs in ``x``'s own dtype, or in
    ``backward_dtype`` where the plan reduces in bf16, and comes back in ``x``'s dtype.

    The gradient that flows back through it gets ``x``'s memory layout (_GradLayoutOfInput): a
    collective returns contiguous tensors, and an op upstream may view the gradient as only ``x``'s
    strides allow (a transposed attention input whose backward ends in ``view``)."""
    target = to_placements(placements)
    if tuple(x.placements) == target:
        return x
    if x.requires_grad and not x._local_tensor.is_contiguous():
        x = _GradLayoutOfInput.apply(x)
    if forward_dtype == x.dtype:
        forward_dtype = None
    if backward_dtype == x.dtype:
        backward_dtype = None
    if forward_dtype is None and backward_dtype is None:
        return x.redistribute(mesh, target)
    return x.redistribute(mesh, target, forward_dtype=forward_dtype, backward_dtype=backward_dtype)


class _GradLayoutOfInput(torch.autograd.Function):
    """Identity forward; backward copies the gradient's local tensor into the input's strides."""

    @staticmethod
    def forward(ctx, x):
        ctx.stride = x._local_tensor.stride()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and grad._local_tensor.stride() != ctx.stride:
            local = grad._local_tensor
            # an expanded input (a 0 stride on a dim of size > 1) has no gradient with its strides
            if len(ctx.stride) == local.dim() and all(st or n == 1 for n, st in zip(local.shape, ctx.stride)):
                laid = torch.empty_strided(local.shape, ctx.stride, dtype=local.dtype, device=local.device)
                laid.copy_(local)
                grad = DTensor.from_local(laid, grad.device_mesh, grad.placements, run_check=False,
                                          shape=grad.shape, stride=grad.stride())
        return grad


class _ReduceGrad(torch.autograd.Function):
    """Identity forward; backward reduces the (summed) gradient's Partial axes to ``placements``."""

    @staticmethod
    def forward(ctx, x, mesh, placements):
        ctx.mesh, ctx.target = mesh, placements
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            target = tuple(want if isinstance(g, Partial) and not isinstance(want, Partial) else g
                           for g, want in zip(grad.placements, ctx.target))
            if target != tuple(grad.placements):
                grad = grad.redistribute(ctx.mesh, target)
        return grad, None, None


def reduce_grad(x: DTensor, mesh: DeviceMesh, placements: str) -> DTensor:
    """``x`` unchanged; in backward, its gradient (summed over all consumers) is reduced where Partial.

    Where consumers send a value Partial gradients (a weight split on an output letter the value
    lacks), DTensor would keep the sum Partial and carry it backward through the producer's ops,
    redistributing and reducing wherever an op refuses a Partial (more collectives, and a plan the
    solver cannot predict). The plan lists these values (backward collectives "grad of <value>"); here
    their gradient is brought to the value's own placement ``placements`` once, before the producer's
    backward, as the solver predicts.
    """
    if not isinstance(x, DTensor) or not x.requires_grad or not torch.is_grad_enabled():
        return x
    return _ReduceGrad.apply(x, mesh, to_placements(placements))


def replicate(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor that every rank computed identically (arange, zeros, masks) as a replicated DTensor."""
    if isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def place_input(x: torch.Tensor, mesh: DeviceMesh, placements: str, global_shape: tuple[int, ...]) -> DTensor:
    """A user input as a DTensor with ``placements``.

    Global-batch mode: ``x`` has ``global_shape`` (every rank passes the same batch) and each rank
    keeps its slice, without communication. Local-batch mode: ``x`` already is this rank's shard
    (``ParallelModule.input_slices()`` says which); it is wrapped as is.
    """
    if isinstance(x, DTensor):
        return x if placements_text(x.placements) == placements else redistribute(x, mesh, placements)
    target = to_placements(placements)
    shape = tuple(global_shape)
    index = local_slices(shape, target, mesh)
    local_shape = tuple(s.stop - s.start for s in index)
    if tuple(x.shape) == shape:
        local = x[index] if local_shape != shape else x
    elif tuple(x.shape) == local_shape:
        local = x
    else:
        raise ValueError(
            f"input of shape {tuple(x.shape)} fits neither the captured global shape {shape} nor this rank's "
            f"shard {local_shape} (placement {placements}); pass the batch the model was captured with, or "
            "this rank's slice of it (ParallelModule.input_slices())"
        )
    if x.device.type != mesh.device_type:
        local = local.to(mesh.device_type)
    return DTensor.from_local(local, mesh, target, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def to_local_loss(x: torch.Tensor, mesh: DeviceMesh, rescale_avg_grad: bool = False) -> torch.Tensor:
    """The loss as a plain tensor, replicated on every rank (all-reduced first if it is Partial).

    ``rescale_avg_grad``: set for losses whose DTensor backward differentiates each rank's local mean
    when the loss is Partial(avg) (``aten.mse_loss`` in torch 2.13, whichever placement its incoming
    gradient has; cross entropy is right): the gradient is then divided by the number of ranks
    averaged over. The parity tests check both.
    """
    if not isinstance(x, DTensor):
        return x
    avg_ranks = 1
    for axis, p in enumerate(x.placements):
        if isinstance(p, Partial) and p.reduce_op == "avg":
            avg_ranks *= mesh.size(axis)
    if rescale_avg_grad and avg_ranks > 1 and x.requires_grad:
        x.register_hook(lambda g: g / avg_ranks)
    if any(not isinstance(p, Replicate) for p in x.placements):
        x = x.redistribute(mesh, [Replicate()] * mesh.ndim)
    return x.to_local()


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _stride_like(local: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides of a tensor of ``shape`` whose dims are laid out in memory in ``local``'s order."""
    order = sorted(range(local.ndim), key=lambda d: (-local.stride(d), d))  # outermost first
    stride, acc = [0] * len(shape), 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)


def sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, *,
         scale: float | None = None, enable_gqa: bool = False):
    """``aten.scaled_dot_product_attention`` on DTensors, run locally on each shard.

    Attention is independent per batch element and per head, so with query, key and value placed
    alike and sharded only on dims 0 (batch) or 1 (heads), each rank attends over its own shard
    (DTensor has no sharding rule for the CPU flash kernel). Other placements (sequence or head_dim
    sharded, Partial) are first replicated on those axes.
    """
    plain = torch.ops.aten.scaled_dot_product_attention.default
    tensors = [t for t in (query, key, value, attn_mask) if isinstance(t, DTensor)]
    if not tensors:
        return plain(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    mesh = tensors[0].device_mesh
    target = [p if isinstance(p, Shard) and p.dim in (0, 1) else Replicate() for p in query.placements]
    q, k, v = (t.redistribute(mesh, target) if tuple(t.placements) != tuple(target) else t
               for t in (query, key, value))
    mask_local = None
    if attn_mask is not None:
        mask_target = [p if isinstance(p, Shard) and attn_mask.ndim == query.ndim
                       and attn_mask.shape[p.dim] == query.shape[p.dim] != 1 else Replicate() for p in target]
        if not isinstance(attn_mask, DTensor):
            attn_mask = replicate(attn_mask, mesh)
        if tuple(attn_mask.placements) != tuple(mask_target):
            attn_mask = attn_mask.redistribute(mesh, mask_target)
        # A mask broadcast over a dim the query is sharded on (batch or heads of size 1: T5's decoder position
        # bias, (batch, 1, q, kv) masks under head sharding) is whole on every rank, but each rank's attention
        # reads it for its own shard only: its local gradient is that shard's sum, a Partial sum on that axis.
        grad_placements = [Partial("sum") if isinstance(t, Shard) and isinstance(m, Replicate) else m
                           for t, m in zip(target, mask_target)]
        mask_local = attn_mask.to_local(grad_placements=grad_placements)
    shape = (*query.shape[:-1], value.shape[-1])
    # No collective runs below; debug dispatch modes (CommDebugMode) are kept out of the local
    # computation, whose backward they would otherwise see with plain tensors. Tracing modes (the
    # lowering to a local program: functionalization, proxies) must see it.
    with _disable_current_modes() if not _tracing() else contextlib.nullcontext():
        out = plain(q.to_local(), k.to_local(), v.to_local(), mask_local, dropout_p, is_causal, scale=scale,
                    enable_gqa=enable_gqa)
        # The CPU flash kernel returns its output laid out (batch, seq, heads, dim) and viewed as
        # (batch, heads, seq, dim): the DTensor gets the global stride of that same layout, so that the
        # model's transpose + reshape stays a view (a contiguous stride here made reshape copy).
        return DTensor.from_local(out, mesh, target, run_check=False, shape=torch.Size(shape),
                                  stride=_stride_like(out, shape))


def lift_fresh_copy(x: torch.Tensor) -> torch.Tensor:
    """``aten.lift_fresh_copy`` (the copy a trace makes of a tensor constant it lifted, T5's) as the clone it
    is: DTensor has no rule for the lift, it has one for clone."""
    return torch.ops.aten.clone.default(x)


def fill_tensor_(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``aten.fill_.Tensor`` (fill with a 0-dim tensor: T5 writes its decoder start token so) as the copy of
    the value broadcast to ``x`` that it is: DTensor has a rule for that copy (a replicated value becomes
    any placement of ``x`` by slicing), none for the fill."""
    return torch.ops.aten.copy_.default(x, value.expand(x.shape))


def cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``aten.cat`` without the legacy empty inputs (1-dim, 0 elements) that torch's cat skips and DTensor's
    rule cannot (it checks ``dim`` against each input: T5's empty key/value caches, ``torch.tensor([])``)."""
    kept = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)]
    return torch.ops.aten.cat.default(kept if kept else tensors, dim)


def adaptive_avg_pool1d(x: torch.Tensor, output_size: list[int]) -> torch.Tensor:
    """``aten.adaptive_avg_pool1d`` to one output: the mean over the last dim that the CPU kernel computes
    (same values, same gradient), without the ``as_strided_`` it then applies to an input it takes for
    channels-last (Swin's pooler: a transposed input), which DTensor has no rule for on any placement."""
    if list(output_size) == [1]:
        return torch.ops.aten.mean.dim(x, [-1], True)
    return torch.ops.aten.adaptive_avg_pool1d.default(x, output_size)


#: ATen ops that DTensor cannot shard (on some devices), replaced by the functions above (same signature)
SUBSTITUTES = {torch.ops.aten.cat.default: cat, torch.ops.aten.adaptive_avg_pool1d.default: adaptive_avg_pool1d,
               torch.ops.aten.scaled_dot_product_attention.default: sdpa,
               torch.ops.aten.lift_fresh_copy.default: lift_fresh_copy,
               torch.ops.aten.fill_.Tensor: fill_tensor_}

#: operator namespaces whose ops DTensor has sharding rules for (or that the runtime itself emits)
_TORCH_NAMESPACES = {"aten", "prims", "_c10d_functional", "c10d_functional", "_dtensor", "cauto"}


def is_library_op(target: object) -> bool:
    """True for an op registered with ``torch.library`` outside torch (``transformers::grouped_mm_fallback``):
    DTensor has no sharding rule for it, so it runs replicated (:func:`replicated_op`)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in _TORCH_NAMESPACES


def replicated_op(op: torch._ops.OpOverload, *args, **kwargs):
    """``op`` run on the local tensors of its replicated DTensor inputs; its outputs replicated DTensors.

    Every rank holds the whole inputs and computes the whole outputs, as one process would. The op's
    own autograd (its registered backward, itself possibly another library op) runs on the local
    tensors; ``to_local``/``from_local`` carry the gradient across (a Partial output gradient is
    reduced to Replicate first)."""
    dtensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if not dtensors:
        return op(*args, **kwargs)
    mesh = dtensors[0].device_mesh
    bad = [a.placements for a in dtensors if any(not p.is_replicate() for p in a.placements)]
    if bad:
        raise RuntimeError(f"{op} has no sharding rule and runs replicated, but an input is placed {bad[0]}")
    replicate_all = [Replicate()] * mesh.ndim
    local_args, local_kwargs = pytree.tree_map(lambda a: a.to_local() if isinstance(a, DTensor) else a,
                                               (args, kwargs))
    out = op(*local_args, **local_kwargs)
    return pytree.tree_map(lambda t: DTensor.from_local(t, mesh, replicate_all, run_check=False)
                           if isinstance(t, torch.Tensor) else t, out)


def elementwise_op(op: torch._ops.OpOverload, xs: list):
    """A kept custom Function declared elementwise (``cauto.profiler.declare_elementwise``) run on each rank's
    shard: its tensors (one shape, one placement: the plan's labels give them one set of letters) go in as
    local tensors and its outputs come back as DTensors placed as the inputs. ``to_local``/``from_local``
    carry the gradient across; the Function's own backward runs on the shards."""
    dtensors = [x for x in xs if isinstance(x, DTensor)]
    if not dtensors:
        return op(xs)
    first = dtensors[0]
    mesh, placements = first.device_mesh, tuple(first.placements)
    if any(tuple(x.placements) != placements or x.shape != first.shape for x in dtensors) or \
            any(p.is_partial() for p in placements):
        raise RuntimeError(f"{op} is declared elementwise and runs on shards, but its inputs are placed "
                           f"{[tuple(x.placements) for x in dtensors]} (one placement, no Partial, is needed)")
    out = op([x.to_local() if isinstance(x, DTensor) else x for x in xs])
    stride = _contiguous_stride(tuple(first.shape))
    return [DTensor.from_local(t, mesh, placements, run_check=False, shape=first.shape, stride=stride)
            for t in out]


def checkpointed(region: torch.nn.Module, *args):
    """Run a checkpoint region (a sub-GraphModule) under non-reentrant ``torch.utils.checkpoint``.

    Its forward is called directly, not through ``nn.Module.__call__``, so module hooks (and
    CommDebugMode's module tracker) do not run again when backward recomputes it. Early stop is
    off: backward recomputes the whole region, every node and redistribution of it, as the plan
    predicts (its recompute time and collectives), not only up to the last tensor backward needs.
    """
    if _tracing():
        # Lowering (lowering.py): the region's ops are annotated, and the partition of the local
        # program recomputes every one of them in backward instead of saving it (the same ops as
        # torch.utils.checkpoint with early stop off, without its hooks).
        import torch.fx.traceback as fx_traceback

        with fx_traceback.annotate({REGION_ANNOTATION: region.__class__.__name__ + f"#{id(region)}"}):
            return region.forward(*args)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        return torch.utils.checkpoint.checkpoint(region.forward, *args, use_reentrant=False,
                                                 preserve_rng_state=draws_random(region))


def draws_random(module: torch.nn.Module) -> bool:
    """Whether a captured region (a GraphModule, its nested regions included) runs an op that draws from
    a random generator (ATen's ``nondeterministic_seeded`` tag: dropout, bernoulli, rand...). Only then
    must its recomputation replay the generators' state: torch.utils.checkpoint otherwise saves every
    device's generator state per call and holds it until backward (5056 B of CPU state per region,
    measured on a nested GPT plan: the walk's peak does not count it, and nothing reads it)."""
    cached = getattr(module, "_cauto_draws_random", None)
    if cached is None:
        cached = any(isinstance(node.target, torch._ops.OpOverload)
                     and torch.Tag.nondeterministic_seeded in node.target.tags
                     for sub in module.modules() if isinstance(sub, torch.fx.GraphModule)
                     for node in sub.graph.nodes if node.op == "call_function")
        module._cauto_draws_random = cached
    return cached


#: the node annotation (``node.meta["custom"]``) that marks a checkpoint region's ops in a lowered trace
REGION_ANNOTATION = "cauto_checkpoint_region"

#: loss ops whose DTensor backward needs ``to_local_loss(rescale_avg_grad=True)``
RESCALE_AVG_LOSSES = {torch.ops.aten.mse_loss.default}
