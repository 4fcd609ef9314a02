"""Sharding labels: an einsum-like description of which dimensions of an op may be split.

``labels_for(node)`` gives the graph document's ``labels`` object for an op node of a Capture's
graph (see graph.schema.json, ``$defs/labels``): one string per tensor input (in the order of
``capture.tensor_inputs``) and per output (``capture.output_tensors``), one character per dimension.

* A letter present in an output may be split on a mesh axis: every tensor holding the letter is
  Shard(its dim of that letter), every other tensor is Replicate on that axis.
* A letter present only in inputs is contracted: splitting it leaves every output Partial(reduce);
  with no ``reduce`` it cannot be split.
* '.' marks a dimension that is never split (size-1 and broadcast dims, and anything where DTensor
  would redistribute); letters listed in ``whole`` are never split either (softmax axis, normalized
  axis, the contracted dim of a matmul that adds a bias).

Rules are data: ``RULES`` maps op family -> {aten overload name -> rule function}. A rule reads the
node's tensor shapes and arguments and returns the labels; an op in no family gets the conservative
"replicate" label (every dim '.'). Rules only offer what DTensor itself does without touching its
inputs, because the runtime executes the plan on DTensor and must never meet a hidden
redistribution.

How the rules are verified (tests/test_labels.py): for every op node of every zoo model graph, and
for each strategy the labels allow on a 1-D mesh of 2 ranks (each splittable letter in turn, and
all-Replicate), the op runs on real DTensors with exactly those input placements on torch's fake
process group (``dtensor_adapter.sharded_call``: DTensor's strict ExplicitRedistributionContext
plus CommDebugMode). The test fails if DTensor redistributes an input, issues a collective, or
returns output placements other than the labels promise. Composite ops (linear, layer_norm,
scaled_dot_product_attention, cross_entropy_loss, ...) decompose there exactly as at run time
(attention on CPU through the math backend: DTensor has no strategy for the CPU flash kernel).
A small module with one op per rule is checked the same way, and on a 2x2 mesh two axes that split
different letters compose. Not guaranteed by the labels: one letter split on two mesh axes (nested
sharding) fails inside DTensor for a linear/matmul's non-leading batch dims (e.g. the sequence),
attention heads and convolution batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from cauto.profiler.capture import output_tensors, tensor_inputs
from cauto.profiler.kept_functions import is_elementwise

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
NEVER = "."

Labels = dict[str, Any]
Rule = Callable[["OpView"], Labels]


class OpView:
    """What a rule needs of a node: input and output shapes, and its arguments by schema name."""

    def __init__(self, node: torch.fx.Node):
        self.node = node
        self.target = str(node.target)
        values = [output_tensors(a)[0] for a in tensor_inputs(node)]
        self.inputs = [tuple(int(s) for s in v.shape) for v in values]
        self.input_dtypes = [v.dtype for v in values]
        self.outputs = [tuple(int(s) for s in t.shape) for t in output_tensors(node)]
        self._args = _bind(node)

    def arg(self, name: str, default: Any = None) -> Any:
        """The argument called ``name`` in the op's schema (its default when not given)."""
        value = self._args.get(name, default)
        return default if value is None else value

    def is_tensor_arg(self, name: str) -> bool:
        """True when the argument ``name`` is a tensor node of this graph (not None, not a scalar)."""
        value = self._args.get(name)
        return isinstance(value, torch.fx.Node) and bool(output_tensors(value))


