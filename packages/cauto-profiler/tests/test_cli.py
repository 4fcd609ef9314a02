"""cauto-profile: output on success, exit code 2 and no partial file on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from cauto.plan import load_graph
from cauto.profiler.cli import main


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "models.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_success_writes_valid_graph_and_json(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["cauto.profiler.zoo:gpt", "--batch", "2", "--seq", "16", "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["peak_bytes"] > 0 and summary["settings"]["optimizer"] == "adamw"
    assert load_graph(str(out)).memory["peak_bytes"] == summary["peak_bytes"]


def test_tables_by_default(capsys):
    assert main(["cauto.profiler.zoo:mlp", "--optimizer", "sgd"]) == 0
    text = capsys.readouterr().out
    assert "peak memory" in text and "layers.0" in text and "backward:2" in text


def test_bad_targets_exit_2_without_traceback(tmp_path, capsys):
    out = tmp_path / "g.json"
    bad = _write(tmp_path, """
        import torch
        from torch import nn
        def raises():
            raise ValueError("no such config")
        def real():
            m = nn.Linear(4, 4)
            m.weight = nn.Parameter(torch.zeros(4, 4, device="cpu"))
            return m, torch.randn(2, 4)
        def unsupported():
            class M(nn.Module):
                def __init__(self):
                    super().__init__(); self.l = nn.Linear(4, 4)
                def forward(self, x):
                    return torch.nonzero(self.l(x)).sum()
            return M(), torch.randn(2, 4)
        not_callable = 3
    """)
    cases = [
        ("cauto.profiler.zoo:nothere", "has no attribute"),
        ("no.such.module:fn", "module not found"),
        (str(tmp_path / "missing.py") + ":f", "file not found"),
        ("justtext", "must look like"),
        (bad + ":raises", "no such config"),
        (bad + ":real", "allocated real memory"),
        (bad + ":unsupported", "nonzero"),
        (bad + ":not_callable", "not callable"),
        ("cauto.profiler.zoo:mlp --seq 8", None),
    ]
    for target, needle in cases:
        argv = target.split() + ["-o", str(out)]
        assert main(argv) == 2, target
        err = capsys.readouterr().err
        assert "Traceback" not in err
        if needle:
            assert needle in err, (target, err)
        assert not out.exists()


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cauto.profiler.cli", "cauto.profiler.zoo:nothere"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "nothere" in proc.stderr
