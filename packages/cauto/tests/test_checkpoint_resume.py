"""Checkpoint and resume through `cauto run` on 2 gloo ranks (device-only plan with collectives).

A run resumed from a checkpoint prints the losses of the uninterrupted run (9 significant digits, as the
launcher prints them), on the same mesh (exactly) and on another (2 ranks -> 1: DCP reshards; within 1e-6); a rank killed
during a save leaves the previous checkpoint usable (the partial one is ignored); a checkpoint of
another model, or none at all, is refused before any rank starts.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

TARGET = "cauto.profiler.zoo:mlp"  # the model of the sharded_plan fixture (conftest.py)


def _losses(stdout: str) -> dict[int, str]:
    return {int(k): loss for k, loss in re.findall(r"^step (\d+)/\d+ loss (\S+)", stdout, re.M)}


def test_kill_during_save_then_resume_gives_the_uninterrupted_losses(run_cauto, sharded_plan, tmp_path):
    run = ("run", TARGET, "--plan", str(sharded_plan), "--nproc", "2", "--timeout-s", "30")
    whole = run_cauto(*run, "--steps", "4")
    assert whole.returncode == 0, whole.stderr[-2000:]
    reference = _losses(whole.stdout)
    assert sorted(reference) == [1, 2, 3, 4] and len(set(reference.values())) == 4
    saves = tmp_path / "ckpt"
    killed = run_cauto(*run, "--steps", "4", "--save-every", "2", "--save-dir", str(saves),
                       env={"CAUTO_TEST_FAULT": "1:save:SIGKILL:4"})
    assert killed.returncode != 0 and "rank 1 died in save (step 4)" in killed.stderr, killed.stderr[-2000:]
    complete = sorted(p.name for p in saves.iterdir() if (p / "COMPLETE.json").is_file())
    assert complete == ["step-00000002"], sorted(p.name for p in saves.iterdir())
    resumed = run_cauto(*run, "--steps", "4", "--resume", str(saves))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from step 2" in resumed.stdout
    assert _losses(resumed.stdout) == {3: reference[3], 4: reference[4]}

    # another mesh: the 2-rank checkpoint (parameters and Adam state sharded) resumed on 1 process
    one = tmp_path / "one.json"
    assert run_cauto("plan", str(sharded_plan.parent / "graph.json"), "--mesh", "1", "-o", str(one)).returncode == 0
    moved = run_cauto("run", TARGET, "--plan", str(one), "--nproc", "1", "--steps", "4", "--resume", str(saves))
    assert moved.returncode == 0, moved.stderr[-2000:]
    got = _losses(moved.stdout)  # another reduction order: equal to fp32 rounding, not bit for bit
    assert sorted(got) == [3, 4] and all(float(got[k]) == pytest.approx(float(reference[k]), rel=1e-6) for k in got)

    other = tmp_path / "other"
    shutil.copytree(saves / "step-00000002", other / "step-00000002")
    marker = other / "step-00000002" / "COMPLETE.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "graph_fingerprint": "0" * 64}))
    refused = run_cauto(*run, "--steps", "4", "--resume", str(other))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "is of graph 000000000000" in refused.stderr and "[rank" not in refused.stderr
    empty = run_cauto(*run, "--steps", "4", "--resume", str(tmp_path / "nothing"))
    assert empty.returncode == 2 and "no complete checkpoint" in empty.stderr


def _plan(run_cauto, graph, out, *flags):
    res = run_cauto("plan", str(graph), *flags, "-o", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    return out


@pytest.mark.slow
def test_four_rank_checkpoints_resume_exactly_on_their_mesh_and_within_1e_6_on_others(run_cauto, tmp_path):
    """4 ranks, a device-only plan that shards parameters and a chunked plan (ZeRO chunks): each
    resumed on its own plan repeats the uninterrupted losses exactly; the device-only checkpoint
    resumed on 2x2 and on 2 ranks, and the chunked one on a device-only plan of 2 ranks (DCP reads the
    owners' chunks into DTensor shards), stay within 1e-6 relative."""
    graph = tmp_path / "graph.json"
    assert run_cauto("profile", TARGET, "-o", str(graph)).returncode == 0
    sharded4 = _plan(run_cauto, graph, tmp_path / "sharded4.json", "--mesh", "4", "--memory", "0.8MiB")
    assert any(e["placements"] != ["R"] for e in json.loads(sharded4.read_text())["params"].values())
    chunked4 = _plan(run_cauto, graph, tmp_path / "chunked4.json", "--mesh", "4", "--offload", "chunked")
    assert {e["state"] for e in json.loads(chunked4.read_text())["params"].values()} == {"chunked"}
    grid = _plan(run_cauto, graph, tmp_path / "grid.json", "--mesh", "2x2", "--memory", "0.8MiB")
    two = _plan(run_cauto, graph, tmp_path / "two.json", "--mesh", "2", "--memory", "1.2MiB")

    def train(plan, nproc, *flags):
        res = run_cauto("run", TARGET, "--plan", str(plan), "--nproc", str(nproc), "--steps", "6", "--timeout-s", "90",
                        *flags)
        assert res.returncode == 0, res.stderr[-3000:]
        return _losses(res.stdout)

    for plan, others in ((sharded4, [(grid, 4), (two, 2)]), (chunked4, [(two, 2)])):
        saves = tmp_path / f"saves-{plan.stem}"
        whole = train(plan, 4, "--save-every", "3", "--save-dir", str(saves))
        shutil.rmtree(saves / "step-00000006")  # resume from step 3
        resumed = train(plan, 4, "--resume", str(saves))
        after = {k: v for k, v in whole.items() if k > 3}
        assert after and resumed == after, (plan.stem, resumed, whole)
        for other, nproc in others:
            moved = train(other, nproc, "--resume", str(saves))
            assert sorted(moved) == sorted(after), moved
            for k in after:
                assert float(moved[k]) == pytest.approx(float(after[k]), rel=1e-6), (plan.stem, other.stem, k)