def _bind(node: torch.fx.Node) -> dict[str, Any]:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    bound: dict[str, Any] = {}
    for i, argument in enumerate(schema.arguments):
        if i < len(node.args):
            bound[argument.name] = node.args[i]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _dims(dims: int | Sequence[int] | None, rank: int) -> list[int]:
    """Normalized reduction dims; None or [] means all dims."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({_dim(d, rank) for d in dims})


def _make(inputs: Sequence[str], outputs: Sequence[str], rule: str, reduce: str | None = None,
          whole: str = "") -> Labels:
    used_in = set("".join(inputs))
    # a letter no input holds cannot be split: DTensor never shards an output its inputs do not
    outputs = ["".join(c if c in used_in else NEVER for c in spec) for spec in outputs]
    labels: Labels = {"inputs": list(inputs), "outputs": outputs}
    used_out = set("".join(outputs))
    contracted = used_in - used_out - {NEVER}
    if reduce is not None and contracted - set(whole):
        labels["reduce"] = reduce
    whole = "".join(sorted(set(whole) & (used_in | used_out)))
    if whole:
        labels["whole"] = whole
    labels["rule"] = rule
    return labels


def _aligned(shape: Sequence[int], out: str, out_shape: Sequence[int]) -> str:
    """Labels of an input broadcast (right-aligned) against an output labelled ``out``."""
    offset = len(out_shape) - len(shape)
    chars = []
    for i, size in enumerate(shape):
        j = i + offset
        chars.append(out[j] if j >= 0 and size == out_shape[j] and size != 1 else NEVER)
    return "".join(chars)


def _free(shape: Sequence[int], letters: str = LETTERS) -> str:
    """One letter per dim, '.' for size-1 dims."""
    return "".join(NEVER if size == 1 else letters[i] for i, size in enumerate(shape))


def replicate_only(op: OpView, rule: str = "replicate") -> Labels:
    """Every dim '.': the op runs only on replicated tensors."""
    return _make([NEVER * len(s) for s in op.inputs], [NEVER * len(s) for s in op.outputs], rule)


# ---------------------------------------------------------------------------------------------
# pointwise
# ---------------------------------------------------------------------------------------------

def pointwise(op: OpView) -> Labels:
    """Elementwise ops with broadcasting: every output dim a letter, broadcast input dims '.'."""
    out_shape = op.outputs[0]
    out = _free(out_shape)
    outputs = [out if shape == out_shape else NEVER * len(shape) for shape in op.outputs]
    return _make([_aligned(s, out, out_shape) for s in op.inputs], outputs, "pointwise")


def broadcast_tensors(op: OpView) -> Labels:
    """broadcast_tensors: each output is its input expanded to the common shape."""
    out_shape = op.outputs[0]
    out = _free(out_shape)
    return _make([_aligned(s, out, out_shape) for s in op.inputs], [out] * len(op.outputs), "pointwise")


def factory(op: OpView) -> Labels:
    """Ops that create a tensor from sizes (arange, zeros, new_ones ...): replicated."""
    return replicate_only(op, "factory")


# ---------------------------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------------------------

def mm(op: OpView) -> Labels:
    """mm: (m,k) @ (k,n) -> (m,n); k contracted (sum)."""
    return _make(["mk", "kn"], ["mn"], "matmul", reduce="sum")


def bmm(op: OpView) -> Labels:
    """bmm: (b,m,k) @ (b,k,n) -> (b,m,n); k contracted (sum)."""
    return _make(["bmk", "bkn"], ["bmn"], "matmul", reduce="sum")


def addmm(op: OpView) -> Labels:
    """addmm / baddbmm: bias + matmul. The bias is not split with k, so k stays whole."""
    out = "bmn" if len(op.outputs[0]) == 3 else "mn"
    mats = ["bmk", "bkn"] if len(out) == 3 else ["mk", "kn"]
    return _make([_aligned(op.inputs[0], out, op.outputs[0]), *mats], [out], "matmul", whole="k")


def linear(op: OpView) -> Labels:
    """linear(x, W, b): (..., k) @ (n, k)^T + b -> (..., n); k contracted (sum) when there is no bias."""
    batch = _free(op.inputs[0][:-1], "abcdefghij")
    has_bias = op.is_tensor_arg("bias")
    inputs = [batch + "k", "nk"] + (["n"] if has_bias else [])
    return _make(inputs, [batch + "n"], "matmul", reduce=None if has_bias else "sum", whole="k" if has_bias else "")


def matmul(op: OpView) -> Labels:
    """matmul with numpy semantics: broadcast batch dims, 1-D operands promoted and squeezed."""
    a, b = op.inputs
    out_shape = op.outputs[0]
    if len(a) == 1 and len(b) == 1:
        return _make(["k", "k"], [""], "matmul", reduce="sum")
    batch_rank = max(len(a), len(b)) - 2
    batch_shape = out_shape[:batch_rank]
    batch = _free(batch_shape, "abcdefghij")
    a_label = _aligned(a[:-2], batch, batch_shape) + "mk" if len(a) > 1 else "k"
    b_label = _aligned(b[:-2], batch, batch_shape) + "kn" if len(b) > 1 else "k"
    out = batch + ("m" if len(a) > 1 else "") + ("n" if len(b) > 1 else "")
    return _make([a_label, b_label], [out], "matmul", reduce="sum")


# ---------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------

_REDUCE_OF = {"sum": "sum", "mean": "avg", "amax": "max", "amin": "min"}


def reduction(op: OpView) -> Labels:
    """sum/mean/amax/amin over dims: reduced dims contracted with the matching Partial reduce op;
    max/min with indices, and ops without a linear reduce, keep the reduced dims whole."""
    (shape,) = op.inputs[:1]
    name = op.target.split(".")[1]
    dims = _dims(op.arg("dim"), len(shape))
    keepdim = bool(op.arg("keepdim", False))
    x = _free(shape)
    kept = "".join(NEVER if i in dims else c for i, c in enumerate(x)) if keepdim else \
        "".join(c for i, c in enumerate(x) if i not in dims)
    reduce = _REDUCE_OF.get(name)
    whole = "" if reduce else "".join(x[i] for i in dims)
    return _make([x], [kept] * len(op.outputs), "reduction", reduce=reduce, whole=whole)


def along_dim(op: OpView) -> Labels:
    """Ops that mix values along one dim (softmax, cumsum, ...): that dim whole, others free."""
    shape = op.inputs[0]
    dim = _dim(op.arg("dim", -1), len(shape))
    x = _free(shape)
    return _make([x], [x] * len(op.outputs), "along_dim", whole=x[dim].replace(NEVER, ""))


def diff(op: OpView) -> Labels:
    """diff(x, n, dim, prepend, append): the differenced dim changes size, so it is never split."""
    shape = op.inputs[0]
    dim = _dim(op.arg("dim", -1), len(shape))
    x = _free(shape)
    x = x[:dim] + NEVER + x[dim + 1:]
    return _make([x] + [_aligned(s, x, shape) for s in op.inputs[1:]], [x], "along_dim")


# ---------------------------------------------------------------------------------------------
# norms and losses
# ---------------------------------------------------------------------------------------------

def layer_norm(op: OpView) -> Labels:
    """layer_norm / native_layer_norm / rms_norm: normalized (trailing) dims whole, leading dims free;
    native_layer_norm's mean and rstd keep size-1 normalized dims."""
    shape = op.inputs[0]
    normalized = len(op.arg("normalized_shape"))
    x = _free(shape)
    lead, norm = x[: len(shape) - normalized], x[len(shape) - normalized:]
    params = [norm for _ in op.inputs[1:]]
    outputs = [x if out == shape else lead + NEVER * (len(out) - len(lead)) for out in op.outputs]
    return _make([x, *params], outputs, "norm", whole=norm.replace(NEVER, ""))


