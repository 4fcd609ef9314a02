"""Property-based fuzzing of the front door: mutated real graph and plan documents through the CLI.

The documents are real: the zoo GPT at a tiny size, profiled by the real profiler and planned by the
real solver under a budget that makes it shard. Each example changes one to three values anywhere in
a document (non-finite, huge, negative or tiny numbers; placements with other dims; names of nodes
that do not exist; wrong types; deleted fields; shortened lists) and runs `cauto plan` on a mutated
graph, or `cauto codegen` on a mutated plan, in this process. Every outcome must be a valid plan
(or compilable code) for the document as mutated, or exit 2 with one error line and no partial file:
never a traceback, never a hang (an alarm ends an example after ``HANG_S``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cauto.cli.main import main as cauto_main
from cauto.plan import check_plan_matches_graph, load

TARGET = ["cauto.profiler.zoo:gpt", "--batch", "2", "--seq", "8"]
HANG_S = 60
EXAMPLES = 30

WEIRD_NUMBERS = [math.nan, math.inf, -math.inf, -1, 0, 1e-300, 1e30, 2**62, 10**40, 3.5]
WEIRD_STRINGS = ["", "S(9)", "S(1)", "S(0)", "R", "P(sum)", "ghost", "linear", "p_m_tok_weight", "dp", "#3"]
ANY_VALUE = st.one_of(st.sampled_from(WEIRD_NUMBERS), st.sampled_from(WEIRD_STRINGS),
                      st.sampled_from([None, True, [], {}, ["R"], ["S(5)", "R"]]),
                      st.integers(-3, 2**64), st.floats(allow_nan=True, allow_infinity=True))


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """(graph path, plan path) of the tiny zoo GPT, profiled and solved for 2 ranks under a tight budget."""
    from cauto.profiler import profile
    from cauto.profiler.target import bind_sizes, load_target
    from cauto.solver import InfeasibleBudgetError, plan
    from cauto.solver.cluster import cluster_for_mesh

    out = tmp_path_factory.mktemp("fuzz")
    graph = profile(bind_sizes(load_target(TARGET[0]), {"batch": 2, "seq": 8})).to_graph()
    cluster = cluster_for_mesh("cpu-gloo", (2,))
    with pytest.raises(InfeasibleBudgetError) as least:
        plan(graph, cluster, memory_budget=1)
    doc = plan(graph, cluster, memory_budget=least.value.needed_bytes)
    assert any(e["placements"] != ["R"] for e in doc["params"].values()), "the plan should shard"
    (out / "graph.json").write_text(json.dumps(graph))
    (out / "plan.json").write_text(json.dumps(doc))
    return out / "graph.json", out / "plan.json"


def _slots(doc, parts=()):
    """(container, key, value) of every value in ``doc``, containers included."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield doc, key, value
        yield from _slots(value, (*parts, key))


def _kind(value) -> str:
    if isinstance(value, bool) or value is None:
        return "other"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "placement" if value == "R" or value[:2] in ("S(", "P(") else "string"
    return "other"


@st.composite
def mutated(draw, doc: dict) -> dict:
    """``doc`` with 1-3 values changed: mostly numbers and placements (what a schema lets through),
    sometimes anything (a wrong type, a deleted field, a shortened list)."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        slots = list(_slots(doc))
        by_kind = {k: [s for s in slots if _kind(s[2]) == k] for k in ("number", "placement", "string")}
        aim = draw(st.sampled_from(["number", "number", "placement", "placement", "string", "any"]))
        pool = by_kind.get(aim) or slots
        container, key, value = pool[draw(st.integers(0, len(pool) - 1))]
        if aim == "number":
            container[key] = draw(st.sampled_from(WEIRD_NUMBERS))
        elif aim == "placement":
            container[key] = draw(st.sampled_from(["R", "S(0)", "S(1)", "S(2)", "S(3)", "S(9)", "P(sum)", "P(max)"]))
        elif aim == "string":
            container[key] = draw(st.sampled_from(WEIRD_STRINGS))
        else:
            how = draw(st.sampled_from(["delete", "shorten", "replace"]))
            if how == "delete" and isinstance(container, dict):
                del container[key]
            elif how == "shorten" and isinstance(value, list) and value:
                container[key] = value[:draw(st.integers(0, len(value) - 1))]
            else:
                container[key] = draw(ANY_VALUE)
    return doc


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


def _run(argv: list[str]) -> tuple[int, str]:
    """Run the `cauto` command in this process; (exit code, stderr). An alarm turns a hang into a failure."""
    def hang(*_):
        raise TimeoutError(f"cauto {' '.join(argv)} ran past {HANG_S} s")

    err = io.StringIO()
    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(HANG_S)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = cauto_main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        import torch.distributed as dist

        if dist.is_initialized():  # codegen's simulated group is the mutated plan's size
            dist.destroy_process_group()
    return rc, err.getvalue()


def _assert_refused(rc: int, stderr: str, command: str, output) -> None:
    errors = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("planning:", "done:"))]
    assert rc == 2, (rc, stderr)
    assert len(errors) == 1 and errors[0].startswith(command), stderr
    assert "Traceback" not in stderr
    assert not output.exists(), "no partial file"


@FUZZ
@given(data=st.data())
def test_plan_on_a_mutated_graph_plans_or_refuses_in_one_line(documents, tmp_path_factory, data):
    graph_path, _ = documents
    graph = data.draw(mutated(json.loads(graph_path.read_text())))
    folder = tmp_path_factory.mktemp("plan")
    (folder / "graph.json").write_text(json.dumps(graph))
    out = folder / "plan.json"
    rc, stderr = _run(["plan", str(folder / "graph.json"), "--mesh", "2", "--time-limit", "10", "-o", str(out)])
    if rc == 0:
        check_plan_matches_graph(load(out, "plan"), load(folder / "graph.json", "graph"))
    else:
        _assert_refused(rc, stderr, "cauto-solve:", out)


@FUZZ
@given(data=st.data())
def test_codegen_of_a_mutated_plan_writes_code_or_refuses_in_one_line(documents, tmp_path_factory, data):
    _, plan_path = documents
    plan = data.draw(mutated(json.loads(plan_path.read_text())))
    folder = tmp_path_factory.mktemp("codegen")
    (folder / "plan.json").write_text(json.dumps(plan))
    out = folder / "parallel.py"
    rc, stderr = _run(["codegen", str(folder / "plan.json"), "--target", *TARGET, "-o", str(out)])
    if rc == 0:
        compile(out.read_text(), str(out), "exec")
    else:
        _assert_refused(rc, stderr, "cauto-codegen:", out)
