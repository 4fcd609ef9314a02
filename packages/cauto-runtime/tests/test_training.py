"""Training-loop features over a plan, against the same model trained in one process: gradient
clipping (``model.clip_grad_norm_``) over every placement, on 4 gloo ranks (one spawn, several plans).
"""

from __future__ import annotations

import pytest
from conftest import plan_for, run_ranks

GPT = dict(batch=12, seq=16, vocab=64, dim=32, layers=1, heads=4)
#: chunked plans: small chunks, a device budget that pages
OFFLOAD = {"device_budget_bytes": 256 << 10, "chunk_elems": 4096}
#: ``clip_grad_norm_``'s norm vs torch's on the single-process model, relative (issue 21)
NORM_RTOL = 1e-6


def megatron(axes: int) -> dict[str, str]:
    """Megatron-style tensor parallelism on the last mesh axis (column q/k/v/fc, row proj/out)."""
    lead = ["R"] * (axes - 1)
    col, row = ",".join(lead + ["S(0)"]), ",".join(lead + ["S(1)"])
    out = {}
    for n in ("attn.q", "attn.k", "attn.v", "fc"):
        out[f"blocks.0.{n}.weight"] = out[f"blocks.0.{n}.bias"] = col
    out["blocks.0.attn.proj.weight"] = out["blocks.0.out.weight"] = row
    return out


def _job(name, shape, axes, check, **placement):
    return dict(name=name, model="gpt", kwargs=GPT, mesh=list(shape), axis_names=axes, check=check,
                plan=plan_for("gpt", GPT, tuple(shape), axes, **placement))


@pytest.mark.slow
def test_clip_grad_norm_equals_one_process_over_every_placement(tmp_path):
    """The global norm (2 and inf) equals torch's single-process one to 1e-6 relative for data parallel
    (plain replicated parameters), tensor parallel (Shard on tp, replicated
    layer norms counted once) and 2x2 dp x tp; clipping then trains like the clipped single-process model.
    And gradients left Partial (the DTensor program without its gradient sync) are reduced for the norm."""
    jobs = [
        _job("dp", [4], ["dp"], "clip", inputs="S(0)"),
        _job("tp", [4], ["tp"], "clip", inputs="R", params=megatron(1)),
        _job("dp_tp", [2, 2], ["dp", "tp"], "clip", inputs="S(0),R", params=megatron(2)),
        dict(_job("partial", [2, 2], ["dp", "tp"], "clip", inputs="S(0),R", params=megatron(2)),
             apply={"lowering": "dtensor"}, unsynced=True),
    ]
    for rank in run_ranks(4, jobs, tmp_path, timeout_s=240):
        for name in ("dp", "tp", "dp_tp"):
            r = rank[name]
            assert "error" not in r, (name, r.get("error"))
            for got, want in zip(r["norms"] + [r["inf_norm"]], r["ref_norms"] + [r["ref_inf_norm"]]):
                assert got == pytest.approx(want, rel=NORM_RTOL), (name, r)
            assert r["norms"][0] > 0.05 * 2  # the clip bites: gradients are scaled by < 1/2
            assert r["grad_diff"] < 2e-6, (name, r)  # clipped gradients, as torch clips them
            assert max(r["loss_diffs"]) < 2e-5, (name, r)
        r = rank["partial"]  # gradients still Partial on dp (no gradient sync): reduced for the norm
        assert "error" not in r, r.get("error")
        assert r["partial_grads"] > 0 and r["norms"][0] == pytest.approx(r["ref_norms"][0], rel=NORM_RTOL), r


@pytest.mark.slow
def test_clip_grad_norm_over_chunked_state_equals_one_process(tmp_path):
    """Chunked state: ZeRO over 4 ranks (each chunk's gradient counted by its owner), and tp shards
    ZeRO-sharded over dp on 2x2 (owner on dp, every shard on tp): norms and clipped training as torch."""
    jobs = [dict(_job("chunked", [4], ["dp"], "chunked", inputs="S(0)", offload=OFFLOAD), steps=2, max_norm=0.05),
            dict(_job("chunked_tp", [2, 2], ["dp", "tp"], "chunked", inputs="S(0),R", params=megatron(2),
                      offload={**OFFLOAD, "mesh_axes": [0]}), steps=2, max_norm=0.05, program=True)]
    for rank in run_ranks(4, jobs, tmp_path, timeout_s=240):
        for name in ("chunked", "chunked_tp"):
            r = rank[name]
            assert "error" not in r, (name, r.get("error"))
            assert len(r["norms"]) == 2, r
            for got, want in zip(r["norms"], r["ref_norms"]):
                assert got == pytest.approx(want, rel=NORM_RTOL), (name, r)
            for got, want in zip(r["losses"], r["ref_losses"]):
                assert got == pytest.approx(want, rel=2e-5), (name, r)