def batch_norm(op: OpView) -> Labels:
    """batch_norm: statistics span batch and spatial dims, so only channels (dim 1) split. The saved
    statistics are per channel, or empty (CPU's ``_native_batch_norm_legit_no_training``), which DTensor
    places like per-channel ones."""
    shape = op.inputs[0]
    x = NEVER + ("c" if shape[1] != 1 else NEVER) + NEVER * (len(shape) - 2)
    params = ["c" if len(s) == 1 and s[0] == shape[1] else NEVER * len(s) for s in op.inputs[1:]]
    outputs = [x if out == shape else ("c" if len(out) == 1 and out[0] in (shape[1], 0) else NEVER * len(out))
               for out in op.outputs]
    return _make([x, *params], outputs, "norm")


_LOSS_REDUCE = {0: None, 1: "avg", 2: "sum"}


def cross_entropy(op: OpView) -> Labels:
    """cross_entropy_loss / nll_loss (input (N, C, ...), class-index target (N, ...)): the class dim
    is whole; batch dims are contracted by the reduction (mean -> avg, sum -> sum).

    Partial(avg) is DTensor's own choice for a batch-split mean: it is the exact mean only when every
    shard has as many non-ignored targets (ignore_index), as is the case without ignored targets."""
    x_shape = op.inputs[0]
    x = _free(x_shape)
    has_channel = len(x_shape) >= 2
    channel = x[1] if has_channel else x[0]
    batch = x[:1] + x[2:] if has_channel else ""
    inputs = [x]
    if op.is_tensor_arg("target"):
        inputs.append(batch if len(op.inputs[1]) == len(batch) else x)
    if op.is_tensor_arg("weight"):
        inputs.append(channel)
    reduction = int(op.arg("reduction", 1))
    reduce = _LOSS_REDUCE[reduction]
    outputs = [batch if reduction == 0 else ""] + ["" for _ in op.outputs[1:]]
    if reduce == "avg" and float(op.arg("label_smoothing", 0.0)) != 0.0:
        reduce = None  # DTensor redistributes the smoothing term's Partial(sum) / count division
    if reduce and len(op.outputs) > 1:
        reduce = None  # nll_loss_forward's total_weight is Partial(sum) whatever the loss's reduce is
    return _make(inputs, outputs, "loss", reduce=reduce, whole=channel.replace(NEVER, "") + (
        "" if reduce or reduction == 0 else batch.replace(NEVER, "")))


