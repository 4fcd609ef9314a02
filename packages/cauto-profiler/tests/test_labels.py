"""Sharding labels checked against DTensor's own sharding propagation.

For every op node of every zoo graph (and of a small module using every rule family) and every
strategy its labels allow on a 1-D mesh of 2 ranks (each splittable letter in turn, plus
all-Replicate), the op runs on DTensors with exactly those input placements (fake process group,
one process). DTensor must not redistribute any input, must not issue a collective, and must return
exactly the output placements the labels promise. Hand-written cases show that the splits the
labels refuse are the ones DTensor would redistribute for.
"""

from __future__ import annotations

import itertools
from collections import Counter

import jsonschema
import pytest
import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel

from cauto.plan import Labels
from cauto.plan.schema import load_schema
from cauto.profiler.capture import capture, output_tensors, tensor_inputs
from cauto.profiler.dtensor_adapter import fake_mesh, placement_is, sharded_call, to_dtensor
from cauto.profiler.labels import NEVER, family_of, labels_for
from cauto.profiler.zoo import ZOO

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support")

MESH_SIZE = 2
MODELS = ["mlp", "cnn", "gpt", "llama", "hf_gpt2", "hf_llama", "hf_bert"]

#: ops of the zoo graphs that keep the replicate-only fallback (none: every op there has a rule)
EXPECTED_FALLBACK: dict[str, Counter] = {name: Counter() for name in MODELS}
_SCHEMA = load_schema("graph")
LABELS_SCHEMA = jsonschema.Draft202012Validator({**_SCHEMA["$defs"]["labels"], "$defs": _SCHEMA["$defs"]})


@pytest.fixture(scope="module")
def mesh():
    """A 1-D mesh of MESH_SIZE ranks on the fake process group, torn down after this module."""
    created = not dist.is_initialized()
    yield fake_mesh((MESH_SIZE,))
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def captures():
    return {}


def _capture(captures: dict, name: str):
    if name not in captures:
        captures[name] = capture(ZOO[name])
    return captures[name]


# ---------------------------------------------------------------------------------------------
# running one node on DTensors
# ---------------------------------------------------------------------------------------------

_NEEDS_GRAD: dict[torch.fx.Node, bool] = {}


def _needs_grad(node: torch.fx.Node) -> bool:
    """Whether a value requires grad in training (export's fake values of ops do not record it);
    matmul and view decompositions depend on it."""
    if node not in _NEEDS_GRAD:
        val = output_tensors(node)[0]
        _NEEDS_GRAD[node] = val.requires_grad if node.op == "placeholder" else (
            val.is_floating_point() and any(_needs_grad(a) for a in tensor_inputs(node)))
    return _NEEDS_GRAD[node]


def _materialize(val: torch.Tensor, requires_grad: bool, generator: torch.Generator) -> torch.Tensor:
    """A real CPU tensor with the shape, stride and dtype of a fake/meta value."""
    shape, stride = tuple(val.shape), tuple(val.stride())
    storage = 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0) if all(shape) else 0
    if val.dtype.is_floating_point:
        base = torch.randn(storage, generator=generator, dtype=val.dtype)
    elif val.dtype == torch.bool:
        base = torch.ones(storage, dtype=torch.bool)
    else:
        base = torch.zeros(storage, dtype=val.dtype)
    full = base.as_strided(shape, stride)
    if requires_grad:
        full = full.detach().requires_grad_()
    return full


def _meta_to_cpu(x):
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    if isinstance(x, str) and x == "meta":
        return "cpu"
    return x


