from __future__ import annotations

import pytest

from cauto.solver.cost.reshard import backward_target, collective_cost_s, reshard, transform_steps

LINKS1 = ((1e-5, 1e9),)
LINKS2 = ((1e-5, 1e9), (2e-5, 5e8))


def ops(src, dst, mesh=(4,), links=LINKS1, nbytes=1 << 20):
    return [(c.op, c.axis, c.bytes) for c in reshard(tuple(src), tuple(dst), nbytes, mesh, links)]


@pytest.mark.parametrize("src,dst,expected", [
    (["S(0)"], ["R"], [("all_gather", 0, 1 << 20)]),
    (["P(sum)"], ["R"], [("all_reduce", 0, 1 << 20)]),
    (["P(sum)"], ["S(1)"], [("reduce_scatter", 0, 1 << 20)]),
    (["S(0)"], ["S(1)"], [("all_to_all", 0, 1 << 20)]),
    (["R"], ["S(0)"], []),
    (["R"], ["P(sum)"], []),
    (["S(0)"], ["P(sum)"], [("all_gather", 0, 1 << 20)]),
    (["R"], ["R"], []),
])
def test_one_axis_transitions(src, dst, expected):
    assert ops(src, dst) == expected


def test_two_axes_bytes_are_divided_by_other_axes_shards():
    # (S0, S1) -> (R, R): DTensor walks inner to outer first: axis 1 gathers a quarter... then axis 0
    got = ops(["S(0)", "S(1)"], ["R", "R"], mesh=(2, 2), links=LINKS2)
    assert got == [("all_gather", 1, 1 << 19), ("all_gather", 0, 1 << 20)]


def test_nested_shard_is_replicated_first():
    # (S0, S0) -> (R, S0): the inner shard of dim 0 sits under a different outer sharding
    steps = transform_steps(("S(0)", "S(0)"), ("R", "S(0)"), (2, 2))
    assert steps == [(1, "S(0)", "R"), (0, "S(0)", "R"), (1, "R", "S(0)")]
    assert [o for o, _, _ in ops(["S(0)", "S(0)"], ["R", "S(0)"], mesh=(2, 2), links=LINKS2)] == \
        ["all_gather", "all_gather"]


def test_partial_on_both_axes_to_shard_and_replicate():
    got = ops(["P(sum)", "P(sum)"], ["S(0)", "R"], mesh=(2, 2), links=LINKS2)
    assert got == [("reduce_scatter", 0, 1 << 20), ("all_reduce", 1, 1 << 19)]


def test_size_one_axis_issues_nothing():
    assert ops(["S(0)", "P(sum)"], ["R", "R"], mesh=(1, 4), links=LINKS2) == [("all_reduce", 1, 1 << 20)]


def test_alpha_beta_costs():
    b, n, a, bw = 1 << 20, 4, 1e-5, 1e9
    assert collective_cost_s("all_gather", b, n, a, bw) == pytest.approx(a + b * 3 / 4 / bw)
    assert collective_cost_s("reduce_scatter", b, n, a, bw) == pytest.approx(a + b * 3 / 4 / bw)
    assert collective_cost_s("all_reduce", b, n, a, bw) == pytest.approx(2 * (a + b * 3 / 4 / bw))
    assert collective_cost_s("all_to_all", b, n, a, bw) == pytest.approx(a + b * 3 / 16 / bw)
    assert collective_cost_s("all_reduce", b, 1, a, bw) == 0.0


def test_backward_target_turns_partial_source_into_replicate():
    assert backward_target(("R",), ("P(sum)",)) == ("R",)
    assert backward_target(("P(sum)",), ("P(sum)",)) == ("P(sum)",)
    assert backward_target(("P(sum)", "S(0)"), ("S(0)", "R")) == ("S(0)", "R")