def mse_loss(op: OpView) -> Labels:
    """mse_loss(input, target, reduction): elementwise, then mean/sum over everything."""
    reduction = int(op.arg("reduction", 1))
    shape = op.outputs[0] if reduction == 0 else op.inputs[0]
    x = _free(shape)
    inputs = [_aligned(s, x, shape) for s in op.inputs]
    return _make(inputs, [x if reduction == 0 else ""], "loss", reduce=_LOSS_REDUCE[reduction])


# ---------------------------------------------------------------------------------------------
# embedding, attention, convolution, indexing
# ---------------------------------------------------------------------------------------------

def embedding(op: OpView) -> Labels:
    """embedding(weight (V, H), indices (...)) -> (..., H): indices' dims and H split.

    The vocab dim is not offered: DTensor's row-wise embedding first turns the Replicate indices
    into a masked partial (an input redistribution)."""
    indices = _free(op.inputs[1], "abcdefghij")
    return _make([".h", indices], [indices + "h"], "embedding")


def attention(op: OpView) -> Labels:
    """scaled_dot_product_attention(q, k, v, mask): only batch and head dims split (they must have
    equal sizes in q, k, v and the output; a broadcast mask dim stays whole on that axis)."""
    q, k, v = op.inputs[:3]
    out = op.outputs[0]
    lead = len(q) - 2
    batch = "".join(
        LETTERS[i] if q[i] == k[i] == v[i] == out[i] and q[i] != 1 else NEVER for i in range(lead))
    labels = [batch + "..", batch + "..", batch + ".."]
    for mask in op.inputs[3:]:
        offset = len(out) - len(mask)
        labels.append("".join(
            batch[i + offset] if i + offset < lead and size == out[i + offset] else NEVER
            for i, size in enumerate(mask)))
    outputs = [batch + ".." if len(o) == len(out) else NEVER * len(o) for o in op.outputs]
    return _make(labels, outputs, "attention")


def convolution(op: OpView) -> Labels:
    """convolution: the batch dim splits; channels and spatial dims stay whole."""
    x, weight = op.inputs[0], op.inputs[1]
    if len(x) != len(weight):  # unbatched input: nothing to split
        return replicate_only(op, "convolution")
    batch = "b" if x[0] != 1 else NEVER
    inputs = [batch + NEVER * (len(x) - 1)] + [NEVER * len(s) for s in op.inputs[1:]]
    return _make(inputs, [batch + NEVER * (len(o) - 1) for o in op.outputs], "convolution")


def adaptive_avg_pool(op: OpView) -> Labels:
    """adaptive_avg_pool1d/2d: batch and channel dims split; spatial dims whole."""
    x = op.inputs[0]
    spatial = 1 if op.target.startswith("aten.adaptive_avg_pool1d") else 2
    lead = _free(x[:-spatial])
    return _make([lead + NEVER * spatial], [lead + NEVER * (len(op.outputs[0]) - len(lead))], "pool")


def index_select(op: OpView) -> Labels:
    """index_select(x, dim, index): other dims follow x; the selected dim follows the index."""
    shape, index = op.inputs
    dim = _dim(op.arg("dim"), len(shape))
    x = _free(shape)
    x = x[:dim] + NEVER + x[dim + 1:]
    i = "z" if index and index[0] != 1 else NEVER * len(index)
    return _make([x, i], [x[:dim] + i[:1] + x[dim + 1:]], "indexing")


