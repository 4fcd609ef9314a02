"""Stamped capture (three blocks exported, the rest stamped) against a whole-model export.

For every zoo model: the same graph (node names, ops, arguments, shapes and dtypes, module paths,
signature, state), the same fingerprint, the same graph document and profile, and a graph that runs
on real tensors like the eager model (loss and the gradients of a stamped block).
"""

from __future__ import annotations

import functools
import json
import types

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from cauto.profiler import capture, profile, size_hint, zoo
from cauto.profiler.capture import LossWrapper, output_tensors, split_inputs
from cauto.profiler.stamp import STAMP_ENV, differences, interchangeable

STAMPED = [
    ("gpt", {"layers": 5}),
    ("gpt", {"layers": 5, "checkpoint": True}),
    ("llama", {"layers": 6}),
    ("hf_gpt2", {"layers": 5}),
    ("hf_gpt2", {"layers": 5, "checkpoint": True}),
    ("hf_llama", {"layers": 5}),
    ("hf_llama", {"layers": 5, "dtype": torch.bfloat16}),
    ("hf_bert", {"layers": 5}),
]
NOT_STAMPED = [("mlp", {"layers": 6}), ("cnn", {"blocks": 5}), ("gpt", {"layers": 3})]


def _factory(name: str, kwargs: dict):
    fn = functools.partial(zoo.ZOO[name], **kwargs)
    fn.__name__ = name
    return fn


def _case_id(case) -> str:
    name, kwargs = case
    return name + "".join(f"-{k}={v}" for k, v in kwargs.items())


_CAPTURES: dict = {}


def _both(name: str, kwargs: dict):
    """(stamped capture, whole-model capture) of a zoo factory, cached per test session."""
    key = _case_id((name, kwargs))
    if key not in _CAPTURES:
        fn = _factory(name, kwargs)
        _CAPTURES[key] = (capture(fn), capture(fn, stamp=False))
    return _CAPTURES[key]


def _signature(cap) -> list[tuple]:
    rows = []
    for node in cap.graph.nodes:
        shapes = [(tuple(t.shape), t.dtype) for t in output_tensors(node)]
        rows.append((node.name, node.op, str(node.target), shapes, node.meta.get("stack_trace")))
    return rows


@pytest.mark.parametrize("case", STAMPED + NOT_STAMPED, ids=_case_id)
def test_capture_equals_the_whole_model_export(case):
    name, kwargs = case
    stamped, whole = _both(name, kwargs)
    assert stamped.stamping.startswith("stamped") == (case in STAMPED), stamped.stamping
    assert whole.stamping == "stamping off"
    assert differences(stamped.exported, whole.exported) == []
    assert _signature(stamped) == _signature(whole)  # names, ops, targets, shapes, dtypes, stack traces
    assert stamped.placeholders == whole.placeholders  # parameter names and their model paths
    assert stamped.tied == whole.tied
    assert stamped.structure() == whole.structure()
    assert stamped.fingerprint() == whole.fingerprint()
    assert stamped.checkpoint_regions() == whole.checkpoint_regions()


@pytest.mark.parametrize("case", STAMPED, ids=_case_id)
def test_profile_and_graph_document_are_unchanged(case):
    name, kwargs = case
    stamped, whole = _both(name, kwargs)
    fn = _factory(name, kwargs)
    a, b = profile(fn, cap=stamped), profile(fn, cap=whole)
    assert (a.peak_bytes, a.baseline_bytes, a.phases, a.phase_steps) == (b.peak_bytes, b.baseline_bytes, b.phases,
                                                                        b.phase_steps)
    assert a.nodes == b.nodes
    assert json.dumps(a.to_graph(), sort_keys=True) == json.dumps(b.to_graph(), sort_keys=True)


def _run_graph(cap, model: nn.Module, inputs) -> torch.Tensor:
    """Run the captured graph (traced on meta) on the real model's tensors and inputs; return the loss."""
    gm = torch.fx.GraphModule(torch.nn.Module(), _on_cpu(cap.graph))
    args, kwargs = split_inputs(inputs)
    user = iter(t for t in pytree.tree_leaves((args, kwargs)))
    flat = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        kind, target = cap.placeholders[node.name]
        if kind == "input":
            flat.append(next(user))
        else:
            obj = model
            for part in target.split("."):
                obj = getattr(obj, part)
            flat.append(obj)
    (loss,) = gm(*flat)
    return loss


