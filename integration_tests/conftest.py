"""Helpers for integration tests: run the `cauto` command as a user would, with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_cauto(*args: str, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
    """Run `python -m cauto.cli.main ARGS` and return the completed process (text output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "cauto.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.fixture(scope="session")
def cauto():
    return run_cauto