def gather(op: OpView) -> Labels:
    """gather(x, dim, index): a dim other than `dim` splits where x and index agree on its size; the
    gathered dim splits with the index only (x stays whole)."""
    shape, index = op.inputs
    dim = _dim(op.arg("dim"), len(shape))
    same_rank = len(shape) == len(index)
    out = "".join(
        NEVER if size == 1 or (i != dim and not (same_rank and shape[i] == size)) else LETTERS[i]
        for i, size in enumerate(index))
    x = "".join(out[i] if same_rank and i != dim and shape[i] == index[i] else NEVER for i in range(len(shape)))
    return _make([x, out], [out], "indexing")


def index(op: OpView) -> Labels:
    """index(x, [idx or None, ...]): non-indexed dims follow x, the broadcast index dims follow the
    indices (a size-1 index dim stays whole)."""
    shape = op.inputs[0]
    indices = op.arg("indices")
    indexed = [i for i, idx in enumerate(indices) if idx is not None]
    idx_shapes = op.inputs[1:]
    if len(idx_shapes) != len(indexed) or torch.bool in op.input_dtypes[1:]:  # masks index data-dependently
        return replicate_only(op, "indexing")
    broadcast_rank = max(len(s) for s in idx_shapes)
    consecutive = all(b - a == 1 for a, b in zip(indexed, indexed[1:]))
    insert = indexed[0] if consecutive else 0
    out = op.outputs[0]
    out_labels = [NEVER] * len(out)
    x = [NEVER] * len(shape)
    free = iter(LETTERS)
    for d in range(len(shape)):
        if d in indexed:
            continue
        o = d if d < insert else d + broadcast_rank - sum(1 for i in indexed if d > i)
        if shape[d] != 1:
            x[d] = out_labels[o] = next(free)
    idx_labels = []
    broadcast = "".join(NEVER if out[insert + b] == 1 else next(free) for b in range(broadcast_rank))
    for s in idx_shapes:
        idx_labels.append(_aligned(s, broadcast, out[insert:insert + broadcast_rank]))
    out_labels[insert:insert + broadcast_rank] = list(broadcast)
    return _make(["".join(x), *idx_labels], ["".join(out_labels)], "indexing")


# ---------------------------------------------------------------------------------------------
# views and data movement
# ---------------------------------------------------------------------------------------------

def view(op: OpView) -> Labels:
    """view/reshape/flatten/unflatten: dims are grouped by equal products; within a group the first
    non-1 input dim's letter goes to the first non-1 output dim, the rest are '.'."""
    src, dst = op.inputs[0], op.outputs[0]
    x, out = [NEVER] * len(src), [NEVER] * len(dst)
    a = [i for i, s in enumerate(src) if s != 1]
    b = [j for j, s in enumerate(dst) if s != 1]
    i = j = 0
    free = iter(LETTERS)
    while i < len(a) and j < len(b):
        x[a[i]] = out[b[j]] = next(free)
        p, q = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while p != q:
            if p < q:
                p, i = p * src[a[i]], i + 1
            else:
                q, j = q * dst[b[j]], j + 1
    return _make(["".join(x)], ["".join(out)], "view")


def alias(op: OpView) -> Labels:
    """Ops that return their input unchanged as a view (alias, detach)."""
    x = _free(op.inputs[0])
    return _make([x], [x] * len(op.outputs), "view")


def transpose(op: OpView) -> Labels:
    """transpose(x, d0, d1) and t(x): letters swap places."""
    shape = op.inputs[0]
    x = _free(shape)
    if len(shape) < 2:
        return _make([x], [x], "view")
    d0, d1 = _dim(op.arg("dim0", 0), len(shape)), _dim(op.arg("dim1", 1), len(shape))
    out = list(x)
    out[d0], out[d1] = out[d1], out[d0]
    return _make([x], ["".join(out)], "view")


def permute(op: OpView) -> Labels:
    """permute(x, dims): letters follow the permutation."""
    shape = op.inputs[0]
    x = _free(shape)
    return _make([x], ["".join(x[_dim(d, len(shape))] for d in op.arg("dims"))], "view")


def unsqueeze(op: OpView) -> Labels:
    """unsqueeze/squeeze: size-1 dims appear or disappear; others keep their letters."""
    x = _free(op.inputs[0])
    out = _free(op.outputs[0])
    kept = x.replace(NEVER, "")
    out_letters = iter(kept)
    out = "".join(NEVER if c == NEVER else next(out_letters) for c in out)
    return _make([x], [out], "view")