def run_node(node: torch.fx.Node, placements: list, mesh):
    """Run ``node``'s op on DTensors whose placements are ``placements`` (one per tensor input)."""
    generator = torch.Generator().manual_seed(0)
    inputs = iter(placements)

    def convert(x):
        if isinstance(x, torch.fx.Node):
            tensors = output_tensors(x)
            if tensors:
                return to_dtensor(_materialize(tensors[0], _needs_grad(x), generator), next(inputs), mesh)
            return x.meta["val"]
        return _meta_to_cpu(x)

    args, kwargs = pytree.tree_map(convert, (node.args, node.kwargs),
                                   is_leaf=lambda x: isinstance(x, torch.fx.Node))
    if family_of(str(node.target)) != "attention":
        return sharded_call(node.target, args, kwargs)
    # DTensor cannot run CPU attention: _scaled_dot_product_flash_attention_for_cpu has no strategy,
    # and with a mask its decomposition-based propagation takes minutes. The math backend decomposes
    # into ops DTensor knows (its causal mask is a plain tensor: implicitly replicated).
    with sdpa_kernel(SDPBackend.MATH), implicit_replication():
        return sharded_call(node.target, args, kwargs)


def strategies(labels: dict, node: torch.fx.Node, mesh_shape: tuple[int, ...] = (MESH_SIZE,)) -> list[tuple]:
    """(name, input placements, expected output placements) for each strategy the labels allow on a
    mesh: per axis one splittable letter or none (as the solver enumerates them). An expected output
    placement is (kind, dim, reduce) per axis; a letter split on axes whose size product does not
    divide every dim holding it is left out."""
    ins = [tuple(output_tensors(a)[0].shape) for a in tensor_inputs(node)]
    outs = [tuple(t.shape) for t in output_tensors(node)]
    specs, shapes = labels["inputs"] + labels["outputs"], ins + outs
    letters = sorted(set("".join(specs)) - {NEVER} - set(labels.get("whole", "")))
    in_outputs = set("".join(labels["outputs"]))
    letters = [c for c in letters if c in in_outputs or labels.get("reduce")]
    result = []
    for combo in itertools.product([None, *letters], repeat=len(mesh_shape)):
        factor: dict[str, int] = {}
        for axis, c in enumerate(combo):
            if c:
                factor[c] = factor.get(c, 1) * mesh_shape[axis]
        if any(shape[s.index(c)] % f for c, f in factor.items() for s, shape in zip(specs, shapes) if c in s):
            continue
        in_place = [[Shard(s.index(c)) if c and c in s else Replicate() for c in combo] for s in labels["inputs"]]
        expected = [[("S", s.index(c), None) if c and c in s else
                     ("P", None, labels["reduce"]) if c and c not in in_outputs else ("R", None, None)
                     for c in combo] for s in labels["outputs"]]
        result.append(("+".join(c or "R" for c in combo), in_place, expected))
    return result


def check_node(node: torch.fx.Node, mesh) -> list[str]:
    """Problems of one node's labels (empty when DTensor agrees with every allowed strategy)."""
    labels = labels_for(node)
    where = f"{node.name} ({node.target})"
    problems = shape_problems(labels, node)
    if problems or not tensor_inputs(node):
        return [f"{where}: {p}" for p in problems]
    for name, placements, expected in strategies(labels, node, tuple(mesh.shape)):
        result = run_node(node, placements, mesh)
        if result.redistributed or result.error:
            if set(name.split("+")) == {"R"} and result.error and labels["rule"] == "replicate":
                continue  # DTensor cannot run this op at all; the fallback is the honest label
            problems.append(f"{where} {labels} split {name}: {result.redistributed or result.error}")
            continue
        if result.collectives:
            problems.append(f"{where} {labels} split {name}: {result.collectives} collectives")
        actual = result.output_placements
        if len(actual) != len(expected) or not all(
                placement_is(a, *e) for got, want in zip(actual, expected) for a, e in zip(got, want)):
            problems.append(f"{where} {labels} split {name}: outputs {actual}, labels promise {expected}")
    return problems


