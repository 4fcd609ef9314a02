"""The solver must never import torch (it runs where only the exported graph exists)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def test_no_torch_import_in_sources():
    pattern = re.compile(r"^\s*(import torch|from torch)\b", re.M)
    offenders = [str(p) for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_solving_leaves_torch_unloaded():
    code = ("import sys; from cauto.solver import solve, cluster_for_mesh, synthetic; "
            "solve(synthetic.mlp(), cluster_for_mesh('cpu-gloo', (2,))); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
