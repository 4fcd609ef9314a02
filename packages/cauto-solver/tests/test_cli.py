from __future__ import annotations

import json

import pytest

from cauto.plan import check_document
from cauto.plan.units import parse_bytes
from cauto.solver import synthetic
from cauto.solver.cli import main


@pytest.fixture
def graph_file(tmp_path):
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(synthetic.gpt(batch=8, seq=32, hidden=64, heads=4, layers=2)))
    return path


def test_solve_writes_plan_and_prints_summary(graph_file, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([str(graph_file), "--mesh", "2x2", "--axis-names", "data,model", "--memory", "8GiB",
                 "-o", str(out)]) == 0
    plan = check_document(json.loads(out.read_text()), "plan")
    assert plan["mesh"] == {"shape": [2, 2], "axis_names": ["data", "model"]}
    assert plan["predictions"]["memory_budget_bytes"] == 8 << 30
    text = capsys.readouterr().out
    for word in ("predicted step time", "per-device peak", "collectives per step", "solver cbc"):
        assert word in text


def test_explain(graph_file, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([str(graph_file), "--mesh", "4", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "blocks.[0..1] params (x2 identical)" in text and "attn.q.weight" in text
    assert main(["explain", str(out), "--graph", str(graph_file)]) == 0
    assert "blocks.[0..1] ops" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--mesh", "2y2"], "mesh"),
    (["--mesh", "2x2", "--cluster", "tpu-v9"], "neither a preset"),
    (["--mesh", "2x2", "--memory", "lots"], "memory"),
    (["--mesh", "2x2", "--axis-names", "a"], "axis names"),
])
def test_bad_input_exits_2_without_plan(graph_file, tmp_path, capsys, args, message):
    out = tmp_path / "plan.json"
    assert main([str(graph_file), *args, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".plan.json*"))


def test_invalid_graph_exits_2(tmp_path, capsys):
    bad = tmp_path / "g.json"
    bad.write_text("{\"kind\": \"graph\", \"schema_version\": \"1.0\"}")
    out = tmp_path / "plan.json"
    assert main([str(bad), "--mesh", "2", "-o", str(out)]) == 2
    assert "error" in capsys.readouterr().err and not out.exists()
    assert main([str(tmp_path / "missing.json"), "--mesh", "2", "-o", str(out)]) == 2


def test_missing_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["graph.json"])
    assert info.value.code == 2


def test_infeasible_exits_1(graph_file, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([str(graph_file), "--mesh", "2", "--memory", "1KiB", "-o", str(out)]) == 2
    assert "least-memory plan the search finds needs" in capsys.readouterr().err and not out.exists()


def test_parse_bytes():
    assert parse_bytes("70GiB") == 70 << 30
    assert parse_bytes("1.5 MiB") == 3 << 19
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1e9") == 10**9
