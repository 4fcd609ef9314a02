"""plan(offload=...): chunked data-parallel state where no device-only plan fits (offload/)."""

import json
import math
from pathlib import Path

import pytest

from cauto.plan import GraphDocument, check_document, check_plan_matches_graph, load_plan
from cauto.plan.chunking import count_chunks, default_chunk_elems
from cauto.solver import InfeasibleBudgetError, SolverError, plan, solve, synthetic
from cauto.solver.cli import main
from cauto.solver.cluster import PRESETS, DeviceSpec, cluster_for_mesh
from cauto.solver.memory.timeline import device_timeline, plan_strategies
from cauto.solver.offload.memory import ChunkedMemoryModel
from cauto.solver.offload.model import GRAD_ITEMSIZE, PARAM_ITEMSIZE, OffloadModel, local_numel
from cauto.solver.strategies.groups import enumerate_strategies

GRAPH = json.loads((Path(__file__).parent / "data" / "profiled_gpt_graph.json").read_text())


@pytest.fixture(scope="module")
def cluster():
    return cluster_for_mesh("cpu-gloo", (2,))


@pytest.fixture(scope="module")
def least_on_device(cluster) -> int:
    with pytest.raises(InfeasibleBudgetError) as info:
        plan(GRAPH, cluster, memory_budget=1)
    return info.value.needed_bytes


def _without_time(p: dict) -> dict:
    """The plan without what differs between equal plans asked for differently: the solve time, and the
    options it records (offload "auto" and "none" give the same plan where it fits on the device)."""
    return {**{k: v for k, v in p.items() if k != "options"},
            "solver": {k: v for k, v in p["solver"].items() if k != "time_s"}}


def test_auto_leaves_feasible_plans_untouched(cluster, least_on_device):
    budget = int(least_on_device * 1.5)
    auto = plan(GRAPH, cluster, memory_budget=budget, offload="auto")
    assert _without_time(auto) == _without_time(plan(GRAPH, cluster, memory_budget=budget))
    assert "offload" not in auto and {p["state"] for p in auto["params"].values()} == {"device"}


def test_auto_turns_an_infeasible_budget_into_a_chunked_plan_that_fits(cluster, least_on_device):
    budget = int(least_on_device * 0.8)
    with pytest.raises(InfeasibleBudgetError):
        plan(GRAPH, cluster, memory_budget=budget)
    p = plan(GRAPH, cluster, memory_budget=budget, offload="auto")
    check_document(p, "plan")
    check_plan_matches_graph(p, GRAPH)
    pred, off = p["predictions"], p["offload"]
    assert pred["peak_bytes"] <= budget
    assert off["device_budget_bytes"] == budget
    assert off["mesh_axes"] == [0]  # a 1-D mesh: the data-parallel axes are the whole mesh
    # pure data parallelism, which the runtime runs with chunks: every param chunked and replicated, no edges
    assert all(e["state"] == "chunked" and set(e["placements"]) == {"R"} for e in p["params"].values())
    assert p["edges"] == []
    inputs = [n["id"] for n in GRAPH["nodes"] if n["kind"] == "input"]
    assert all(p["nodes"][i]["outputs"][0] == ["S(0)"] for i in inputs)
    # device memory: the working set instead of params + grads + Adam state; the arena covers the working set
    assert pred["model_state_bytes"] < least_on_device / 4
    assert off["arena_bytes"] >= off["working_set_bytes"] > 0
    assert off["arena_bytes"] == budget - (pred["peak_bytes"] - off["working_set_bytes"])
    # host link traffic priced and in the total; ZeRO collectives replace the gradient all-reduce
    st = pred["step_time_s"]
    assert off["moved_bytes"] > 0
    assert st["offload"] == pytest.approx(off["moved_bytes"] / off["host_link_bandwidth_bytes_per_s"])
    assert st["total"] == pytest.approx(st["compute"] + st["communication"] + st["offload"])
    ops = {(c["op"], c["phase"]) for c in pred["collectives"]}
    assert ("all_gather", "forward") in ops and ("reduce_scatter", "backward") in ops
    assert not p.get("grad_sync")
    groups = off["num_chunks"] // 2
    assert sum(c["where"].startswith("chunk group") for c in pred["collectives"]) == 2 * groups


