"""Every `cauto` subcommand, with good and bad input: bad input exits 2 with one clear line."""

import json
import os

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
    # the unsharded profile beside the plan's per-device view, both as inline SVG, with their numbers
    plan = json.loads((out / "plan.json").read_text())
    graph = json.loads((out / "graph.json").read_text())
    peak_mib = f"{plan['predictions']['peak_bytes'] / 2**20:,.1f} MiB"
    assert '<svg id="unsharded-memory"' in page and '<svg id="device-memory"' in page
    device = page[page.index('<svg id="device-memory"'):]
    device = device[:device.index("</svg>")]
    assert f"predicted peak {peak_mib}" in device and "<polyline" in device
    assert f"model state {plan['predictions']['model_state_bytes'] / 2**20:,.1f} MiB" in device
    table = page[page.index("<table id='phase-peaks'>"):]
    assert f"<td>backward</td><td>{graph['memory']['phases']['backward'] / 2**20:,.1f} MiB</td>" in table
    assert peak_mib in table[:table.index("</table>")]


def test_explain_html_marks_the_measured_peaks(artifacts, cauto, tmp_path):
    """With PLAN.measured.json (what `cauto run --verify` writes) beside the plan, every rank's peak is a marker."""
    out, _, _ = artifacts
    plan = tmp_path / "plan.json"
    plan.write_text((out / "plan.json").read_text())
    predicted = json.loads(plan.read_text())["predictions"]["peak_bytes"]
    per_rank = [predicted + 3 * 2**20, predicted + 5 * 2**20]
    plan.with_suffix(".measured.json").write_text(json.dumps(
        {"peak_bytes": {"predicted": predicted, "measured": per_rank[0], "measured_per_rank": per_rank},
         "forward": {"predicted": {}, "executed": {}}, "backward": {"predicted": {}, "executed": {}}}))
    for args in (("--graph", str(out / "graph.json")), ()):  # per-device timeline, or the prediction's parts
        res = cauto("explain", str(plan), *args, "--html", str(tmp_path / "r.html"))
        assert res.returncode == 0, res.stderr
        page = (tmp_path / "r.html").read_text()
        device = page[page.index('<svg id="device-memory"'):]
        device = device[:device.index("</svg>")]
        for rank, value in enumerate(per_rank):
            assert f"<title>rank {rank}: measured {value / 2**20:,.1f} MiB</title>" in device
        assert "measured per rank: " + ", ".join(f"{v / 2**20:.2f}" for v in per_rank) + " MiB" in device


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


# --- one front door: every plan check before any rank starts -------------------------------------------

def _edited_plan(out, tmp_path, edit) -> str:
    plan = json.loads((out / "plan.json").read_text())
    edit(plan)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(plan))
    return str(path)


def _one_line_refusal(res, *words) -> None:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr and "[rank" not in res.stderr, res.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_run_checks_world_size_names_and_ranks_before_spawning(artifacts, cauto, tmp_path):
    out, _, _ = artifacts
    _one_line_refusal(cauto("run", TARGET, "--plan", str(out / "plan.json"), "--nproc", "1"),
                      "needs 2 processes, but the job has 1", "--nproc 2")
    _one_line_refusal(cauto("run", TARGET, "--plan", str(out / "plan.json"), "--nproc", "1", "--", "--nnodes", "3"),
                      "the job has 3")
    first_param = next(iter(json.loads((out / "plan.json").read_text())["params"]))

    def s9(plan):
        plan["params"][first_param]["placements"] = ["S(9)"]
    _one_line_refusal(cauto("run", TARGET, "--plan", _edited_plan(out, tmp_path, s9), "--nproc", "2"),
                      f"$.params.{first_param}.placements[0]", "shards dim 9")

    def ghost(plan):
        plan["nodes"]["ghost"] = next(iter(plan["nodes"].values()))
    _one_line_refusal(cauto("run", TARGET, "--plan", _edited_plan(out, tmp_path, ghost), "--nproc", "2"),
                      "$.nodes.ghost", "not in the graph")
    _one_line_refusal(cauto("run", TARGET, "--plan", str(out / "plan.json"), "--nproc", "2", "--batch", "16"),
                      "the model changed since planning")