@pytest.mark.slow
def test_each_rank_loads_its_slice_through_a_distributed_sampler(tmp_path):
    """Local-batch training from a real DataLoader + DistributedSampler over the plan's data-parallel axes
    (``model.batch_slice()``): on 2x2 dp x tp the two tp ranks of a dp coordinate load the same samples;
    on 2x2 dp x dp every rank loads a quarter. Each rank's samples are its own (disjoint, together the
    dataset), and losses and gradients equal the single-process run on the concatenated global batch."""
    jobs = [_job("dp_tp", [2, 2], ["dp", "tp"], "dataloader", inputs="S(0),R", params=megatron(2)),
            _job("dp_dp", [2, 2], ["dp", "dp2"], "dataloader", inputs="S(0),S(0)")]
    ranks = run_ranks(4, jobs, tmp_path, timeout_s=240)
    for name, count, local in (("dp_tp", 2, GPT["batch"] // 2), ("dp_dp", 4, GPT["batch"] // 4)):
        results = [rank[name] for rank in ranks]
        for r in results:
            assert "error" not in r, (name, r.get("error"))
            assert r["slice"][1] == count and r["local_shapes"] == [[local, GPT["seq"]]] * 3, r
            assert max(r["loss_diffs"]) < 2e-5 * max(1.0, r["loss"]) and r["grad_diff"] < 2e-5, (name, r)
        by_slice = {}
        for r in results:
            by_slice.setdefault(r["slice"][0], []).append(r["indices"])
        assert sorted(by_slice) == list(range(count))
        for same in by_slice.values():
            assert all(s == same[0] for s in same)  # ranks along tp load the same samples
        everything = [i for same in by_slice.values() for i in same[0]]
        assert sorted(everything) == list(range(3 * GPT["batch"]))  # disjoint, together the dataset


@pytest.mark.slow
def test_gradient_accumulation_syncs_once_per_step(tmp_path):
    """k=4 micro-batches, the first 3 under ``model.no_sync()``: gradients equal one single-process
    backward of the whole batch. Every micro-batch's forward runs the plan's predicted forward
    collectives; the no_sync micro-batches' backwards run no gradient collective (a k=1 backward less its
    gradient buckets: only what the computation needs); the last runs exactly the collectives and
    bytes of a k=1 step, in as many buckets (8 KiB: several, launched while the last backward runs):
    the step's gradient synchronization does not depend on k. Plans: data
    parallel on 4 (plain parameters, reduced in the backward graph when not accumulating), 2x2 dp x tp
    (DTensor parameters, GradSync's buckets, some reduced over both axes)."""
    from collections import Counter
    small = dict(GPT, batch=4)
    jobs = [dict(name=n, model="gpt", kwargs=small, mesh=list(shape), axis_names=axes, check="accumulate", k=4,
                 plan=plan_for("gpt", small, tuple(shape), axes, **placement), apply={"bucket_bytes": 8192})
            for n, shape, axes, placement in (
                ("dp", [4], ["dp"], dict(inputs="S(0)")),
                ("dp_tp", [2, 2], ["dp", "tp"], dict(inputs="S(0),R", params=megatron(2))))]
    for rank in run_ranks(4, jobs, tmp_path, timeout_s=240):
        for job in jobs:
            name, r = job["name"], rank[job["name"]]
            assert "error" not in r, (name, r.get("error"))
            assert r["grad_diff"] < 1e-5 * max(1.0, r["grad_scale"]), (name, r)
            forward = dict(Counter(c["op"] for c in job["plan"]["predictions"]["collectives"]
                                   if c.get("phase", "forward") == "forward"))
            (k1_fwd, k1_bwd), k1_buckets = r["k1_counts"], r["k1_buckets"]
            assert k1_fwd == forward and k1_buckets, (name, r)
            compute_only = Counter(k1_bwd) - Counter({"all_reduce": len(k1_buckets)})  # one per bucket and axis
            for i, ((fwd, bwd), buckets) in enumerate(zip(r["counts"], r["buckets"])):
                assert fwd == forward, (name, i, r)
                if i < 3:
                    assert buckets == [] and Counter(bwd) == compute_only, (name, i, r)
            # the same collectives and bytes per axis; buckets may cut the gradients at other points (the
            # graph orders them by where backward computes them, GradSync by when autograd hands them over)
            last = r["buckets"][3]
            assert r["counts"][3][1] == k1_bwd and len(last) == len(k1_buckets), (name, r)
            for axis in (0, 1):
                assert sum(b[2] for b in last if b[1] == axis) == sum(b[2] for b in k1_buckets if b[1] == axis), r
            assert len(last) > 2 and r["overlapped"] >= 1, r  # 8 KiB buckets: launched while the last backward runs
            assert "inside no_sync" in r["clip_in_no_sync"], r


def test_launcher_accumulates_clips_and_verifies_per_optimizer_step(tmp_path):
    """``launch --accumulate 3 --max-norm 1 --verify`` on 2 data-parallel ranks: --verify counts
    over the whole optimizer step: the plan's forward and backward collectives 3 times (once per
    micro-batch), its gradient synchronization once (one bucket carrying every gradient)."""
    import json
    import os
    import subprocess
    import sys

    from cauto.plan import dump
    from cauto.runtime.dist_utils import free_port
    plan = plan_for("gpt", {}, (2,), ["dp"], inputs="S(0)")  # the factory's default sizes (batch 4)
    path = dump(plan, tmp_path / "plan.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "cauto.runtime.launch", "cauto.profiler.zoo:gpt", "--plan", str(path), "--steps", "2", "--accumulate", "3", "--max-norm", "1.0", "--verify", "--timeout-s", "60",
           "--measured-out", str(tmp_path / "measured.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "step 2/2 loss" in res.stdout and "per optimizer step of 3 micro-batches" in res.stdout, res.stdout
    report = json.loads((tmp_path / "measured.json").read_text())
    assert report["accumulate"] == 3
    assert report["forward"]["predicted"] == report["forward"]["executed"] == {"all_reduce": 3}, report  # the loss's
    # backward: what the computation needs, once per micro-batch (a hand-made plan predicts no backward collective)
    assert report["backward"]["executed"] and all(n % 3 == 0 for n in report["backward"]["executed"].values()), report
    from cauto.profiler import zoo
    params = sum(p.numel() for p in zoo.ZOO["gpt"]()[0].parameters())
    assert report["grad_sync"]["executed_buckets"] == 1 and report["grad_sync"]["executed_bytes"] == 4 * params, report


def test_batch_slice_of_unevenly_split_inputs_raises_or_gives_the_whole_batch():
    """A plan that splits one input over the data-parallel axis and replicates another has no single batch
    slice: ``batch_slice()`` says which inputs differ; ``uneven="whole"`` warns and gives the whole batch
    (count 1), which the module then cuts per input as the plan places it."""
    import copy

    from conftest import zoo_capture

    from cauto.plan import PlanDocument
    from cauto.runtime.data import batch_slice
    from cauto.runtime.dist_utils import make_mesh
    plan = plan_for("gpt", GPT, (2,), ["dp"], inputs="S(0)")
    cap = zoo_capture("gpt", GPT)
    mesh = make_mesh((2,), ["dp"])
    inputs = [n.name for n in cap.graph.nodes if n.op == "placeholder" and cap.placeholders[n.name][0] == "input"]
    assert len(inputs) >= 2
    assert batch_slice(cap, PlanDocument.from_dict(plan), mesh).count == 2  # evenly split: half each
    uneven = copy.deepcopy(plan)
    uneven["nodes"][inputs[1]]["outputs"][0] = ["R"]
    doc = PlanDocument.from_dict(uneven)
    with pytest.raises(ValueError, match="no single batch slice"):
        batch_slice(cap, doc, mesh)
    with pytest.warns(UserWarning, match="every rank loads whole micro-batches"):
        whole = batch_slice(cap, doc, mesh, uneven="whole")
    assert (whole.index, whole.count, whole.axes) == (0, 1, ())
    with pytest.raises(ValueError, match="expected 'raise' or 'whole'"):
        batch_slice(cap, doc, mesh, uneven="skip")
