"""The local program (cauto.runtime.lowering) in one process on a fake group: what runs per step.

Parity of the local program with one process is checked on gloo ranks (test_runtime.py, every
job runs it; ``gpt_tp_dtensor`` keeps the DTensor interpreter covered, ``gpt_tp_compiled`` the
inductor-compiled program). Here: no DTensor op runs inside a data-parallel step, refusals, and
what the generated code shows.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fake_world, plan_for, zoo_capture
from test_runtime import KW, megatron
from torch.utils._python_dispatch import TorchDispatchMode


class _DTensorOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(isinstance(a, DTensor) for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _model(lowering: str, tp: bool = False, **apply_kwargs):
    from cauto.profiler import zoo
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh

    fake_world(2)
    axes = ["tp" if tp else "dp"]
    placement = dict(inputs="R", params=megatron("gpt", 1)) if tp else dict(inputs="S(0)")
    plan = plan_for("gpt", KW["gpt"], (2,), axes, **placement)
    cap = zoo_capture("gpt", KW["gpt"])
    model = apply(lambda: zoo.gpt(**KW["gpt"]), plan, make_mesh((2,), axes), seed=0, captured=cap,
                  lowering=lowering, **apply_kwargs)
    return model, zoo.gpt(**KW["gpt"])[1]


@pytest.mark.parametrize("lowering", ["local", "dtensor"])
def test_data_parallel_step_runs_no_dtensor_op_when_lowered(lowering):
    """The DDP-equivalent plan: the local program's step (forward, backward, AdamW) calls no ATen op on a
    DTensor; the interpreter calls hundreds (this is what the test tells apart)."""
    model, batch = _model(lowering)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**batch).backward()
    opt.step()
    opt.zero_grad()
    with _DTensorOps() as seen:
        model(**batch).backward()
        opt.step()
    if lowering == "local":
        assert seen.ops == []
        assert all(not hasattr(p, "placements") for p in model.parameters())
        assert model.lowered.traces == 1  # traced once, ahead of the first step
    else:
        assert len(seen.ops) > 100


def test_sharded_parameters_stay_dtensors_and_state_dict_is_sharded():
    """Tensor parallelism: parameters stay DTensors at the boundary (state_dict, checkpoints, optimizers);
    the step's forward and backward run no DTensor op besides storing each gradient."""
    from torch.distributed.tensor import DTensor

    model, batch = _model("local", tp=True)
    sd = model.state_dict()
    assert isinstance(sd["blocks.0.fc.weight"], DTensor) and str(sd["blocks.0.fc.weight"].placements) == "(Shard(dim=0),)"
    model(**batch).backward()
    assert isinstance(model.get_parameter("blocks.0.fc.weight").grad, DTensor)
    model.zero_grad()  # (accumulating into existing DTensor gradients is a DTensor add per parameter)
    with _DTensorOps() as seen:
        model(**batch).backward()
    # only the boundary: autograd detaching each new DTensor gradient as it stores it, once per parameter
    assert set(seen.ops) <= {"aten.detach.default"}, seen.ops
    assert len(seen.ops) <= sum(isinstance(p, DTensor) for p in model.parameters())


def test_compile_refuses_dtensor_lowering():
    from cauto.runtime.apply import PlanMismatchError

    with pytest.raises(PlanMismatchError, match="compile=True needs the local program"):
        _model("dtensor", compile=True)


def test_generated_code_shows_local_forward_and_backward_with_collectives():
    model, _ = _model("local", tp=True)
    code = model.generated_code
    assert "class LocalForward" in code and "class LocalBackward" in code
    forward, backward = code[code.index("class LocalForward"):].split("class LocalBackward")
    assert "torch.ops._c10d_functional.all_reduce.default" in forward
    assert "COLLECTIVE all_reduce over mesh axis 0 (tp)" in backward
    assert "DTensor" not in forward + backward


def test_data_parallel_gradients_are_bucketed_in_the_backward_graph_and_overlap_it():
    """Plain (replicated) parameters: their gradients are all-reduced inside the backward graph, in
    buckets of at most bucket_bytes issued as soon as their last gradient exists, so every bucket but
    the last has backward compute after it; GradSync reports them as its buckets."""
    model, batch = _model("local", bucket_bytes=16384)
    backward = model.lowered.graphs["backward"]
    nodes = list(backward.graph.nodes)
    reduces = [i for i, n in enumerate(nodes) if str(n.target) == "_c10d_functional.all_reduce_.default"
               and str(n.args[0].target) == "aten.cat.default"]
    buckets = model.lowered.grad_buckets
    assert len(reduces) == len(buckets) >= 3
    bookkeeping = ("aten.view", "aten.cat", "aten.split", "aten.t.", "aten._unsafe_view", "_c10d_functional")
    compute = [i for i, n in enumerate(nodes) if n.op == "call_function" and str(n.target).startswith("aten.")
               and not str(n.target).startswith(bookkeeping)]
    assert all(any(c > r for c in compute) for r in reduces[:-1])  # overlapped with later backward compute
    model(**batch).backward()
    assert model.grad_sync.last_buckets == buckets and model.grad_sync.last_overlapped == len(buckets) - 1
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(b for _, _, b in buckets) == total  # every gradient reduced exactly once
    # the gradients view their bucket's buffer, which the all-reduce wrote in place (no second copy)
    assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == len(buckets)


def test_a_plan_the_program_cannot_run_fails_before_the_first_step_naming_node_module_and_placements():
    """A parameter whose output the plan places Partial(sum) (found by the fuzz test): refused when the
    program is lowered, with the node, its module path and its planned placements in one line."""
    from cauto.profiler import zoo
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh
    from cauto.runtime.lowering import LoweringError

    fake_world(2)
    plan = plan_for("gpt", KW["gpt"], (2,), ["dp"], inputs="S(0)")
    (param,) = [n for n, e in plan["params"].items() if e["target"] == "blocks.0.fc.weight"]
    plan["nodes"][param]["outputs"] = [["P(sum)"]]
    cap = zoo_capture("gpt", KW["gpt"])
    with pytest.raises(LoweringError) as info:
        apply(lambda: zoo.gpt(**KW["gpt"]), plan, make_mesh((2,), ["dp"]), seed=0, captured=cap,
              check_placements=False)
    message = str(info.value)
    assert "\n" not in message and "blocks.0.fc" in message and "P(sum)" in message, message
    assert "solve the plan again" in message
