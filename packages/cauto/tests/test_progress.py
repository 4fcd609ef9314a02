import io
import sys
import time

import pytest

from cauto.cli.progress import PhaseBars, bar, is_milestone, plan_bars, profile_bars, progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_stream_gets_one_line_per_phase():
    out = io.StringIO()
    with progress("solving", out):
        pass
    assert out.getvalue().startswith("done: solving in ") and out.getvalue().count("\n") == 1


def test_terminal_gets_redrawn_line_and_failure_is_reported():
    out = _Tty()
    with pytest.raises(ValueError), progress("profiling", out):
        time.sleep(0.35)
        raise ValueError("boom")
    text = out.getvalue()
    assert "\r" in text and "profiling" in text and "failed: profiling in 0." in text


# ------------------------------------------------------------------------------------- the bars

def test_bar_is_full_only_when_done():
    assert bar(0.5, 8) == "[####....]"
    assert bar(0.99, 8) == "[#######.]" and bar(1.0, 8) == "[########]" and bar(2.0, 4) == "[####]"


def test_terminal_bar_shows_the_fraction_and_keeps_finished_phases():
    out = _Tty()
    with PhaseBars("profiling", out, units={"symbolic steps": "nodes"}, tick_s=0) as bars:
        bars("symbolic steps", 0, 824)
        time.sleep(0.06)  # redraws are throttled to one per 50 ms between ticks
        bars("symbolic steps", 412, 824)
        assert out.getvalue().endswith("\033[K") and "\n" not in out.getvalue()  # redrawn in place
        bars("symbolic steps", 824, 824)
    text = out.getvalue()
    assert "\rprofiling: symbolic steps" in text
    assert "[############............]  412/824 nodes" in text
    assert "[########################]  824/824 nodes" in text
    lines = text.split("\n")
    assert len(lines) == 3 and lines[1].startswith("done: profiling in ")  # finished phase kept on its line


def test_terminal_ticks_show_elapsed_seconds_against_a_time_limit():
    out = _Tty()
    with PhaseBars("planning", out, limits_s={"ilp": 60}, tick_s=0.05) as bars:
        bars("ilp", 0, 1)
        time.sleep(0.3)
        bars("ilp", 1, 1)
    text = out.getvalue()
    assert "s of 60 s limit" in text and "done" in text


def test_plain_stream_prints_only_milestones():
    out = io.StringIO()
    with PhaseBars("planning", out, units={"costs": "nodes"}, quiet_s=0) as bars:
        for done in range(101):
            bars("costs", done, 100)
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines[:4]] == ["25%", "50%", "75%", "100%"]
    assert "(100/100 nodes)" in lines[3] and lines[4].startswith("done: planning in ")
    assert len(lines) == 5 and "\r" not in out.getvalue()


def test_plain_stream_is_quiet_for_fast_phases():
    out = io.StringIO()
    with PhaseBars("planning", out, units={"costs": "nodes"}) as bars:  # quiet_s=2: fast phases print their end
        for done in range(101):
            bars("costs", done, 100)
        bars("ilp", 0, 1)
        bars("ilp", 1, 1)
    assert [line.split(":")[1].split()[0] for line in out.getvalue().splitlines()] == ["costs", "ilp", "planning"]


def test_other_output_does_not_tear_the_bar():
    out = _Tty()
    bars = PhaseBars("training", out, tick_s=0)
    bars("steps", 1, 3, "  loss 1.0")
    bars.print_line("[rank 1] a warning\n")
    bars.close(ok=False)
    assert "\r\033[K[rank 1] a warning\n\rtraining: steps" in out.getvalue()
    assert out.getvalue().splitlines()[-1].startswith("failed: training in ")


def test_milestones():
    assert [k for k in range(1, 9) if is_milestone(k, 8, k - 1)] == [2, 4, 6, 8]
    assert [k for k in range(1, 4) if is_milestone(k, 3, k - 1)] == [1, 2, 3]
    assert not is_milestone(5, 8, 5) and not is_milestone(0, 0, 0)


# --------------------------------------------------------------------- profiler and solver callbacks

def _phases(calls):
    """phase -> [(done, total)], phases in the order they started."""
    out = {}
    for phase, done, total in calls:
        out.setdefault(phase, []).append((done, total))
    return out


