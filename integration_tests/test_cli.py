"""Every `cauto` subcommand, with good and bad input: bad input exits 2 with one clear line."""

import json

import pytest

from cauto.profiler.zoo import mlp  # noqa: F401  (the factory the CLI targets below)

TARGET = "cauto.profiler.zoo:mlp"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, cauto):
    run_cauto = cauto
    out = tmp_path_factory.mktemp("cli")
    prof = run_cauto("profile", TARGET, "-o", str(out / "graph.json"))
    assert prof.returncode == 0, prof.stderr
    plan = run_cauto("plan", str(out / "graph.json"), "--mesh", "2", "-o", str(out / "plan.json"))
    assert plan.returncode == 0, plan.stderr
    return out, prof, plan


def test_profile_prints_module_table_and_writes_graph(artifacts):
    out, prof, _ = artifacts
    assert "layers.0" in prof.stdout and "peak" in prof.stdout
    assert json.loads((out / "graph.json").read_text())["kind"] == "graph"


def test_plan_prints_summary(artifacts):
    _, _, plan = artifacts
    assert "predicted step time" in plan.stdout and "per-device peak" in plan.stdout


def test_explain_text_and_html(artifacts, cauto):
    out, _, _ = artifacts
    res = cauto("explain", str(out / "plan.json"), "--graph", str(out / "graph.json"), "--html", str(out / "r.html"))
    assert res.returncode == 0, res.stderr
    page = (out / "r.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "<script" not in page


def test_codegen_writes_compilable_python(artifacts, cauto):
    out, _, _ = artifacts
    res = cauto("codegen", str(out / "plan.json"), "--target", TARGET, "-o", str(out / "parallel.py"))
    assert res.returncode == 0, res.stderr
    source = (out / "parallel.py").read_text()
    compile(source, "parallel.py", "exec")
    assert "def forward" in source


def test_usage_errors(cauto):
    assert cauto().returncode == 2
    res = cauto("frobnicate")
    assert res.returncode == 2 and "unknown command" in res.stderr


def test_profile_bad_target(cauto, tmp_path):
    res = cauto("profile", "no/such/file.py:fn", "-o", str(tmp_path / "g.json"))
    assert res.returncode == 2 and "not found" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "g.json").exists()


def test_plan_missing_and_malformed_graph(cauto, tmp_path):
    res = cauto("plan", str(tmp_path / "missing.json"), "--mesh", "2", "-o", str(tmp_path / "p.json"))
    assert res.returncode == 2 and "not found" in res.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": "1.0", "kind": "graph", "nodes": [')
    res = cauto("plan", str(bad), "--mesh", "2", "-o", str(tmp_path / "p.json"))
    assert res.returncode == 2 and "truncated" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "p.json").exists()


def test_plan_infeasible_budget_says_what_it_needs(artifacts, cauto, tmp_path):
    out, _, _ = artifacts
    res = cauto("plan", str(out / "graph.json"), "--mesh", "2", "--memory", "1KiB", "-o", str(tmp_path / "p.json"))
    assert res.returncode == 2
    assert "needs" in res.stderr and "MiB" in res.stderr
    assert not (tmp_path / "p.json").exists()


def test_explain_and_run_refuse_malformed_plan(cauto, tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"schema_version": "9.0", "kind": "plan"}))
    res = cauto("explain", str(bad))
    assert res.returncode == 2 and "9.0" in res.stderr
    res = cauto("run", TARGET, "--plan", str(tmp_path / "none.json"), "--nproc", "2")
    assert res.returncode == 2 and "not found" in res.stderr


def test_codegen_refuses_a_plan_for_another_model(artifacts, cauto, tmp_path):
    out, _, _ = artifacts
    res = cauto("codegen", str(out / "plan.json"), "--target", TARGET, "--batch", "16", "-o", str(tmp_path / "x.py"))
    assert res.returncode == 2 and "profile and solve again" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x.py").exists()
