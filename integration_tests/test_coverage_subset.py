"""The fast subset of tools/bench/bench_coverage.py: a few of its cheapest stock architectures go
through the same steps (profile, eager peak, plans on mesh 4 and 2x2 under 60% of the unsharded peak,
and 4-rank gloo parity for one), so a change that breaks coverage shows in CI, not in the next sweep."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import bench_coverage  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_capability import AVX2_ONLY, AVX2_REASON  # noqa: E402

# name -> a bound on the eager-peak error (%) a little above the sweep's (vit +1.576%, albert +1.373%,
# resnet exact): the gap is the traced program's masks and attention path against eager's (issue 18,
# whose target is 0.1%); the bound catches it growing. The three cheapest of the sweep to profile and plan.
SUBSET = {"vit": 1.7, "albert": 1.5, "resnet": 0.0}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.skipif(AVX2_ONLY, reason=AVX2_REASON)) if n == "resnet"
    # ALBERT's plans take 2 min here, and the parity test below plans it too: its eager peak in `nox -s slow`
    else pytest.param(n, marks=pytest.mark.slow) if n == "albert" else n for n in SUBSET])
def test_profiles_and_plans_on_4_and_2x2(name):
    r = bench_coverage.profile_and_plan(name, time_limit_s=20.0)
    assert r["profile"] == "ok", r.get("trace")
    assert abs(r["error_pct"]) <= SUBSET[name], r
    assert r["plan"] == {"4": "ok", "2x2": "ok"}, r["plan"]  # plans that shard parameters


def test_albert_trains_on_4_gloo_ranks_like_one_process():
    """ALBERT's MLM head is named ``predictions``, as a property of the parallel module is (before: every
    rank failed, "'predictions' is not an nn.Module"); mesh 4 and 2x2 in the same 4 processes."""
    r = bench_coverage.profile_and_plan("albert", eager=False, time_limit_s=20.0)
    rows = bench_coverage.parity("albert", r["plans"], timeout=300.0)
    for key in ("4", "2x2"):
        assert "error" not in rows[key], rows[key].get("trace")
        assert rows[key]["rel"] <= 1e-5, rows[key]


def test_resnet_mesh4_plan_is_exact_in_fp64_and_never_splits_batch_norm_statistics():
    """ResNet's mesh-4 plan drifts 2.4e-2 from one process by step 3 in fp32. Not a different model: its
    batch norms see the whole batch (their inputs are never split on the batch dim), and in fp64 the same
    kind of plan matches one process to 1e-15. In fp32 one conv weight's gradient element is -1.2e-6 (fp64),
    -7.8e-7 in one process and +1.6e-7 on 4 ranks, all within fp32's 4e-6 noise on that tensor: AdamW's
    first step moves it by lr times its sign, and the losses part."""
    from cauto.profiler import profile, zoo
    from cauto.solver import cluster_for_mesh
    from cauto.solver.planning import plan

    kwargs = dict(batch=4, image=32, dims=[8, 16, 32, 64], depths=[1, 1, 1, 1], dtype="float64")
    graph = profile(lambda: zoo.hf_resnet(**kwargs)).to_graph()
    doc = plan(graph, cluster_for_mesh("cpu-gloo", (4,), ("dp",)),
               memory_budget=int(graph["memory"]["peak_bytes"] * 0.6), time_limit_s=20.0)
    assert any(p != ["R"] for e in doc["params"].values() for p in [e["placements"]])  # a sharded plan
    norms = [v for k, v in doc["nodes"].items() if k.startswith("batch_norm")]
    assert norms and all(v["inputs"][0][0] != "S(0)" for v in norms)
    row = bench_coverage.parity("hf_resnet", {"4": doc}, timeout=300.0, kwargs=kwargs)["4"]
    assert "error" not in row, row.get("trace")
    assert row["rel"] <= 1e-12, row


@pytest.mark.slow  # 90 s on 2 shared cores; the 2-rank runtime test covers the library op in seconds
def test_mixtral_trains_on_4_and_2x2_like_one_process():
    """Mixtral's experts run the library op ``transformers::grouped_mm_fallback`` (before: refused as a
    custom Function) and branch on the device (before: the meta capture's int32 histc, which CPU cannot
    run). Its 2x2 plan's local program cannot be traced (DTensor reads a value redistributing a strided
    shard in backward): apply runs that plan on DTensors instead, with a warning."""
    r = bench_coverage.profile_and_plan("mixtral", eager=False, time_limit_s=20.0)
    assert r["plan"] == {"4": "ok", "2x2": "ok"}, r["plan"]
    rows = bench_coverage.parity("mixtral", r["plans"], timeout=300.0)
    for key in ("4", "2x2"):
        assert "error" not in rows[key], rows[key].get("trace")
        assert rows[key]["rel"] <= 1e-5, rows[key]
