"""Fixtures of the tests of real `cauto run` jobs: the command, and a real plan whose steps communicate
(zoo MLP, ``TARGET``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TARGET = "cauto.profiler.zoo:mlp"


def cauto(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Run the `cauto` command (text output, one thread per process)."""
    return subprocess.run([sys.executable, "-m", "cauto.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="session")
def run_cauto():
    """The `cauto` command as a function: ``run_cauto(*args, env=None, timeout=300)``."""
    return cauto


@pytest.fixture(scope="session")
def sharded_plan(tmp_path_factory):
    """A plan for 2 ranks whose forward has collectives (the real solver under a tight budget)."""
    out = tmp_path_factory.mktemp("watchdog")
    assert cauto("profile", TARGET, "-o", str(out / "graph.json")).returncode == 0
    res = cauto("plan", str(out / "graph.json"), "--mesh", "2", "--memory", "1.1MiB", "-o", str(out / "plan.json"))
    assert res.returncode == 0, res.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert any(c["phase"] == "forward" for c in plan["predictions"]["collectives"]), "the plan must communicate"
    return out / "plan.json"