def _on_cpu(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    meta, cpu = torch.device("meta"), torch.device("cpu")
    for node in copy.nodes:
        node.args, node.kwargs = pytree.tree_map(lambda a: cpu if isinstance(a, torch.device) and a == meta else a,
                                                 (node.args, node.kwargs))
    return copy


@pytest.mark.parametrize("case", [STAMPED[1], STAMPED[2], STAMPED[3], STAMPED[5], STAMPED[7]], ids=_case_id)
def test_stamped_graph_runs_like_the_eager_model(case):
    name, kwargs = case
    stamped, whole = _both(name, kwargs)
    torch.manual_seed(0)
    model, inputs = _factory(name, kwargs)()
    model.train()
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False
    args, kw = split_inputs(inputs)
    eager = LossWrapper(model)(*args, **kw)
    eager.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = _run_graph(stamped, model, inputs)
    assert torch.equal(loss, _run_graph(whole, model, inputs))  # the very same ops
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)
    loss.backward()
    last = [n for n in eager_grads if ".4." in n]  # block 4 is stamped (blocks 0-2 are exported)
    assert last
    for n in last:
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, eager_grads[n], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ when not to stamp

class _Block(nn.Module):
    def __init__(self, dim: int, scale: float = 1.0):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.scale = scale

    def forward(self, x):
        return x + self.scale * F.gelu(self.fc(x))


class _Stack(nn.Module):
    """Blocks in a ModuleList; ``odd`` doubles every odd block's output, ``mean`` divides by the count."""

    def __init__(self, n: int = 5, dim: int = 8, scales=None, odd: bool = False, mean: bool = False,
                 select: bool = False, last: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(dim, (scales or [1.0] * n)[i]) for i in range(n))
        self.odd, self.mean, self.select, self.last = odd, mean, select, last
        self.config = types.SimpleNamespace(num_hidden_layers=n)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            special = (self.odd and i % 2) or (self.last and i == self.config.num_hidden_layers - 1)
            x = block(x) * (2.0 if special else 1.0)
        if self.select:  # a data-dependent size after the blocks
            return torch.masked_select(x, x > 0).sum()
        return x.sum() / (len(self.blocks) if self.mean else 1)


def _stack(**kw):
    return _Stack(**kw), (torch.randn(3, 8),)


def test_plain_stack_is_stamped_and_exact():
    fn = functools.partial(_stack)
    cap, whole = capture(fn), capture(fn, stamp=False)
    assert cap.stamping == "stamped blocks.3..4 from blocks.2"
    assert differences(cap.exported, whole.exported) == []


class _Sequential(nn.Module):
    def __init__(self, n: int = 6, dim: int = 8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(*[_Block(dim) for _ in range(n)])

    def forward(self, x):
        return self.blocks(self.inp(x)).pow(2).mean()


def test_sequential_blocks_are_stamped_and_exact():
    def fn():
        return _Sequential(), (torch.randn(2, 8),)

    cap, whole = capture(fn), capture(fn, stamp=False)
    assert cap.stamping == "stamped blocks.3..5 from blocks.2"
    assert differences(cap.exported, whole.exported) == []


@pytest.mark.parametrize("kw, why", [
    ({"scales": [1.0, 1.0, 1.0, 0.5, 1.0]}, "no repeated blocks"),  # an attribute differs: never stamped
    ({"odd": True}, "differ from their export"),  # the loop branches on the index
    ({"mean": True}, "differ from their export"),  # the code after the blocks depends on their number
    ({"last": True}, "differ from their export"),  # the last layer by the config is special
    ({"select": True}, "data-dependent sizes"),
])
def test_models_that_do_not_repeat_exactly_fall_back_to_the_whole_export(kw, why):
    fn = functools.partial(_stack, **kw)
    with size_hint(masked_select=5):
        cap, whole = capture(fn), capture(fn, stamp=False)
    assert why in cap.stamping
    assert differences(cap.exported, whole.exported) == []


def test_index_valued_attributes_are_allowed():
    blocks = [_Block(4) for _ in range(4)]
    for i, b in enumerate(blocks):
        b.layer_idx = i
    assert interchangeable(blocks)
    blocks[3].layer_idx = 7
    assert not interchangeable(blocks)


def test_verify_mode_exports_both_ways(monkeypatch):
    monkeypatch.setenv(STAMP_ENV, "verify")
    cap = capture(_factory("gpt", {"layers": 4}))
    assert cap.stamping.endswith("(verified)")
    monkeypatch.setenv(STAMP_ENV, "0")
    assert capture(_factory("gpt", {"layers": 4})).stamping == "stamping off"
