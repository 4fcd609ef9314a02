"""Bounded time: `cauto run` ends a stalled or broken job within timeout + 60 s, with one line saying why.

The fault matrix runs real jobs (torchrun, 2 gloo ranks, a real plan with collectives from the real
profiler and solver): rank 1 stops itself (SIGSTOP) or is killed (SIGKILL) during setup, in forward
and in the optimizer step (the launcher's test hook, $CAUTO_TEST_FAULT), or hangs outside a
collective. The one wall-clock bound asserted is the feature itself: the exit within timeout + 60 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from cauto.cli.watchdog import EXIT_STALLED, Watchdog
from cauto.runtime.heartbeat import Heartbeat, parse_fault, read_heartbeats

TIMEOUT_S = 10
TARGET = "cauto.profiler.zoo:mlp"  # the model of the sharded_plan fixture (conftest.py)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _beat(directory, local, **fields):
    state = {"rank": local, "pid": os.getpid(), "phase": "forward", "step": 3, "phase_since": time.time(),
             "beat": time.time(), "ended": None, "error": None, **fields}
    (directory / f"local{local}.json").write_text(json.dumps(state))


# --- the watchdog's reading of heartbeats (real files, no processes) ------------------------------------

def test_a_rank_that_stops_beating_is_named_with_its_phase_and_step(tmp_path):
    dog = Watchdog(tmp_path, 2, timeout_s=10)
    _beat(tmp_path, 0)
    _beat(tmp_path, 1, beat=time.time() - 3)
    assert dog.stalled() is None
    _beat(tmp_path, 1, beat=time.time() - 12, phase="optimizer", step=7)
    assert dog.stalled() == "cauto run: rank 1 stalled in optimizer (step 7) for 12 s; ended the job"
    _beat(tmp_path, 1, beat=time.time() - 12, ended="done")  # a finished rank beats no more: no stall
    assert dog.stalled() is None


def test_a_rank_that_never_starts_stalls_the_job_after_the_startup_allowance(tmp_path):
    dog = Watchdog(tmp_path, 2, timeout_s=10)
    _beat(tmp_path, 0, beat=dog.started + 40)
    assert dog.stalled() is None
    line = dog.stalled(now=dog.started + 10 + 31)
    assert line is not None and line.startswith("cauto run: local rank 1 never started")


def test_verdict_blames_the_rank_that_died_without_a_word_before_the_peers_it_broke(tmp_path):
    dog = Watchdog(tmp_path, 3, timeout_s=10)
    _beat(tmp_path, 0, ended="failed", error="collective all_gather lost a peer", beat=time.time() - 5)
    _beat(tmp_path, 1, ended="SIGTERM")
    _beat(tmp_path, 2, pid=_dead_pid(), phase="backward", step=2)
    line = dog.verdict(1)
    assert line.startswith("cauto run: rank 2 died in backward (step 2) without an error"), line
    _beat(tmp_path, 2, ended="SIGTERM")  # no silent death: the first error is the cause
    assert dog.verdict(1) == ("cauto run: rank 0 failed in forward (step 3): collective all_gather lost a peer; "
                              "the job ended (exit 1)")


def test_heartbeat_file_follows_phases_and_the_fault_spec_is_checked(tmp_path):
    beat = Heartbeat(rank=5, local_rank=1, directory=tmp_path, interval_s=0.05)
    beat.enter("backward", 4)
    got = read_heartbeats(tmp_path)[1]
    assert (got["rank"], got["phase"], got["step"], got["pid"], got["ended"]) == (5, "backward", 4, os.getpid(), None)
    first = got["beat"]
    time.sleep(0.3)
    assert read_heartbeats(tmp_path)[1]["beat"] > first  # the thread keeps beating
    beat.end("failed", "boom")
    assert read_heartbeats(tmp_path)[1]["ended"] == "failed"
    assert parse_fault("1:forward:SIGSTOP") == (1, "forward", "SIGSTOP", 1)
    assert parse_fault("0:optimizer:hang:3") == (0, "optimizer", "hang", 3)
    with pytest.raises(ValueError, match="RANK:PHASE:ACTION"):
        parse_fault("1:forward:SIGBUS")


# --- real jobs: the fault matrix -----------------------------------------------------------------------

def _job_pids(token: str) -> set[int]:
    """Processes whose environment holds ``token`` (this job's, not other jobs' on a shared machine)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if token.encode() in fh.read().split(b"\0"):
                        found.add(int(entry))
            except OSError:
                pass
    return found


FAULTS = [(action, phase) for action in ("SIGSTOP", "SIGKILL") for phase in ("setup", "forward", "optimizer")]


@pytest.mark.parametrize(("action", "phase"), [  # CI: each fault in forward; the other phases in `nox -s slow`
    pytest.param(a, p, marks=[] if p == "forward" else [pytest.mark.slow]) for a, p in FAULTS + [("hang", "forward")]])
def test_fault_ends_the_job_in_bounded_time_with_one_line(sharded_plan, action, phase):
    token = f"CAUTO_TEST_JOB={uuid.uuid4().hex}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CAUTO_TEST_FAULT": f"1:{phase}:{action}", token.split("=")[0]: token.split("=")[1]}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "cauto.cli.main", "run", TARGET, "--plan", str(sharded_plan),
                                 "--nproc", "2", "--steps", "3", "--timeout-s", str(TIMEOUT_S)],
                                stdout=out, stderr=err, text=True, env=env)
        seen: set[int] = set()
        while proc.poll() is None and time.monotonic() - start < TIMEOUT_S + 120:
            seen |= _job_pids(token)
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        returncode = proc.wait()
        err.seek(0)
        res = subprocess.CompletedProcess(proc.args, returncode, "", err.read())
    elapsed_s = time.monotonic() - start
    lines = [line for line in res.stderr.splitlines() if line.startswith("cauto run:")]
    print(f"{action} {phase}: exit {res.returncode} after {elapsed_s:.1f} s: {lines}")
    assert res.returncode != 0
    assert elapsed_s < TIMEOUT_S + 60
    assert len(lines) == 1, res.stderr[-3000:]
    where = phase if phase == "setup" else f"{phase} (step 1)"
    if action == "SIGSTOP":
        assert res.returncode == EXIT_STALLED
        assert lines[0].startswith(f"cauto run: rank 1 stalled in {where} for "), lines
        assert lines[0].endswith("s; ended the job")
    elif action == "SIGKILL":
        assert lines[0].startswith(f"cauto run: rank 1 died in {where} without an error"), lines
    else:  # rank 1 stuck outside any collective: rank 0's collective times out and names itself
        assert lines[0].startswith("cauto run: rank 0 failed in forward (step 1): collective all_gather timed out "
                                   f"after {TIMEOUT_S} s"), lines
    assert len(seen) >= 4, "the job ran as cauto run, torchrun and two ranks"
    assert not _job_pids(token), "every process of the job has ended (torchrun and both ranks)"