def _assert_rising_to_total(calls):
    for phase, seen in _phases(calls).items():
        dones = [d for d, _ in seen]
        assert len({t for _, t in seen}) == 1, phase
        assert all(b > a for a, b in zip(dones, dones[1:])), (phase, dones)
        assert dones[0] == 0 and dones[-1] == seen[0][1], (phase, seen[0], seen[-1])


@pytest.fixture(scope="module")
def mlp_graph():
    from cauto.profiler import profile
    from cauto.profiler.zoo import mlp

    calls = []
    graph = profile(mlp, progress=lambda *a: calls.append(a)).to_graph()
    return graph, calls


def test_profiler_reports_capture_and_every_node_of_the_steps(mlp_graph):
    graph, calls = mlp_graph
    assert list(_phases(calls)) == ["capture", "symbolic steps"]
    _assert_rising_to_total(calls)
    ops = sum(n["kind"] == "op" for n in graph["nodes"])
    total = _phases(calls)["symbolic steps"][0][1]
    assert total >= 2 * 2 * ops  # 2 steps of forward + backward over (at least) every op node
    assert len(_phases(calls)["symbolic steps"]) > total // 2  # nodes of both forward and backward counted


def test_profile_without_callback_is_the_same_profile(mlp_graph):
    from cauto.profiler import profile
    from cauto.profiler.zoo import mlp

    assert profile(mlp).peak_bytes == mlp_graph[0]["memory"]["peak_bytes"]


def test_solver_reports_strategies_costs_and_the_ilp(mlp_graph):
    from cauto.solver import cluster_for_mesh, plan

    calls = []
    plan(mlp_graph[0], cluster_for_mesh("cpu-gloo", (2,)), progress=lambda *a: calls.append(a))
    assert list(_phases(calls)) == ["strategies", "costs", "ilp"]
    _assert_rising_to_total(calls)
    nodes = sum(n["kind"] != "output" for n in mlp_graph[0]["nodes"])
    assert _phases(calls)["costs"][-1] == (nodes, nodes) and _phases(calls)["ilp"] == [(0, 1), (1, 1)]


def test_cli_bars_draw_the_real_calls(mlp_graph):
    from cauto.solver import cluster_for_mesh, plan

    out = io.StringIO()
    with plan_bars(30.0, out) as bars:
        plan(mlp_graph[0], cluster_for_mesh("cpu-gloo", (2,)), progress=bars)
    nodes = sum(n["kind"] != "output" for n in mlp_graph[0]["nodes"])
    assert f"planning: costs 100% ({nodes}/{nodes} nodes)" in out.getvalue()
    assert "planning: ilp 100% (done)" in out.getvalue()
    out = io.StringIO()
    with profile_bars(out):
        pass
    assert out.getvalue().startswith("done: profiling in")


def test_autoparallelize_is_quiet_unless_asked(capsys):
    import torch

    from cauto.api import plan_for
    from cauto.api.autoparallel import factory_of
    from cauto.profiler.zoo import MLP

    fn = factory_of(lambda: MLP(16, 32, 2), (torch.randn(8, 16), torch.randn(8, 16)))
    plan_for(fn, (2,))
    assert capsys.readouterr().err == ""
    calls = []
    plan_for(fn, (2,), progress=lambda *a: calls.append(a))
    assert list(_phases(calls)) == ["capture", "symbolic steps", "strategies", "costs", "ilp"]
    plan_for(fn, (2,), progress=True)
    err = capsys.readouterr().err
    assert "profiling: symbolic steps 100%" in err and "done: profiling" in err and "done: planning" in err


# ------------------------------------------------------------------------------- training steps

_STEPS = "import sys\nfor k in range(1, 9): print(f'step {k}/8 loss {1 / k:.5f} time 0.010 s', flush=True)\n" \
         "print('measured figures written', flush=True)\n"


def test_run_keeps_milestone_steps_in_logs():
    from cauto.cli.run import run_torchrun

    out = io.StringIO()
    assert run_torchrun([sys.executable, "-c", _STEPS], stream=out) == 0
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["1/8", "2/8", "4/8", "6/8", "8/8"]
    assert lines[-1] == "measured figures written"


def test_run_draws_a_step_bar_on_a_terminal():
    from cauto.cli.run import run_torchrun

    out = _Tty()
    assert run_torchrun([sys.executable, "-c", _STEPS], stream=out) == 0
    text = out.getvalue()
    assert "training: steps" in text and "8/8  loss 0.12500  0.010 s/step" in text and "[####" in text
    assert "measured figures written\n" in text and "step 3/8" not in text
