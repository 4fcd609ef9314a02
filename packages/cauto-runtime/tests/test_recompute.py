"""The ops backward recomputes are exactly the plan's checkpoint regions (nested ones once per level).

One process on a fake 2-rank group (shapes and dispatch are real; the numbers are not checked
here, the gloo parity tests do that): every node of a checkpoint sub-GraphModule is run through an
``fx.Interpreter`` that records its name when autograd's engine is running it (recomputation).
Expected: each region node once per region that contains it (an outer region's recomputation runs
its inner region's forward again, and the inner region's backward recomputes it once more), and
nothing else. The redistributions a region's nodes consume run again with them.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx
from conftest import fake_world, plan_for, zoo_capture
from test_runtime import KW, megatron

ATTENTION = ["linear", "view", "transpose", "linear_1", "view_1", "transpose_1", "linear_2", "view_2", "transpose_2",
             "scaled_dot_product_attention", "transpose_3", "reshape", "linear_3"]
MLP = ["layer_norm_1", "linear_4", "gelu", "linear_5"]
BLOCK = ["layer_norm", *ATTENTION, "add_1", *MLP, "add_2"]


class _Recorder(torch.fx.Interpreter):
    def __init__(self, module, seen: list[str]):
        super().__init__(module)
        self.seen = seen

    def run_node(self, n):
        if n.op == "call_function" and torch._C._current_graph_task_id() != -1:
            self.seen.append(n.name)
        return super().run_node(n)


def _apply(regions: list[dict], tp: bool, force: dict | None = None, lowering: str = "dtensor"):
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh

    fake_world(2)
    placement = dict(inputs="R", params=megatron("gpt", 1)) if tp else dict(inputs="S(0)")
    plan = plan_for("gpt", KW["gpt"], (2,), ["tp" if tp else "dp"], checkpoint=regions, force=force, **placement)
    cap = zoo_capture("gpt", KW["gpt"])
    from cauto.profiler import zoo

    return apply(lambda: zoo.gpt(**KW["gpt"]), plan, make_mesh((2,), ["tp" if tp else "dp"]), seed=0, captured=cap,
                 lowering=lowering)


def _recomputed(regions: list[dict], tp: bool, force: dict | None = None) -> tuple[Counter, Counter, Counter]:
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh

    fake_world(2)
    placement = dict(inputs="R", params=megatron("gpt", 1)) if tp else dict(inputs="S(0)")
    plan = plan_for("gpt", KW["gpt"], (2,), ["tp" if tp else "dp"], checkpoint=regions, force=force, **placement)
    cap = zoo_capture("gpt", KW["gpt"])
    from cauto.profiler import zoo

    model = apply(lambda: zoo.gpt(**KW["gpt"]), plan, make_mesh((2,), ["tp" if tp else "dp"]), seed=0, captured=cap,
                  lowering="dtensor")  # the DTensor program: its region sub-modules run (and are recorded) per step
    seen: list[str] = []
    for name, sub in model.executable.module.named_modules():
        if name.split(".")[-1].startswith("checkpoint_") and isinstance(sub, torch.fx.GraphModule):
            sub.forward = (lambda s: lambda *args: _Recorder(s, seen).run(*args))(sub)
    _, batch = zoo.gpt(**KW["gpt"])
    model(**batch).backward()
    depth = Counter()
    for region in regions:
        depth.update(region["nodes"])
    plan_nodes = set(plan["nodes"])
    nested_calls = ("checkpointed", "getitem")  # an outer region calling its inner one
    extra = Counter(n for n in seen if n not in plan_nodes and not n.startswith(nested_calls))
    return Counter(n for n in seen if n in plan_nodes), depth, extra


def test_recomputed_ops_are_the_plans_regions_nested():
    regions = [{"nodes": BLOCK, "children": [1]}, {"nodes": MLP}]
    recomputed, expected, _ = _recomputed(regions, tp=False)
    assert recomputed == expected
    assert recomputed["linear_4"] == 2 and recomputed["linear"] == 1 and "add" not in recomputed


def test_recomputed_redistributions_run_again():
    """A plan edge into a region (batch-split activations all-gathered for a replicated layer norm):
    its redistribution runs again with its consumer, once per enclosing region."""
    regions = [{"nodes": BLOCK, "children": [1]}, {"nodes": ["layer_norm", *ATTENTION]}]
    recomputed, expected, extra = _recomputed(regions, tp=False, force={"layer_norm": ["R", "R", "R"]})
    assert recomputed == expected
    # the all-gather into layer_norm (its redistribution node), recomputed by both regions, and nothing else
    assert len(extra) == 1 and sum(extra.values()) == 2, extra


def _op_counts(gm: torch.fx.GraphModule) -> Counter:
    names = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            target = str(n.target)
            names[target.split(".")[1] if target.startswith(("aten.", "_c10d_functional.", "cauto.")) else n.target.__name__] += 1
    return names


def test_lowered_program_recomputes_each_region_op_in_backward():
    """The local program (lowering.py): a region's forward ops appear again in the backward graph, its
    activations are not saved, and a redistribution inside the region (the all-gather into a replicated
    layer norm) is recomputed with it."""
    plain = _apply([], tp=False, force={"layer_norm": ["R", "R", "R"]}, lowering="local").lowered.graphs
    regions = [{"nodes": BLOCK}]  # (nested regions run on the interpreter: the plan counts each level)
    ckpt = _apply(regions, tp=False, force={"layer_norm": ["R", "R", "R"]}, lowering="local").lowered.graphs
    more = _op_counts(ckpt["backward"]) - _op_counts(plain["backward"])
    assert more["gelu"] == 1 and more["native_layer_norm"] == 2, more
    assert more["flash_attention_cpu_recomputable"] == 1, more
    assert more["all_gather_into_tensor"] == 1, more  # the region's edge runs again in backward
    saved = len(ckpt["forward"].graph.output_node().args[0])
    assert saved < len(plain["forward"].graph.output_node().args[0])


def test_nested_regions_run_on_the_interpreter():
    regions = [{"nodes": BLOCK, "children": [1]}, {"nodes": MLP}]
    assert _apply(regions, tp=False, lowering="local").lowered is None


def test_compiled_program_recomputes_a_region_with_attention_as_eager_does():
    """compile=True over a plan with a checkpoint region around attention: the region's CPU flash
    attention (tagged random by torch) is recomputed as ``cauto::flash_attention_cpu_recomputable``,
    an op inductor takes; loss and gradients equal the uncompiled local program's."""
    from cauto.profiler import zoo
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh

    fake_world(2)
    plan = plan_for("gpt", KW["gpt"], (2,), ["dp"], checkpoint=[{"nodes": BLOCK}],
                    force={"layer_norm": ["R", "R", "R"]}, inputs="S(0)")
    cap = zoo_capture("gpt", KW["gpt"])
    torch.manual_seed(1)
    batch = zoo.gpt(**KW["gpt"])[1]
    results = []
    for compile in (False, True):
        model = apply(lambda: zoo.gpt(**KW["gpt"]), plan, make_mesh((2,), ["dp"]), seed=0, captured=cap,
                      compile=compile)
        loss = model(**batch)
        loss.backward()
        results.append((loss.detach(), [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                                        for p in model.parameters()]))
        assert "flash_attention_cpu_recomputable" in model.lowered.code()
    torch.testing.assert_close(results[0][0], results[1][0])
    for eager, compiled in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(eager, compiled, rtol=1e-5, atol=1e-6)