def expand(op: OpView) -> Labels:
    """expand: new leading dims and expanded size-1 dims are '.', others keep their letters."""
    shape, out_shape = op.inputs[0], op.outputs[0]
    out = _free(out_shape)
    x = _aligned(shape, out, out_shape)
    offset = len(out_shape) - len(shape)
    out = "".join(NEVER if j < offset or shape[j - offset] == 1 else c for j, c in enumerate(out))
    return _make([x], [out], "view")


def slice_(op: OpView) -> Labels:
    """slice(x, dim, start, end, step): the sliced dim is '.' unless the slice keeps all of it."""
    shape, out_shape = op.inputs[0], op.outputs[0]
    dim = _dim(op.arg("dim", 0), len(shape))
    x = _free(shape)
    if out_shape[dim] != shape[dim]:
        x = x[:dim] + NEVER + x[dim + 1:]
    return _make([x], [x], "view")


def select(op: OpView) -> Labels:
    """select(x, dim, index): the selected dim disappears."""
    shape = op.inputs[0]
    dim = _dim(op.arg("dim"), len(shape))
    x = _free(shape)
    x = x[:dim] + NEVER + x[dim + 1:]
    return _make([x], [x[:dim] + x[dim + 1:]], "view")


def split(op: OpView) -> Labels:
    """split/chunk/unbind: the split dim is '.'; each output keeps the other letters."""
    shape = op.inputs[0]
    dim = _dim(op.arg("dim", 0), len(shape))
    x = _free(shape)
    x = x[:dim] + NEVER + x[dim + 1:]
    if op.target.startswith("aten.unbind"):
        return _make([x], [x[:dim] + x[dim + 1:]] * len(op.outputs), "view")
    return _make([x], [x] * len(op.outputs), "view")


def cat(op: OpView) -> Labels:
    """cat(tensors, dim): the concatenated dim is '.'; the others are shared by all inputs."""
    out_shape = op.outputs[0]
    dim = _dim(op.arg("dim", 0), len(out_shape))
    out = _free(out_shape)
    out = out[:dim] + NEVER + out[dim + 1:]
    inputs = [out if len(s) == len(out_shape) else NEVER * len(s) for s in op.inputs]
    return _make(inputs, [out], "view")


def stack(op: OpView) -> Labels:
    """stack(tensors, dim): the new dim is '.'; the others are shared by all inputs."""
    out_shape = op.outputs[0]
    dim = _dim(op.arg("dim", 0), len(out_shape))
    out = _free(out_shape)
    out = out[:dim] + NEVER + out[dim + 1:]
    x = out[:dim] + out[dim + 1:]
    return _make([x] * len(op.inputs), [out], "view")


def repeat_along_dim(op: OpView) -> Labels:
    """repeat_interleave(x, repeats, dim) / pad: the dims that change size are '.'."""
    shape, out_shape = op.inputs[0], op.outputs[0]
    x = _free(shape)
    if len(shape) != len(out_shape):  # repeat_interleave without dim flattens
        return replicate_only(op, "view")
    x = "".join(c if shape[i] == out_shape[i] else NEVER for i, c in enumerate(x))
    return _make([x] + [NEVER * len(s) for s in op.inputs[1:]], [x], "view")


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------

def _family(rule: Rule, spec: str) -> dict[str, Rule]:
    """{"aten.<name>": rule} for each whitespace-separated overload name in ``spec``."""
    return {"aten." + name: rule for name in spec.split()}