def test_forced_chunks_and_their_limits(cluster, least_on_device):
    roomy = plan(GRAPH, cluster, memory_budget=least_on_device * 2, offload="chunked")
    assert {e["state"] for e in roomy["params"].values()} == {"chunked"}
    with pytest.raises(InfeasibleBudgetError) as info:
        plan(GRAPH, cluster, memory_budget=least_on_device // 4, offload="auto")
    assert least_on_device // 4 < info.value.needed_bytes < least_on_device  # the chunked plan's need
    assert "chunk working set" in str(info.value)
    with pytest.raises(SolverError, match="offload"):
        plan(GRAPH, cluster, offload="sometimes")


def chunk_elems_for(numels, group_size, budget_bytes):
    return default_chunk_elems([numels], group_size, budget_bytes, PARAM_ITEMSIZE + GRAD_ITEMSIZE)


def test_chunk_size_is_the_runtime_rule():
    # never below the largest parameter (aligned to 16 elements), whatever the budget
    assert chunk_elems_for([1000, 1000, 1000], 1, 1) == 1008
    assert count_chunks([[1000, 1000, 1000]], 1008, 2) == 4  # padded to a multiple of the group
    # the budget bounds a chunk's param + grad bytes to budget/8 (the runtime's default); within that,
    # the least padding: 1000 parameters of 100 elements (112 aligned) waste nothing in chunks of 112 * k
    for budget in (64 * 2048, 64 * 10_000):
        size = chunk_elems_for([100] * 1000, 1, budget)
        assert 112 <= size <= budget // 64 and size % 112 == 0


def test_traffic_model():
    c = cluster_for_mesh("cpu-gloo", (2,))
    m = OffloadModel(c, 1 << 20, 1024)
    p = 4 * 4 * 1024  # four chunks of fp32 params
    # everything fits: the other rank's gathered chunks arrive, the own chunk leaves for the gather and
    # its reduced gradient shard arrives for the device-side Adam (gradient chunks are fp32 too: G = P)
    assert m.traffic_bytes(4, 10 << 20) == p // 2 + (p + p) // 2
    assert OffloadModel(cluster_for_mesh("cpu-gloo", (1,)), 1 << 20, 1024).traffic_bytes(4, 10 << 20) == 0
    tight = m.traffic_bytes(4, m.working_set_bytes)  # no spare room: every chunk comes back for backward
    assert tight == p + p // 2 + p
    assert m.traffic_bytes(4, m.working_set_bytes + p) == p + p // 2


def test_host_link_in_presets_and_spec_files():
    assert PRESETS["h100"].device.host_link_bandwidth_bytes_per_s == 50e9
    dev = DeviceSpec("x", 1 << 30, 1e12, 1e9)
    assert dev.host_link_bandwidth_bytes_per_s == 1e9  # never faster than the device's own memory
    assert cluster_for_mesh("a100", (2,)).to_dict()["device"]["host_link_bandwidth_bytes_per_s"] == 25e9


def test_cli_offload_flag(tmp_path, capsys, least_on_device):
    graph_path = tmp_path / "g.json"
    graph_path.write_text(json.dumps(GRAPH))
    out = tmp_path / "p.json"
    budget = str(int(least_on_device * 0.8))
    assert main([str(graph_path), "--mesh", "2", "--memory", budget, "-o", str(out)]) == 2
    assert "no plan fits" in capsys.readouterr().err and not out.exists()
    assert main([str(graph_path), "--mesh", "2", "--memory", budget, "--offload", "auto", "-o", str(out)]) == 0
    assert "chunked state" in capsys.readouterr().out
    doc = load_plan(out)
    assert doc.schema_version == "1.4" and doc.offload["device_budget_bytes"] == int(budget)
    assert {e["state"] for e in doc.params.values()} == {"chunked"}
    with pytest.raises(SystemExit) as info:
        main([str(graph_path), "--mesh", "2", "--offload", "always", "-o", str(tmp_path / "q.json")])
    assert info.value.code == 2
    assert main([str(graph_path), "--mesh", "2", "--memory", "1MiB", "--offload", "auto", "-o", str(out)]) == 2
    assert "the least-memory plan the search finds needs" in capsys.readouterr().err


# ---------------------------------------------------------------- chunks over some mesh axes (tensor parallelism)
def _local_numel(shape: list[int], placements: list[str], mesh: list[int]) -> int:
    dims = list(shape)
    for axis, p in enumerate(placements):
        if p.startswith("S("):
            d = int(p[2:-1])
            dims[d] = math.ceil(dims[d] / mesh[axis])
    return math.prod(dims)


@pytest.fixture(scope="module")
def mesh22():
    return cluster_for_mesh("cpu-gloo", (2, 2))


@pytest.fixture(scope="module")
def half_on_device(mesh22) -> int:
    """Half the peak of the device-only plan on 2x2: tensor-parallel chunks fit, pure data parallelism does not."""
    return solve(GRAPH, mesh22)["predictions"]["peak_bytes"] // 2


@pytest.fixture(scope="module")
def mixed(mesh22, half_on_device) -> dict:
    return plan(GRAPH, mesh22, memory_budget=half_on_device, offload="chunked", offload_axes=(0,))


def test_chunks_over_one_axis_leave_the_other_to_tensor_parallelism(mesh22, half_on_device, mixed):
    p = mixed
    check_document(p, "plan")
    check_plan_matches_graph(p, GRAPH)
    off, pred = p["offload"], p["predictions"]
    assert off["mesh_axes"] == [0] and pred["peak_bytes"] <= half_on_device
    params = [n for n in GRAPH["nodes"] if n["kind"] == "param"]
    trainable = [n for n in params if not n.get("tied_to") and n.get("requires_grad") is not False]
    # packed as the runtime packs them: the model's registration order, a tied pair at its first name
    first: dict[str, int] = {}
    for i, n in enumerate(params):
        first.setdefault(n.get("tied_to") or n["id"], i)
    trainable.sort(key=lambda n: first[n["id"]])
    # every trainable untied parameter is chunked, Replicate on the data-parallel axis; some are split on axis 1
    assert all(p["params"][n["id"]]["state"] == "chunked" for n in trainable)
    assert all(e["placements"][0] == "R" for e in p["params"].values() if e["state"] == "chunked")
    assert any(e["placements"][1] != "R" for e in p["params"].values())
    inputs = [n["id"] for n in GRAPH["nodes"] if n["kind"] == "input"]
    assert all(p["nodes"][i]["outputs"][0][0] == "S(0)" for i in inputs)
    # chunks of the local shards, padded to the group of 2 devices on axis 0
    local = [_local_numel(n["outputs"][0]["shape"], p["params"][n["id"]]["placements"], [2, 2]) for n in trainable]
    assert off["num_chunks"] == count_chunks([local], off["chunk_elems"], 2)
    # the chunk manager's collectives run on axis 0 only; gradient synchronization on axis 0 is theirs
    zero = [c for c in pred["collectives"] if c["where"].startswith("chunk")]
    assert zero and {c["axis"] for c in zero} == {0}
    assert sum(c["where"].startswith("chunk group") for c in zero) == 2 * off["num_chunks"] // 2
    assert all(c["axis"] != 0 for c in p["grad_sync"])
    # edges are allowed (the DTensor program runs them) and the step time adds up
    st = pred["step_time_s"]
    assert st["total"] == pytest.approx(st["compute"] + st["communication"] + st["offload"])
    assert st["communication"] == pytest.approx(sum(c["cost_s"] for c in pred["collectives"]))


def test_chunks_hold_local_shards(mesh22, mixed):
    graph = GraphDocument.from_dict(GRAPH)
    chosen = plan_strategies(mixed, graph, enumerate_strategies(graph, (2, 2), ("dp", "tp")))
    trainable = [n for n in graph.nodes if n.kind == "param" and not n.tied_to and n.requires_grad is not False]
    chunk_elems = 32768  # the largest parameter: small chunks, so that the shards' count differs from the whole's
    model = OffloadModel(mesh22, 1 << 30, chunk_elems, (0,))
    local = [_local_numel(n.outputs[0].shape, mixed["params"][n.id]["placements"], [2, 2]) for n in trainable]
    full = [math.prod(n.outputs[0].shape) for n in trainable]
    assert model.num_chunks(trainable, chosen) == count_chunks([local], chunk_elems, 2) < count_chunks([full], chunk_elems, 2)
    # a dim split on two axes is divided twice, rounding up
    node = next(n for n in graph.nodes if n.id == "p_m_blocks_0_fc_bias")  # 512 elements
    assert local_numel(node, ("S(0)", "S(0)"), (3, 2)) == math.ceil(math.ceil(512 / 3) / 2)
    assert local_numel(node, ("R", "R"), (3, 2)) == 512


def test_pure_data_parallelism_is_still_the_default_of_solve(mesh22, half_on_device):
    with pytest.raises(InfeasibleBudgetError):  # attention cannot split the batch over both axes: no edge-free plan
        solve(GRAPH, mesh22, memory_budget=half_on_device, offload=True)
    # with memory to spare, the error says that the missing plan is an edge-free one, not memory
    roomy = solve(GRAPH, mesh22)["predictions"]["peak_bytes"] * 4
    with pytest.raises(InfeasibleBudgetError, match="redistributes an activation .*offload-axes") as info:
        solve(GRAPH, mesh22, memory_budget=roomy, offload=True)
    assert info.value.needed_bytes <= roomy


@pytest.mark.parametrize("graph", [GRAPH, synthetic.gpt(layers=2)], ids=["profiled", "synthetic"])
def test_chunked_plan_picks_the_fastest_data_parallel_axes(graph, mesh22):
    budget = solve(graph, mesh22)["predictions"]["peak_bytes"] // 2
    candidates = {}
    for axes in [(0, 1), (0,), (1,)]:
        try:
            candidates[axes] = solve(graph, mesh22, memory_budget=budget, offload=True, offload_axes=axes)
        except InfeasibleBudgetError:
            pass
    assert len(candidates) >= 2
    best = min(candidates.values(), key=lambda c: c["predictions"]["step_time_s"]["total"])
    chosen = plan(graph, mesh22, memory_budget=budget, offload="chunked")
    assert _without_time(chosen) == _without_time(best)
    assert all(chosen["predictions"]["step_time_s"]["total"] <= c["predictions"]["step_time_s"]["total"]
               for c in candidates.values())


def test_no_feasible_data_parallel_axes_raises_the_least_need(mesh22):
    budget = 1 << 20
    needs = []
    for axes in [(0, 1), (0,), (1,)]:
        with pytest.raises(InfeasibleBudgetError) as info:
            solve(GRAPH, mesh22, memory_budget=budget, offload=True, offload_axes=axes)
        needs.append(info.value.needed_bytes)
    with pytest.raises(InfeasibleBudgetError) as info:
        plan(GRAPH, mesh22, memory_budget=budget, offload="chunked")
    assert info.value.needed_bytes == min(needs)


def test_bad_offload_axes(mesh22, tmp_path, capsys):
    for axes, words in [((), "at least one"), ((2,), "not an axis"), ((0, 0), "twice"), ((-1,), "not an axis")]:
        with pytest.raises(SolverError, match=words):
            plan(GRAPH, mesh22, offload="chunked", offload_axes=axes)
    with pytest.raises(SolverError, match="need offload"):
        plan(GRAPH, mesh22, offload_axes=(0,))
    with pytest.raises(SolverError, match="needs offload"):
        solve(GRAPH, mesh22, offload_axes=(0,))
    graph_path = tmp_path / "g.json"
    graph_path.write_text(json.dumps(GRAPH))
    out = tmp_path / "p.json"
    for value in ("5", "model", "0,0", ""):
        assert main([str(graph_path), "--mesh", "2x2", "--offload", "chunked", "--offload-axes", value,
                     "-o", str(out)]) == 2
        assert "offload ax" in capsys.readouterr().err and not out.exists()
    assert main([str(graph_path), "--mesh", "2x2", "--offload-axes", "0", "-o", str(out)]) == 2
    assert "offload" in capsys.readouterr().err and not out.exists()


def test_cli_offload_axes_by_name(mesh22, half_on_device, mixed, tmp_path, capsys):
    graph_path = tmp_path / "g.json"
    graph_path.write_text(json.dumps(GRAPH))
    out = tmp_path / "p.json"
    assert main([str(graph_path), "--mesh", "2x2", "--memory", str(half_on_device), "--offload", "chunked",
                 "--offload-axes", "dp", "-o", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["offload"]["mesh_axes"] == [0]
    assert _without_time(doc)["nodes"] == mixed["nodes"]


def test_timeline_of_a_mixed_plan_is_its_predicted_peak(mixed):
    timeline = device_timeline(mixed, GRAPH)
    pred = mixed["predictions"]
    assert timeline.peak_bytes == pred["peak_bytes"]
    assert timeline.state_bytes == pred["model_state_bytes"] >= mixed["offload"]["working_set_bytes"]
    # the data-parallel axes matter: over the whole mesh the tensor-parallel parameters would not be chunked
    whole = {**mixed, "offload": {k: v for k, v in mixed["offload"].items() if k != "mesh_axes"}}
    assert device_timeline(whole, GRAPH).state_bytes > timeline.state_bytes


def test_execution_section_is_what_the_plan_rules_derive(cluster, least_on_device, half_on_device, mesh22):
    """The solver writes ``execution`` and the simulated budget itself; an older plan gets them from its
    other sections on read (cauto.plan.execution). Both ways agree on every kind of plan."""
    from cauto.plan.execution import add_execution
    plans = [plan(GRAPH, cluster), plan(GRAPH, mesh22),
             plan(GRAPH, cluster, memory_budget=int(least_on_device * 0.8), offload="auto"),
             plan(GRAPH, mesh22, memory_budget=half_on_device, offload="chunked", offload_axes=(0,))]
    modes = []
    for p in plans:
        bare = {k: v for k, v in p.items() if k != "execution"}
        if "offload" in p:
            bare["offload"] = {k: v for k, v in p["offload"].items() if k != "simulated_device_budget_bytes"}
        derived = add_execution(bare)
        assert derived["execution"] == p["execution"]
        assert derived.get("offload") == p.get("offload")
        modes.append(p["execution"]["mode"])
    assert modes == ["program", "program", "chunk_manager", "program"]
    assert any(p["execution"]["grad_reductions"] for p in plans)


def test_zero_collectives_are_one_per_chunk_group_over_several_axes():
    """The runtime ZeRO-shards over one process group of the ranks that differ only on D (issue 22 point
    3): D spanning two axes is one all-gather and one reduce-scatter per chunk group and one flag
    all-reduce, over W = 4 ranks, priced on the slowest of D's links; one axis is as before."""
    from cauto.solver.offload.model import OffloadModel
    from cauto.solver.offload.section import zero_collectives

    for mesh, axes in [((2, 2), (0, 1)), ((2, 1, 2), (0, 2)), ((2, 2, 1), (0, 2))]:
        m = OffloadModel(cluster_for_mesh("cpu-gloo", mesh), 1 << 20, 1024, axes)
        out = zero_collectives(m, 2 * m.group_size, 3)
        assert [(c["op"], c["phase"]) for c in out] == [("all_gather", "forward"), ("reduce_scatter", "backward")] * 2 \
            + [("all_reduce", "optimizer")], (mesh, axes)
        assert {c["axis"] for c in out} == {axes[0]} and out[0]["bytes"] == m.group_size * 1024 * 4


def _least(fn) -> int:
    """The bytes an InfeasibleBudgetError of ``fn()`` names."""
    with pytest.raises(InfeasibleBudgetError) as info:
        fn()
    return int(info.value.needed_bytes)


def test_three_levers_plan_below_every_two_lever_plan(monkeypatch):
    """Issue 22 point 1: sharding, checkpoint regions and chunked state in one plan. Below the least budget
    of both two-lever plans (sharding with checkpointing; sharding with chunked state) the three-way search
    finds a plan with regions over chunked parameters, run as a program; its peak is the device walk's with
    the chunks its regions' recomputation pins; and at a budget where a two-lever plan fits too, the
    three-way choice is never slower than it."""
    cluster = cluster_for_mesh("cpu-gloo", (2,))
    ckpt = _least(lambda: plan(GRAPH, cluster, memory_budget=1, checkpoint="auto"))
    chunks = _least(lambda: plan(GRAPH, cluster, memory_budget=1, offload="chunked"))
    budget = int(0.9 * min(ckpt, chunks))
    p = plan(GRAPH, cluster, memory_budget=budget, offload="chunked", checkpoint="auto")
    check_document(p, "plan")
    assert p["checkpoint"]["regions"] and p["execution"]["mode"] == "program"
    assert {e["state"] for e in p["params"].values()} == {"chunked"}
    pred, off = p["predictions"], p["offload"]
    assert pred["peak_bytes"] <= budget and off["device_budget_bytes"] == budget
    assert device_timeline(p, GRAPH).peak_bytes == pred["peak_bytes"]
    # the offload section is priced at the checkpointed peak: the arena is what the regions leave
    assert off["arena_bytes"] == budget - (pred["peak_bytes"] - off["working_set_bytes"])
    assert pred["step_time_s"]["offload"] == pytest.approx(off["moved_bytes"] / off["host_link_bandwidth_bytes_per_s"])
    # the regions lower the peak, and the chunks their recomputation pins are counted in it
    unregioned = json.loads(json.dumps(p))
    unregioned["checkpoint"]["regions"] = []
    assert device_timeline(unregioned, GRAPH).peak_bytes > pred["peak_bytes"]
    monkeypatch.setattr(ChunkedMemoryModel, "recompute_pinned_bytes", lambda self, by_id, chosen, region: 0)
    assert device_timeline(p, GRAPH).peak_bytes < pred["peak_bytes"]
    monkeypatch.undo()
    # offload "auto" falls back to the three levers where nothing else fits
    assert plan(GRAPH, cluster, memory_budget=budget, offload="auto", checkpoint="auto")["checkpoint"]["regions"]
    # with chunks, regions are used only where they are faster (or needed): never slower than chunks alone
    for roomy in (2 * chunks, 2 * ckpt):
        three = plan(GRAPH, cluster, memory_budget=roomy, offload="chunked", checkpoint="auto")
        two = plan(GRAPH, cluster, memory_budget=roomy, offload="chunked")
        assert three["predictions"]["step_time_s"]["total"] <= two["predictions"]["step_time_s"]["total"]
