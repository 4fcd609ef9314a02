"""Solver plans train like one process: every zoo model on 1, 2, 3 and 4 gloo ranks, 1-D and 2-D meshes.

For each (model, mesh) the profiler writes the graph and the solver plans it under a budget tight
enough to force sharding (the smallest of a few fractions of the unsharded peak that is feasible;
a roomy budget would pick plain data parallelism everywhere). The ranks (cauto-runtime's test
worker, one spawn per world size) apply the plan and train 3 AdamW steps beside a single-process
copy of the model with the same initial weights: the loss of every step and the gradients of
step 1 must match within fp32 tolerance.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cauto.profiler import profile, zoo  # noqa: E402
from cauto.solver import InfeasibleBudgetError  # noqa: E402
from cauto.solver.cluster import cluster_for_mesh  # noqa: E402
from cauto.solver.planning import plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "packages" / "cauto-runtime" / "tests" / "workers.py"
TOL = 2e-5
TIMEOUT_S = 420
#: processes planning the jobs of one world size at once
PLANNERS = 2

K = dict(batch=12, seq=16, vocab=64, dim=32, layers=1, heads=4)
KW = {"mlp": dict(batch=12, dim=16, hidden=32), "cnn": dict(batch=12, width=8, blocks=2, image=8), "gpt": K,
      "llama": dict(K, kv_heads=2, hidden=64), "hf_gpt2": K, "hf_llama": dict(K, kv_heads=2, hidden=64)}
#: world size -> its meshes, one test each; mesh (4,) takes about 4 min here and runs in `nox -s slow` (mesh (2,)
#: is the 1-D sharded case CI keeps, (2, 2) the 4-rank one)
MESHES = {1: [(1,)], 2: [(2,)], 3: [(3,)], 4: [(4,), (2, 2)]}
CASES = [pytest.param(world, shape, id="x".join(map(str, shape)),
                      marks=[pytest.mark.slow] if shape == (4,) else [])
         for world in sorted(MESHES) for shape in MESHES[world]]
#: budgets tried, as fractions of the unsharded per-device peak: the first feasible one is used
FRACTIONS = (0.45, 0.6, 0.75, 0.9, None)

_GRAPHS: dict[str, dict] = {}


def _graph(model: str) -> dict:
    if model not in _GRAPHS:
        kwargs = KW[model]
        _GRAPHS[model] = profile(lambda: zoo.ZOO[model](**kwargs)).to_graph()
    return _GRAPHS[model]


def _tight_plan(model: str, shape: tuple[int, ...]) -> tuple[dict, float | None]:
    graph = _graph(model)
    names = ("dp", "tp")[: len(shape)]
    cluster = cluster_for_mesh("cpu-gloo", shape, names)
    for fraction in FRACTIONS:
        budget = None if fraction is None else int(graph["memory"]["peak_bytes"] * fraction)
        try:
            return plan(graph, cluster, memory_budget=budget), fraction
        except InfeasibleBudgetError:
            continue
    raise AssertionError("unreachable: no budget is always feasible")


def _run(world: int, jobs: list[dict], tmp: Path) -> list[dict]:
    from cauto.runtime.dist_utils import free_port

    jobs_path, out = tmp / "jobs.json", tmp / "out.json"
    jobs_path.write_text(json.dumps(jobs))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), port, str(jobs_path), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{world} ranks did not finish in {TIMEOUT_S} s")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{logs[r][-3000:]}"
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def _tight_plans(cases: list[tuple[str, tuple[int, ...]]], monkeypatch) -> list[tuple[dict, float | None]]:
    """``_tight_plan`` of each case, two at a time: planning is one thread, and this machine has two
    cores (each worker process profiles its own graphs). The workers unpickle ``_tight_plan`` by this
    module's name (integration_tests.test_parity_matrix, pytest's importlib mode): the repository root
    must be importable there, and spawn hands the parent's sys.path to its children."""
    monkeypatch.syspath_prepend(str(ROOT))
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that has run torch
    with concurrent.futures.ProcessPoolExecutor(max_workers=PLANNERS, mp_context=ctx) as pool:
        return list(pool.map(_tight_plan, *zip(*cases)))


@pytest.mark.parametrize(("world", "shape"), CASES)
def test_solved_plans_match_one_process(world, shape, tmp_path, monkeypatch):
    jobs, sharded = [], 0
    cases = [(model, shape) for model in KW]
    for (model, shape), (doc, fraction) in zip(cases, _tight_plans(cases, monkeypatch)):
        placements = {tuple(e["placements"]) for e in doc["params"].values()}
        sharded += any(p != "R" for pl in placements for p in pl)
        name = f"{model}_{'x'.join(map(str, shape))}"
        jobs.append(dict(name=name, model=model, kwargs=KW[model], mesh=list(shape),
                         axis_names=["dp", "tp"][: len(shape)], check=None, plan=doc, fraction=fraction))
    if world in (2, 4):  # with 3 ranks the tiny models' dims (16, 32, 64) do not split: data parallel
        assert sharded >= len(jobs) // 2, "the budgets should make most plans shard parameters"
    for rank_result in _run(world, jobs, tmp_path):
        for j in jobs:
            r = rank_result.get(j["name"], {"error": "not run: an earlier job failed on this rank"})
            assert "error" not in r, (j["name"], r.get("error"))
            assert max(r["loss_diffs"]) < TOL * max(1.0, abs(r["loss"])), (j["name"], r)
            assert r["grad_diff"] < TOL, (j["name"], r)