RULES: dict[str, dict[str, Rule]] = {
    "matmul": {
        "aten.mm.default": mm, "aten.bmm.default": bmm, "aten.addmm.default": addmm,
        "aten.baddbmm.default": addmm, "aten.matmul.default": matmul, "aten.linear.default": linear,
    },
    "pointwise": {
        **_family(pointwise, """
            add.Tensor add.Scalar add_.Tensor add_.Scalar sub.Tensor sub.Scalar sub_.Tensor rsub.Scalar
            rsub.Tensor mul.Tensor mul.Scalar mul_.Tensor mul_.Scalar div.Tensor div.Scalar div.Tensor_mode
            div_.Tensor div_.Scalar neg.default pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar
            rsqrt.default sqrt.default exp.default log.default abs.default reciprocal.default sign.default
            tanh.default sigmoid.default gelu.default silu.default relu.default relu_.default
            leaky_relu.default elu.default hardtanh.default erf.default cos.default sin.default
            clamp.default clamp_min.default clamp_max.default minimum.default maximum.default
            where.self where.ScalarSelf where.ScalarOther masked_fill.Scalar masked_fill.Tensor
            masked_fill_.Scalar eq.Tensor eq.Scalar ne.Tensor ne.Scalar lt.Tensor lt.Scalar le.Tensor
            le.Scalar gt.Tensor gt.Scalar ge.Tensor ge.Scalar __and__.Tensor __or__.Tensor
            bitwise_and.Tensor bitwise_or.Tensor bitwise_not.default logical_not.default
            logical_and.default logical_or.default to.dtype to.dtype_layout to.device to.other
            _to_copy.default clone.default contiguous.default type_as.default dropout.default
            native_dropout.default
        """),
        "aten.broadcast_tensors.default": broadcast_tensors,
    },
    "reduction": _family(reduction, """
        sum.default sum.dim_IntList mean.default mean.dim amax.default amin.default max.dim min.dim
    """),
    "along_dim": {
        **_family(along_dim, "softmax.int _softmax.default log_softmax.int _log_softmax.default cumsum.default"),
        "aten.diff.default": diff,
    },
    "norm": {
        **_family(layer_norm, "layer_norm.default native_layer_norm.default rms_norm.default"),
        **_family(batch_norm, """
            batch_norm.default native_batch_norm.default _native_batch_norm_legit.default
            _native_batch_norm_legit_no_training.default
        """),
    },
    "loss": {
        **_family(cross_entropy, "cross_entropy_loss.default nll_loss.default nll_loss_nd.default nll_loss_forward.default"),
        "aten.mse_loss.default": mse_loss,
    },
    "embedding": {"aten.embedding.default": embedding},
    "attention": {"aten.scaled_dot_product_attention.default": attention},
    "convolution": _family(convolution, "convolution.default conv1d.default conv2d.default conv3d.default"),
    "pool": _family(adaptive_avg_pool, "adaptive_avg_pool2d.default adaptive_avg_pool1d.default"),
    "indexing": {"aten.index_select.default": index_select, "aten.gather.default": gather,
                 "aten.index.Tensor": index},
    "view": {
        **_family(view, "view.default reshape.default _unsafe_view.default flatten.using_ints unflatten.int"),
        **_family(alias, "alias.default detach.default"),
        **_family(transpose, "transpose.int t.default"),
        "aten.permute.default": permute,
        **_family(unsqueeze, "unsqueeze.default squeeze.default squeeze.dim squeeze.dims"),
        "aten.expand.default": expand,
        "aten.slice.Tensor": slice_,
        "aten.select.int": select,
        **_family(split, "split.Tensor split_with_sizes.default chunk.default unbind.int"),
        "aten.cat.default": cat,
        "aten.stack.default": stack,
        **_family(repeat_along_dim, "repeat_interleave.self_int pad.default constant_pad_nd.default"),
    },
    "factory": _family(factory, """
        arange.default arange.start arange.start_step zeros.default ones.default full.default empty.memory_format
        new_ones.default new_zeros.default new_full.default new_empty.default zeros_like.default ones_like.default
        full_like.default empty_like.default scalar_tensor.default
    """),
}

#: aten overload name -> (family, rule)
_BY_TARGET: dict[str, tuple[str, Rule]] = {
    target: (family, rule) for family, rules in RULES.items() for target, rule in rules.items()}


def family_of(target: str) -> str:
    """The rule family of an aten overload name ('replicate' for ops without a rule)."""
    return _BY_TARGET[target][0] if target in _BY_TARGET else "replicate"


def labels_for(node: torch.fx.Node) -> dict | None:
    """The graph document's ``labels`` for an op node (None for placeholders and non-op nodes)."""
    if node.op != "call_function":
        return None
    op = OpView(node)
    entry = _BY_TARGET.get(op.target)
    if entry is None:
        return kept_elementwise(op) if is_elementwise(op.target) else replicate_only(op)
    return entry[1](op)


def kept_elementwise(op: OpView) -> Labels:
    """A kept custom Function declared elementwise (cauto.profiler.declare_elementwise): every tensor, inputs
    and outputs, shares one set of letters when all have one shape; otherwise it runs replicated."""
    shapes = op.inputs + op.outputs
    if not shapes or len(set(shapes)) != 1:
        return replicate_only(op)
    spec = _free(shapes[0])
    return _make([spec] * len(op.inputs), [spec] * len(op.outputs), "pointwise")