def test_explain_refuses_a_graph_of_another_model(artifacts, cauto, tmp_path):
    out, _, _ = artifacts
    assert cauto("profile", TARGET, "--batch", "16", "-o", str(tmp_path / "other.json")).returncode == 0
    res = cauto("explain", str(out / "plan.json"), "--graph", str(tmp_path / "other.json"), "--html",
                str(tmp_path / "r.html"))
    _one_line_refusal(res, "cauto explain: error:", "the model changed since planning")
    assert not (tmp_path / "r.html").exists()


# --- truthful messages ------------------------------------------------------------------------------------

def test_help_and_errors_print_no_done_or_failed_line(artifacts, cauto, tmp_path):
    for command in ("plan", "profile", "codegen"):
        res = cauto(command, "--help")
        assert res.returncode == 0 and "usage:" in res.stdout, res.stderr
        assert "failed:" not in res.stderr and "done:" not in res.stderr, (command, res.stderr)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": "1.0", "kind": "graph", "nodes": [')
    res = cauto("plan", str(bad), "--mesh", "2", "-o", str(tmp_path / "p.json"))
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "done:" not in res.stderr, res.stderr
    out, _, _ = artifacts
    res = cauto("codegen", str(out / "plan.json"), "--target", TARGET, "--batch", "16", "-o", str(tmp_path / "x.py"))
    assert res.returncode == 2 and "done:" not in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr


def test_explain_errors_are_labelled_explain(cauto, tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"schema_version": "9.0", "kind": "plan"}))
    res = cauto("explain", str(bad))
    assert res.returncode == 2 and res.stderr.startswith("cauto explain: error:") and "cauto-solve" not in res.stderr


# --- safe writers: the same rules in every command -------------------------------------------------------

def test_codegen_and_explain_create_missing_folders(artifacts, cauto, tmp_path):
    out, _, _ = artifacts
    res = cauto("codegen", str(out / "plan.json"), "--target", TARGET, "-o", str(tmp_path / "new" / "code" / "p.py"))
    assert res.returncode == 0, res.stderr  # was a FileNotFoundError traceback
    compile((tmp_path / "new" / "code" / "p.py").read_text(), "p.py", "exec")
    res = cauto("explain", str(out / "plan.json"), "--html", str(tmp_path / "new" / "html" / "r.html"))
    assert res.returncode == 0 and (tmp_path / "new" / "html" / "r.html").read_text().startswith("<!doctype html>")
    assert sorted(p.name for p in (tmp_path / "new").rglob("*")) == ["code", "html", "p.py", "r.html"]  # no temp files


def test_every_writer_refuses_special_files_and_symlinks(artifacts, cauto, tmp_path):
    out, _, _ = artifacts
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    commands = {"profile": ("profile", TARGET, "-o"), "plan": ("plan", str(out / "graph.json"), "--mesh", "2", "-o"),
                "codegen": ("codegen", str(out / "plan.json"), "--target", TARGET, "-o"),
                "explain": ("explain", str(out / "plan.json"), "--html")}
    for name, args in commands.items():
        for target, words in ((fifo, "is a FIFO"), (link, "pass --replace-symlink"), (tmp_path, "is a directory")):
            res = cauto(*args, str(target))
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 2 and len(lines) == 1 and words in lines[0] and str(target) in lines[0], \
                (name, target, res.stderr)
            assert ".tmp" not in res.stderr
    assert fifo.is_fifo() and link.is_symlink() and not (tmp_path / "target").exists()
    res = cauto("plan", str(out / "graph.json"), "--mesh", "2", "-o", str(link), "--replace-symlink")
    assert res.returncode == 0 and not link.is_symlink() and json.loads(link.read_text())["kind"] == "plan"