def shape_problems(labels: dict, node: torch.fx.Node) -> list[str]:
    """Structural checks: one char per dim, a letter has one size everywhere, whole letters are used."""
    ins = [tuple(output_tensors(a)[0].shape) for a in tensor_inputs(node)]
    outs = [tuple(t.shape) for t in output_tensors(node)]
    problems = []
    if len(labels["inputs"]) != len(ins) or len(labels["outputs"]) != len(outs):
        return [f"{labels} has {len(labels['inputs'])}/{len(labels['outputs'])} strings for "
                f"{len(ins)} inputs / {len(outs)} outputs"]
    sizes: dict[str, set] = {}
    for s, shape in zip(labels["inputs"] + labels["outputs"], ins + outs):
        if len(s) != len(shape):
            problems.append(f"label {s!r} for shape {shape}")
            continue
        for c, size in zip(s, shape):
            if c != NEVER and size != 0:  # an empty dim (CPU's no-training batch-norm statistics) splits into empties
                sizes.setdefault(c, set()).add(size)
        if len(s.replace(NEVER, "")) != len(set(s.replace(NEVER, ""))):
            problems.append(f"label {s!r} repeats a letter")
    if labels["rule"] != "view":  # a reshape moves a letter between dims of different sizes
        problems += [f"letter {c} has sizes {sorted(v)}" for c, v in sizes.items() if len(v) > 1]
    problems += [f"whole letter {c} is not used" for c in labels.get("whole", "") if c not in sizes]
    return problems


# ---------------------------------------------------------------------------------------------
# the zoo
# ---------------------------------------------------------------------------------------------

def check_graph(cap, mesh) -> list[str]:
    """Problems of every op node's labels in a capture (placeholders must have none)."""
    problems = []
    for node in cap.value_nodes():
        if node.op == "placeholder":
            assert labels_for(node) is None
            continue
        labels = labels_for(node)
        LABELS_SCHEMA.validate(labels)
        assert Labels.from_dict(labels).to_dict() == labels
        problems += check_node(node, mesh)
    return problems


@pytest.mark.parametrize("name", MODELS)
def test_zoo_labels_match_dtensor(name, mesh, captures):
    cap = _capture(captures, name)
    problems = check_graph(cap, mesh)
    assert not problems, f"{len(problems)} label problems in {name}:\n" + "\n".join(problems)
    ops = [n for n in cap.value_nodes() if n.op != "placeholder" and any(t.dim() for t in output_tensors(n))]
    splittable = [n for n in ops if len(strategies(labels_for(n), n)) > 1]
    assert len(splittable) >= 0.8 * len(ops), "most non-scalar ops must offer (and so test) a split"


@pytest.mark.parametrize("name", MODELS)
def test_zoo_fallbacks_are_few_and_listed(name, captures):
    cap = _capture(captures, name)
    fallbacks = Counter(str(n.target) for n in cap.value_nodes()
                        if n.op != "placeholder" and family_of(str(n.target)) == "replicate")
    assert fallbacks == EXPECTED_FALLBACK[name]


# ---------------------------------------------------------------------------------------------
# every rule family, including ops the zoo does not use
# ---------------------------------------------------------------------------------------------

