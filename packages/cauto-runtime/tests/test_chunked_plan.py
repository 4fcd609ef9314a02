"""Plans with chunked state: refusals in one process, training parity on gloo ranks, and the
launcher under torchrun. Pure data parallelism runs the model as written (chunks/data_parallel.py); tensor
parallelism beside chunked data-parallel state runs the DTensor program with the parameter shards in
chunks (chunks/in_program.py). Plans here are hand-made (handplan ``offload=``);
integration_tests/test_offload_end_to_end.py takes them from the solver.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
from conftest import fake_world, plan_for, run_ranks, zoo_capture

MLP = dict(batch=12, dim=16, hidden=32)
GPT = dict(batch=4, seq=16, vocab=64, dim=32, layers=2, heads=4)
#: largest parameter: 32 x 32 = 1024 elements; a 40 KiB device holds a few chunks of it besides activations
OFFLOAD = {"device_budget_bytes": 40 << 10, "chunk_elems": 1024}
TOL = 2e-5


def _apply(model: str, kwargs: dict, plan: dict):
    from cauto.profiler import zoo
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh
    return apply(lambda: zoo.ZOO[model](**kwargs), plan, make_mesh((2,), ["dp"]), captured=zoo_capture(model, kwargs))


def test_refuses_what_the_chunk_manager_does_not_run():
    from cauto.runtime.apply import PlanMismatchError, check_fits
    from cauto.runtime.dist_utils import make_mesh
    fake_world(2)
    good = plan_for("mlp", MLP, (2,), ["dp"], inputs="S(0)", offload=OFFLOAD)
    mixed = copy.deepcopy(good)
    mixed["params"]["p_m_layers_0_weight"]["state"] = "device"
    with pytest.raises(PlanMismatchError, match="every trainable parameter is chunked"):
        _apply("mlp", MLP, mixed)
    host = copy.deepcopy(good)
    host["params"]["p_m_layers_0_weight"]["state"] = "host"
    with pytest.raises(PlanMismatchError, match="on the host"):
        _apply("mlp", MLP, host)
    tp = copy.deepcopy(good)
    tp["params"]["p_m_layers_0_weight"]["placements"] = ["S(0)"]
    with pytest.raises(PlanMismatchError, match="not Replicate"):
        _apply("mlp", MLP, tp)
    missing = copy.deepcopy(good)
    del missing["offload"]
    with pytest.raises(PlanMismatchError, match="offload section"):
        _apply("mlp", MLP, missing)
    # a plan that redistributes activations is not the model as written: the DTensor program runs it
    edges = plan_for("mlp", MLP, (2,), ["dp"], inputs="S(0)", offload=OFFLOAD,
                     force={"linear_1": ["R", "R", "R"]})
    assert edges["edges"]
    program = _apply("mlp", MLP, edges)
    assert program.manager is not None and "fetch_chunked(" in program.generated_code
    with pytest.raises(PlanMismatchError, match="no DTensor program"):  # what codegen checks
        from cauto.plan import load_plan
        check_fits(zoo_capture("mlp", MLP), load_plan(good), make_mesh((2,), ["dp"]))


def _megatron(layers: int) -> dict[str, str]:
    """Megatron-style tensor parallelism on mesh axis 1 (column-parallel q/k/v/fc, row-parallel proj/out)."""
    out = {}
    for i in range(layers):
        for n in ("attn.q", "attn.k", "attn.v", "fc"):
            out[f"blocks.{i}.{n}.weight"] = out[f"blocks.{i}.{n}.bias"] = "R,S(0)"
        out[f"blocks.{i}.attn.proj.weight"] = out[f"blocks.{i}.out.weight"] = "R,S(1)"
    return out


def _apply_2d(plan: dict):
    from cauto.profiler import zoo
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh
    return apply(lambda: zoo.ZOO["gpt"](**GPT), plan, make_mesh((2, 2), ["dp", "tp"]), captured=zoo_capture("gpt", GPT))


def _assert_pinned_around_every_use(graph):
    """Every fetch is released once, after every op that reads the fetched DTensor or a view of it, and
    the release of one fetch is the first release of that parameter after it (pins never overlap)."""
    from cauto.runtime.chunks.fetch import aliases_of, fetch_chunked, release_chunked
    order = {n: i for i, n in enumerate(graph.nodes)}
    fetches = [n for n in graph.nodes if n.target is fetch_chunked]
    releases = [n for n in graph.nodes if n.target is release_chunked]
    assert len(fetches) == len(releases) > 0
    for f in fetches:
        readers = [u for a in aliases_of(f) for u in a.users if u.target is not release_chunked]
        mine = [r for r in releases if r.args[0] is f.args[0] and order[r] > order[f]]
        release = min(mine, key=order.__getitem__)
        assert readers and all(order[u] < order[release] for u in readers), f.name
        later = [g for g in fetches if g.args[0] is f.args[0] and order[g] > order[f]]
        assert not later or order[release] < min(order[g] for g in later), f.name


def test_tensor_parallel_chunked_plan_runs_the_dtensor_program_or_says_why_not():
    from cauto.runtime.apply import ParallelModule, PlanMismatchError
    fake_world(4)
    good = plan_for("gpt", GPT, (2, 2), ["dp", "tp"], inputs="S(0),R", params=_megatron(2),
                    offload={**OFFLOAD, "chunk_elems": 4096, "mesh_axes": [0]})
    m = _apply_2d(good)
    assert isinstance(m, ParallelModule) and m.manager.world_size == 2  # ZeRO over the dp axis only
    shards = {s.name: tuple(s.shape) for s in m.manager.layout.slots}
    assert shards["blocks.0.fc.weight"] == (64, 32) and shards["blocks.0.attn.proj.weight"] == (32, 16)  # TP shards
    code = m.generated_code
    assert code.count("fetch_chunked(") == code.count("release_chunked(") > 0 and "ZeRO over mesh axes [0]" in code
    _assert_pinned_around_every_use(m.executable.module.graph)
    # stored split on tp, used whole: each fetch is redistributed (an alias, maybe) before its op reads it
    gathered = plan_for("gpt", GPT, (2, 2), ["dp", "tp"], inputs="S(0),R", storage="R,S(0)",
                        offload={**OFFLOAD, "chunk_elems": 4096, "mesh_axes": [0]})
    program = _apply_2d(gathered).executable.module.graph
    assert any(n.target.__name__ == "redistribute_fetched" for n in program.nodes if n.op == "call_function")
    _assert_pinned_around_every_use(program)
    assert not [p for p in m.parameters() if p.requires_grad and type(p).__name__ == "DTensor"]
    on_dp = copy.deepcopy(good)
    on_dp["params"]["p_m_blocks_0_fc_weight"]["placements"] = ["S(0)", "S(0)"]
    with pytest.raises(PlanMismatchError, match="not Replicate on the data-parallel mesh axes"):
        _apply_2d(on_dp)
    mixed = copy.deepcopy(good)
    mixed["params"]["p_m_blocks_0_fc_weight"]["state"] = "device"
    with pytest.raises(PlanMismatchError, match="every trainable parameter is chunked"):
        _apply_2d(mixed)
    regions = copy.deepcopy(good)
    regions["checkpoint"] = {"method": "rotor", "regions": [{"nodes": ["layer_norm"]}]}
    region = _apply_2d(regions).executable.module.checkpoint_0  # its recomputation fetches its parameters again
    fetched = [n for n in region.graph.nodes if n.op == "call_function" and n.target.__name__ == "fetch_chunked"]
    released = [n for n in region.graph.nodes if n.op == "call_function" and n.target.__name__ == "release_chunked"]
    assert len(fetched) == len(released) == 2  # the layer norm's weight and bias
    # a region that would read a chunk through a value fetched outside it is refused by name
    from cauto.runtime.checkpoint import wrap_regions
    program = _apply_2d(good).executable.module
    ln = next(n for n in program.graph.nodes if n.name == "layer_norm")
    outside = next(n for n in ln.all_input_nodes if n.target.__name__ == "fetch_chunked")
    ln.meta.pop("cauto_owner", None)
    outside.meta["cauto_fetched_for"] = "elsewhere"
    with pytest.raises(ValueError, match="reads the chunked parameter .* fetched outside the region"):
        wrap_regions(program, [{"nodes": ["layer_norm"]}])


@pytest.mark.slow
def test_tensor_parallel_beside_chunked_data_parallel_state_trains_like_one_process(tmp_path):
    """4 gloo ranks, mesh dp x tp = 2 x 2: Megatron-style tensor parallelism on tp, every parameter's
    tp shard chunked and ZeRO-sharded over dp, a device too small for the model state (it pages).
    The GPT's embedding and head are tied (one chunked shard, fetched twice). Per-step losses and
    final parameter shards equal an un-chunked single-process AdamW run."""
    jobs = [dict(name="gpt", model="gpt", kwargs=GPT, mesh=[2, 2], axis_names=["dp", "tp"], check="chunked",
                 steps=4, program=True,
                 plan=plan_for("gpt", GPT, (2, 2), ["dp", "tp"], inputs="S(0),R", params=_megatron(2),
                               offload={"device_budget_bytes": 256 << 10, "chunk_elems": 4096, "mesh_axes": [0]}))]
    for rank in run_ranks(4, jobs, tmp_path, timeout_s=240):
        r = rank["gpt"]
        assert "error" not in r, r.get("error")
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), r
        assert r["losses"][-1] < r["losses"][0] and r["world_size"] == 2
        assert r["param_diff_without_k_bias"] < TOL, r  # key biases: see the test below
        assert r["arena_bytes"] < r["num_chunks"] * r["chunk_elems"] * 16 and r["traffic"]["h2d_bytes"] > 0, r


def test_chunked_plan_trains_like_one_process(tmp_path):
    """2 gloo ranks, every parameter chunked and ZeRO-sharded, a device too small for the model state:
    per-step losses and final parameters equal an un-chunked single-process AdamW run."""
    jobs = [dict(name="mlp", model="mlp", kwargs=MLP, mesh=[2], axis_names=["dp"], check="chunked", steps=5,
                 plan=plan_for("mlp", MLP, (2,), ["dp"], inputs="S(0)", offload=OFFLOAD)),
            dict(name="gpt", model="gpt", kwargs=GPT, mesh=[2], axis_names=["dp"], check="chunked", steps=4,
                 plan=plan_for("gpt", GPT, (2,), ["dp"], inputs="S(0)",
                               offload={"device_budget_bytes": 256 << 10, "chunk_elems": 4096}))]
    for rank in run_ranks(2, jobs, tmp_path, timeout_s=240):
        for name in ("mlp", "gpt"):
            r = rank[name]
            assert "error" not in r, r.get("error")
            for got, want in zip(r["losses"], r["ref_losses"]):
                assert abs(got - want) <= TOL * max(1.0, abs(want)), r
            assert r["losses"][-1] < r["losses"][0]
            assert r["world_size"] == 2 and r["local_batch"][0] == jobs[0 if name == "mlp" else 1]["kwargs"]["batch"] // 2
            # state really paged: the arena holds less than every chunk of params + grads + Adam state
            state_bytes = r["num_chunks"] * r["chunk_elems"] * 16
            assert r["arena_bytes"] < state_bytes and r["traffic"]["h2d_bytes"] > 0, r
        assert rank["mlp"]["param_diff"] < TOL, rank["mlp"]
        # gpt: gradients that are 0 up to rounding (attention key biases: softmax ignores a shift) differ in
        # rounding between the ranks' averaged halves and one batch; Adam turns that into steps of up to
        # lr (1e-2): leave the key biases out, and allow 1% of the largest total update for the rest
        assert rank["gpt"]["param_diff_without_k_bias"] < 0.01 * 1e-2 * 4, rank["gpt"]


@pytest.mark.slow
def test_torchrun_launch_with_a_chunked_plan(tmp_path):
    """The launcher trains a chunked plan through model.optimizer and reports the chunk manager's figures."""
    from cauto.plan import dump
    from cauto.runtime.dist_utils import free_port
    plan = plan_for("mlp", {}, (2,), ["dp"], inputs="S(0)", offload={"device_budget_bytes": 2 << 20,
                                                                        "chunk_elems": 65536})
    path = dump(plan, tmp_path / "chunked.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "cauto.runtime.launch", "cauto.profiler.zoo:mlp", "--plan", str(path), "--steps", "3", "--verify",
           "--timeout-s", "60"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "step 3/3 loss" in res.stdout and "cauto verify (chunked state)" in res.stdout
    assert "moved_bytes" in res.stdout


def test_zero_groups_are_the_ranks_that_differ_only_on_the_zero_axes():
    """chunks/in_program.py: the ZeRO process group of a subset of a mesh's axes (here 2 of 3 axes of 8 ranks)."""
    import torch

    from cauto.runtime.chunks.in_program import zero_group_ranks

    mesh = torch.arange(8).reshape(2, 2, 2)
    assert zero_group_ranks(mesh, [0, 2]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert zero_group_ranks(mesh, [1]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert zero_group_ranks(mesh, [0, 1, 2]) == [list(range(8))]
