"""Parameters gathered again in backward (plan ``execution.regather_params``, FSDP's reshard after forward).

The local program recomputes each gathered parameter's chain (all-gather, wait, the reshapes that put
the chunks in place) where backward first reads it instead of saving the copy. These tests run a
ZeRO-3 plan (every parameter stored S(0), gathered for use) with and without it on two gloo ranks:
both must train exactly as one process does, and only the regathering one gathers in backward.
"""

from __future__ import annotations

import json

import pytest
from conftest import plan_for, run_ranks

from cauto.plan import load_plan

KW = dict(batch=4, seq=16, vocab=64, dim=32, layers=2, heads=4)
TOL = 2e-5


def _zero3(tmp_path, regather: bool) -> dict:
    raw = plan_for("gpt", KW, (2,), ["dp"], inputs="S(0)", storage="S(0)")
    path = tmp_path / f"plan_{regather}.json"
    path.write_text(json.dumps(raw))
    doc = load_plan(path).to_dict()  # brought to the current schema (execution section)
    if regather:
        doc["execution"]["regather_params"] = True
    return doc


def test_zero3_with_regather_trains_as_one_process_and_gathers_again_in_backward(tmp_path):
    jobs = [dict(name=f"gpt_zero3_{r}", model="gpt", kwargs=KW, mesh=[2], axis_names=["dp"], check=None,
                 plan=_zero3(tmp_path, r)) for r in (False, True)]
    for result in run_ranks(2, jobs, tmp_path, timeout_s=240):
        for name in ("gpt_zero3_False", "gpt_zero3_True"):
            r = result[name]
            assert "error" not in r, r.get("error")
            assert max(r["loss_diffs"]) < TOL * max(1.0, abs(r["loss"])), r
            assert r["grad_diff"] < TOL, r
        keep, again = result["gpt_zero3_False"], result["gpt_zero3_True"]
        # the same forward; backward gathers the copies its ops read (linear weights, layer norm
        # weights and biases) again, and reduce-scatters the same gradients
        assert again["forward"] == keep["forward"]
        assert keep["backward"].get("all_gather", 0) == 0
        assert again["backward"].get("all_gather", 0) > 0
        assert again["backward"].get("reduce_scatter") == keep["backward"].get("reduce_scatter")
        assert again["loss_diffs"] == pytest.approx(keep["loss_diffs"], abs=TOL)


def test_regather_refused_on_the_dtensor_interpreter(tmp_path):
    import torch.distributed as dist  # noqa: F401  (plan_for made a fake group of 2)

    from cauto.profiler import zoo
    from cauto.runtime.apply import apply
    from cauto.runtime.dist_utils import make_mesh
    from cauto.runtime.errors import PlanMismatchError

    doc = _zero3(tmp_path, True)
    with pytest.raises(PlanMismatchError, match="regather_params.*lowering='local'"):
        apply(lambda: zoo.gpt(**KW), doc, make_mesh((2,), ["dp"]), lowering="dtensor")