class Everything(nn.Module):
    """One op (or a few) per rule; x (4, 8, 16), idx (4, 8) long, img (4, 4, 6)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))
        self.v = nn.Parameter(torch.randn(8))
        self.bias2d = nn.Parameter(torch.randn(32, 8))
        self.emb = nn.Parameter(torch.randn(10, 16))
        self.conv = nn.Conv1d(4, 6, 3)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("running_mean", torch.zeros(4))
        self.register_buffer("running_var", torch.ones(4))

    def forward(self, x, idx, img):
        aten = torch.ops.aten
        heads = x.unflatten(2, (2, 8)).transpose(1, 2)
        flat, targets = x.flatten(0, 1), idx.flatten()
        outs = [
            x @ self.w, torch.matmul(x, x.transpose(1, 2)), torch.matmul(x[0, 0], self.w), self.w @ self.v,
            torch.bmm(x, x.transpose(1, 2)), torch.mm(x[0], self.w),
            torch.baddbmm(x[:, :, :8].transpose(1, 2) @ x[:, :, :8], x.transpose(1, 2)[:, :8], x[:, :, :8]),
            torch.addmm(self.bias2d, flat, self.w),
            x.sum(dim=(0, 1)), x.sum(), x.mean(), x.amax(-1), x.amin(1, keepdim=True), x.max(dim=-1).values,
            F.softmax(x, -1), F.log_softmax(x, 1), x.cumsum(0),
            aten._softmax.default(x, 1, False), aten._log_softmax.default(x, 2, False),
            torch.cat([x, x], dim=1), torch.stack([x, x], 0), torch.mul(*x.split(8, dim=-1)),
            torch.add(*x.chunk(2, dim=0)), x.unbind(1)[3], x.permute(2, 0, 1), x.unflatten(2, (4, 4)),
            x[:, :1].squeeze(1), x.unsqueeze(0).expand(3, 4, 8, 16), x.repeat_interleave(2, dim=1),
            x.reshape(4, 2, 4, 16).sum(1), x.view(2, 2, 8, 16), x.view(4, 128).view(4, 8, 16), x[0].t(),
            aten._unsafe_view.default(x.clone(), [32, 16]), F.pad(x, (1, 1)),
            x.index_select(1, idx[0]), torch.gather(x, 2, idx.unsqueeze(-1).expand(4, 8, 16)), x[:, idx[0]],
            torch.where(x > 0, x, -x), x.masked_fill(x < 0, 0.0).clamp(-1, 1), aten._to_copy.default(x, dtype=torch.float64),
            F.silu(x) * F.gelu(x) + torch.tanh(x) - torch.rsqrt(x.abs() + 1) / x.pow(2).add(1), F.dropout(x, 0.5),
            torch.zeros(4, 4, device=x.device) + torch.ones(4, device=x.device) + torch.full((4,), 2.0, device=x.device),
            F.layer_norm(x, (16,)), F.layer_norm(x, (8, 16)), F.rms_norm(x, (16,), self.w[:, 0]),
            aten.native_layer_norm.default(x, [16], self.w[:, 0], None, 1e-5)[0],
            self.conv(self.bn(img)), aten.convolution.default(img, self.conv.weight, None, [1], [0], [1], False, [0], 1),
            aten.native_batch_norm.default(img, None, None, None, None, True, 0.1, 1e-5)[0],
            F.adaptive_avg_pool2d(img.unsqueeze(1), 2), F.embedding(idx, self.emb),
            F.nll_loss(F.log_softmax(flat, -1), targets, reduction="sum"),
            F.cross_entropy(x.transpose(1, 2), idx, label_smoothing=0.1),
            F.cross_entropy(flat, targets, reduction="none"), F.cross_entropy(flat, targets, ignore_index=3),
            F.mse_loss(x, x.detach() * 2), F.scaled_dot_product_attention(heads, heads, heads),
            *self.more_pointwise(x), *self.more_views(x), *self.overloads(x, idx, img),
            aten._native_batch_norm_legit.default(img, self.v[:4], None, self.running_mean, self.running_var,
                                                  True, 0.1, 1e-5)[0],
            aten._native_batch_norm_legit_no_training.default(img, None, self.v[:4], self.running_mean,
                                                              self.running_var, 0.1, 1e-5)[0],
            F.scaled_dot_product_attention(heads, heads, heads, attn_mask=torch.ones(4, 1, 8, 8, dtype=torch.bool, device=x.device)),
        ]
        return sum(o.float().sum() for o in outs)


    @staticmethod
    def more_pointwise(x):
        y = x.clone()
        y.mul_(2).add_(1).sub_(x).div_(2)
        pos, neg = x > 0, x < 1
        return [
            torch.sigmoid(x) + x.exp() + x.abs().add(1).log() + x.abs().sqrt() + torch.erf(x) + x.reciprocal(),
            F.leaky_relu(x) + F.elu(x) + F.hardtanh(x) + x.sign() + torch.minimum(x, -x) + torch.maximum(x, -x),
            x.clamp_min(0) + x.clamp_max(0) + (1 - x) + x / 2 + torch.div(x, x + 3, rounding_mode="floor"),
            2 ** x + x.abs().pow(x) + F.relu(x.clone(), inplace=True) + y,
            ((pos & neg) | ~pos | torch.logical_not(neg) | torch.logical_and(pos, neg) | torch.logical_or(pos, neg)),
            torch.where(pos, x, 0.0) + x.masked_fill(neg, x.sum()) + x.type_as(x.double()).detach(),
            x.new_zeros(3), torch.zeros_like(x) + torch.ones_like(x) + torch.full_like(x, 2.0),
        ]

    @staticmethod
    def overloads(x, idx, img):
        """aten overloads that Python code rarely produces, called directly."""
        aten = torch.ops.aten
        y, pos, neg = x.clone(), x > 0, x < 1
        aten.masked_fill_.Scalar(aten.div_.Scalar(aten.mul_.Scalar(aten.add_.Scalar(y, 1), 2), 2), pos, 0.0)
        flat, targets = x.flatten(0, 1), idx.flatten()
        return [
            aten.add.Scalar(x, 1), aten.sub.Scalar(x, 1), aten.mul.Scalar(x, 2), aten.div.Scalar(x, 2),
            aten.rsub.Tensor(x, x), aten.eq.Scalar(x, 0), aten.ne.Tensor(x, y), aten.lt.Tensor(x, y),
            aten.gt.Tensor(x, y), aten.ge.Tensor(x, y), aten.le.Scalar(x, 0), aten.bitwise_and.Tensor(pos, neg),
            aten.bitwise_or.Tensor(pos, neg), aten.where.ScalarSelf(pos, 0.0, x), aten.to.other(x, y.double()),
            aten.native_dropout.default(x, 0.5, True)[0], aten.min.dim(x, 1)[0],
            aten.constant_pad_nd.default(x, [1, 1]), aten.adaptive_avg_pool1d.default(img, [3]),
            aten.conv3d.default(img[:, None, None], torch.ones(2, 1, 1, 1, 3, device=x.device)),
            aten.nll_loss.default(flat, targets), aten.nll_loss_forward.default(flat, targets, None, 1, -100)[0],
            aten.arange.start(0, 4, device=x.device), aten.arange.start_step(0, 8, 2, device=x.device),
            aten.empty.memory_format([3], device=x.device), aten.empty_like.default(x), aten.new_empty.default(x, [3]),
            aten.new_full.default(x, [3], 1.0), aten.scalar_tensor.default(1.0, device=x.device), y,
        ]

    @staticmethod
    def more_views(x):
        a, b = x.split([4, 12], dim=-1)
        return [x[:, :1].squeeze(), x[:, :1, :1].squeeze((1, 2)), a.sum(-1) + b.sum(-1)]


def everything():
    return Everything(), (torch.randn(4, 8, 16), torch.zeros(4, 8, dtype=torch.long), torch.randn(4, 4, 6))


@pytest.fixture(scope="module")
def every_rule():
    return capture(everything)


def test_every_rule_family_matches_dtensor(every_rule, mesh):
    families = Counter(family_of(str(n.target)) for n in every_rule.value_nodes() if n.op != "placeholder")
    assert "replicate" not in families
    problems = check_graph(every_rule, mesh)
    assert not problems, f"{len(problems)} label problems:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# hand-written cases: what the labels say, and that refused splits are real redistributions
# ---------------------------------------------------------------------------------------------

def _node(cap, target: str, index: int = 0) -> torch.fx.Node:
    return [n for n in cap.value_nodes() if str(n.target) == target][index]


def _split(node: torch.fx.Node, dims: list[int | None], mesh):
    """Run ``node`` with input i sharded on dims[i] (None: replicated)."""
    return run_node(node, [Replicate() if d is None else Shard(d) for d in dims], mesh)


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain, self.biased = nn.Linear(16, 8, bias=False), nn.Linear(16, 8)
        self.norm, self.emb = nn.LayerNorm(8), nn.Embedding(10, 16)

    def forward(self, idx):
        x = self.emb(idx)
        h = self.norm(self.plain(x) + self.biased(x))
        return h.softmax(-1).mean(-1)


@pytest.fixture(scope="module")
def layers():
    return capture(lambda: (Layers(), (torch.zeros(4, 8, dtype=torch.long),)))


def test_linear_column_and_row_splits(layers, mesh):
    plain, biased = _node(layers, "aten.linear.default", 0), _node(layers, "aten.linear.default", 1)
    assert labels_for(plain) == {"inputs": ["abk", "nk"], "outputs": ["abn"], "reduce": "sum", "rule": "matmul"}
    assert labels_for(biased) == {"inputs": ["abk", "nk", "n"], "outputs": ["abn"], "whole": "k", "rule": "matmul"}
    column = _split(plain, [None, 0], mesh)
    assert placement_is(column.output_placements[0][0], "S", 2)
    row = _split(plain, [2, 1], mesh)
    assert placement_is(row.output_placements[0][0], "P", reduce="sum") and not row.redistributed
    assert _split(biased, [2, 1, None], mesh).redistributed  # the replicated bias would be added twice


def test_layer_norm_keeps_its_normalized_dim_whole(layers, mesh):
    node = _node(layers, "aten.layer_norm.default")
    labels = labels_for(node)
    assert labels["inputs"][0] == "abc" and labels["whole"] == "c"
    assert _split(node, [2, 0, 0], mesh).redistributed


def test_softmax_keeps_its_dim_whole(layers, mesh):
    node = _node(layers, "aten.softmax.int")
    assert labels_for(node)["whole"] == "c"
    assert _split(node, [2], mesh).redistributed


def test_mean_is_partial_avg(layers, mesh):
    node = _node(layers, "aten.mean.dim")
    assert labels_for(node) == {"inputs": ["abc"], "outputs": ["ab"], "reduce": "avg", "rule": "reduction"}
    assert placement_is(_split(node, [2], mesh).output_placements[0][0], "P", reduce="avg")


def test_embedding_vocab_split_is_not_offered(layers, mesh):
    node = _node(layers, "aten.embedding.default")
    assert labels_for(node) == {"inputs": [".h", "ab"], "outputs": ["abh"], "rule": "embedding"}
    # DTensor's row-wise embedding turns the replicated indices into a masked partial first
    assert _split(node, [0, None], mesh).redistributed


def test_two_mesh_axes_compose_except_nested_non_leading_dims(layers, mesh):
    """On a 2x2 mesh, two axes splitting different letters compose; one letter split on both axes
    (nested sharding) fails in DTensor for a linear's non-leading batch dim (its flatten to 2-D
    cannot unflatten the strided shard). The same holds for attention heads and convolution batch."""
    problems = check_graph(layers, fake_mesh((2, 2)))
    assert problems and all(" split b+b:" in p and "aten.linear.default" in p for p in problems), problems


def test_view_split_reuses_the_letter_for_the_outer_dim(mesh):
    def heads():
        class Heads(nn.Module):
            def forward(self, x):
                return x.view(4, 8, 2, 8).transpose(1, 2).reshape(4, 2, 64).view(4, 16, 8)
        return Heads(), (torch.randn(4, 8, 16),)

    cap = capture(heads)
    split, merge = _node(cap, "aten.view.default", 0), _node(cap, "aten.reshape.default")
    assert labels_for(split)["inputs"] == ["abc"] and labels_for(split)["outputs"] == ["abc."]
    assert labels_for(merge)["inputs"] == ["abc."] and labels_for(merge)["outputs"] == ["abc"]
    assert not check_graph(cap, mesh)


def test_unknown_ops_fall_back_to_replicate_only(mesh):
    class Flip(nn.Module):
        def forward(self, x):
            return x.flip(0)

    cap = capture(lambda: (Flip(), (torch.randn(4, 6),)))
    node = _node(cap, "aten.flip.default")
    assert family_of("aten.flip.default") == "replicate"
    assert labels_for(node) == {"inputs": [".."], "outputs": [".."], "rule": "replicate"}
    assert not check_graph(cap, mesh)
