"""Rotor's DP against the simulator and against brute force over every nested schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cauto.solver.checkpoint.chain import Chain
from cauto.solver.checkpoint.rotor import RotorTable, least_memory, solve_rotor
from cauto.solver.checkpoint.schedule import Region, Stored, regions_of, stages_of, store_all, to_ops
from cauto.solver.checkpoint.simulate import ScheduleError, simulate
from cauto.solver.checkpoint.synthetic import random_chain


def small_chain(rng: np.random.Generator, n: int, spiky: bool = False) -> Chain:
    """Integer sizes of a few bytes: budgets stay under the slot count, so the DP is exact.

    ``spiky`` chains mix tiny and large tensors and forward temporaries, with x̄ mostly equal to x:
    then each threshold of the DP (the first forward of a region with δ^{t+1} live, say) is the one
    that sets the peak of some schedule, and a wrong term shows up against brute force.
    """
    if not spiky:
        x = rng.integers(1, 9, n + 1)
        xbar = np.concatenate(([0], x[1:] + rng.integers(0, 12, n)))
        ftmp, btmp = rng.integers(0, 5, n), rng.integers(0, 5, n)
    else:
        x = rng.choice([1, 2, 30, 50], n + 1)
        xbar = np.concatenate(([0], x[1:] + rng.choice([0, 0, 0, 20], n)))
        ftmp, btmp = rng.choice([0, 5, 80], n), rng.choice([0, 3], n)
    return Chain.from_lists(rng.uniform(1, 5, n), rng.uniform(1, 9, n), x, xbar, ftmp, btmp)


def all_levels(s: int, t: int):
    """Every nested schedule of stages s..t (the family rotor optimizes over), built without any costs."""
    if s == t:
        yield (Stored(s),)
        return
    for rest in all_levels(s + 1, t):
        yield (Stored(s), *rest)
    for j in range(s + 1, t + 1):
        for inner in all_levels(s, j - 1):
            for rest in all_levels(j, t):
                yield (Region(s, j - 1, inner), *rest)


def test_enumeration_counts_and_validity():
    rng = np.random.default_rng(1)
    chain = small_chain(rng, 4)
    schedules = list(all_levels(0, 3))
    assert len(schedules) == len(set(schedules)) == 22  # T(n) = T(n−1) + Σ_j T(j)·T(n−j)
    for sched in schedules:
        sim = simulate(chain, to_ops(sched))
        assert stages_of(sched) == [0, 1, 2, 3]
        assert sim.forward_counts == tuple(1 + sum(r.first <= k <= r.last for r in regions_of(sched))
                                           for k in range(4))


@pytest.mark.parametrize("seed", range(24))
def test_dp_equals_brute_force_at_every_budget(seed):
    rng = np.random.default_rng(seed)
    n = 6 if seed % 2 else 5  # L = 5 and L = 4
    chain = small_chain(rng, n, spiky=seed >= 4)
    sims = [simulate(chain, to_ops(s)) for s in all_levels(0, n - 1)]
    least = min(s.peak_bytes for s in sims)
    full = simulate(chain, to_ops(store_all(n))).peak_bytes
    assert least_memory(chain).peak_bytes == least
    table = RotorTable(chain, full + 3, slots=10_000)  # one slot per byte: C(0, L, m) for every budget
    assert table.slot_bytes == 1.0
    base = int(chain.x_bytes[0]) + chain.const_bytes
    for m in range(table.slots + 1):
        budget = base + m
        brute = min((s.time_s for s in sims if s.peak_bytes <= budget), default=math.inf)
        assert table.best(m) == pytest.approx(brute, rel=1e-12), f"budget {budget}"
        sched = table.schedule(m)
        assert (sched is None) == (budget < least)
        if sched is not None:
            sim = simulate(chain, to_ops(sched))
            assert sim.time_s == pytest.approx(table.best(m), rel=1e-12)
            assert sim.peak_bytes <= budget
    assert solve_rotor(chain, least).feasible and not solve_rotor(chain, least - 1).feasible


@pytest.mark.parametrize("seed", range(5))
def test_dp_time_is_simulated_time_and_peak_fits_with_slots(seed):
    rng = np.random.default_rng(100 + seed)
    chain = random_chain(rng, int(rng.integers(8, 40)))
    least = least_memory(chain).peak_bytes
    full = simulate(chain, to_ops(store_all(chain.num_stages))).peak_bytes
    for frac in (0.05, 0.2, 0.5, 0.8, 1.0):
        budget = int(least * 1.15 + frac * (full - least * 1.15))
        sol = solve_rotor(chain, budget, slots=300)
        assert sol.slot_bytes > 1.0
        assert sol.feasible
        sim = simulate(chain, to_ops(sol.schedule))
        assert sim.time_s == pytest.approx(sol.time_s, rel=1e-9)
        assert sim.peak_bytes <= budget


def test_more_memory_never_slower_and_ample_memory_stores_everything():
    rng = np.random.default_rng(7)
    chain = small_chain(rng, 12)
    full = simulate(chain, to_ops(store_all(12)))
    table = RotorTable(chain, full.peak_bytes, slots=10_000)
    times = [table.best(m) for m in range(table.slots + 1)]
    finite = [t for t in times if math.isfinite(t)]
    assert finite == sorted(finite, reverse=True)
    assert table.schedule() == store_all(12)
    assert table.best() == pytest.approx(full.time_s)


def test_tight_budget_nests_regions_and_least_memory_schedule_reaches_its_peak():
    rng = np.random.default_rng(3)
    chain = random_chain(rng, 30, uniform=True)
    least = least_memory(chain)
    assert simulate(chain, to_ops(least.schedule)).peak_bytes == least.peak_bytes
    assert any(isinstance(i, Region) for r in regions_of(least.schedule) for i in r.inner)
    assert not solve_rotor(chain, least.peak_bytes - 1).feasible


def test_simulator_rejects_invalid_sequences():
    chain = small_chain(np.random.default_rng(0), 3)
    ops = to_ops(store_all(3))
    with pytest.raises(ScheduleError, match="not live"):
        simulate(chain, ops[1:])
    with pytest.raises(ScheduleError, match="expected only"):
        simulate(chain, ops[:-1])
    with pytest.raises(ValueError, match="inner level covers"):
        Region(0, 2, (Stored(0), Stored(1)))


def test_chain_validation_messages():
    with pytest.raises(ValueError, match="less than its output"):
        Chain.from_lists([1.0, 1.0], [1.0, 1.0], [1, 5, 1], [4, 1])
    with pytest.raises(ValueError, match="x_bytes has 2 entries"):
        Chain.from_lists([1.0, 1.0], [1.0, 1.0], [1, 5], [6, 1])
