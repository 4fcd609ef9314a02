"""Stock Hugging Face architectures that the zoo's plain models do not cover, end to end.

CLIP (a dual encoder) trains with ``return_loss=True``: a non-tensor example input, which is a
constant of the capture and no graph input. The profile is solved on a 2x2 mesh under a budget that
forces sharding, and the plan runs one step through cauto.runtime on torch's fake process group
(one process, world size 4: the DTensor program runs, collectives are issued, nothing is sent).
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")

from cauto.profiler import profile, zoo  # noqa: E402
from cauto.solver import cluster_for_mesh, solve  # noqa: E402

CLIP = functools.partial(zoo.hf_clip, layers=1)


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    if created:
        dist.destroy_process_group()


def test_clip_non_tensor_input_is_a_constant_and_plans_on_2x2(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    from cauto.runtime.apply import apply

    prof = profile(CLIP)
    cap = prof.capture
    assert cap.constants == {"return_loss": True}
    doc = prof.to_graph()
    inputs = [n for n in doc["nodes"] if n["kind"] == "input"]
    assert [n["id"] for n in inputs] == ["input_ids", "pixel_values"] and all(n["outputs"] for n in inputs)

    budget = int(prof.peak_bytes * 0.75)  # the replicated plan does not fit: parameters must be sharded
    plan = solve(doc, cluster_for_mesh("cpu-gloo", (2, 2)), memory_budget=budget, time_limit_s=120)
    assert plan["predictions"]["peak_bytes"] <= budget
    assert any(p != "R" for entry in plan["params"].values() for p in entry["placements"])

    module = apply(CLIP, plan, init_device_mesh("cpu", (2, 2)), captured=cap)
    _, example = CLIP()
    loss = module(**example)
    loss.backward()
    assert loss.dim() == 0
    with pytest.raises(TypeError, match="return_loss.*captured with True"):
        module(**{**example, "return_loss": False})
    with pytest.raises(TypeError, match="'return_loss' is missing"):
        module(input_ids=example["input_ids"], pixel_values=example["pixel_values"])
