"""Fraction-done of a plan for a ``progress(phase, done, total)`` callback (the `cauto` command draws it).

``plan()`` / ``solve()`` report, in order, each phase rising from 0 to its total:

* ``"strategies"``: graph nodes whose sharding strategies are enumerated;
* ``"costs"``: graph nodes whose costs and memory terms are in the ILP's arrays;
* ``"ilp"``: 0/1 then 1/1: CBC and HiGHS tell no fraction, so the phase only starts and ends (the
  re-solves that fit the prediction to the budget, or find the least memory, are inside it);
* ``"checkpoint search"`` (``checkpoint`` other than "none"): the joint search's sharding solves,
  out of the most it may run; it ends at its total when the search ends, however many it ran.

Nothing is counted when no callback is given.
"""

from __future__ import annotations

from collections.abc import Callable

ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: called with ``done`` rising to ``total`` within each phase."""

CHECKPOINT_PHASE = "checkpoint search"


def joint_solves_at_most(grid_points: int = 8, ladder_points: int = 20, refine_steps: int = 4) -> int:
    """The most sharding solves ``joint.solve_joint`` runs with these settings (its defaults): one
    without a limit, the two baselines, the grid, the sharding ladder (joint.LADDER_MAX_POINTS) and
    the ILP's least-memory sharding (two solves), two fresh budgets per refinement step."""
    return 1 + 2 + grid_points + ladder_points + 2 + 2 * refine_steps


def counted(solve_sharding: Callable, progress: ProgressFn, total: int) -> Callable:
    """``solve_sharding`` reporting each call as one step of ``CHECKPOINT_PHASE`` (never reaching
    ``total``: the caller ends the phase)."""
    calls = 0
    progress(CHECKPOINT_PHASE, 0, total)

    def solve(budget):
        nonlocal calls
        result = solve_sharding(budget)
        calls += 1
        if calls < total:
            progress(CHECKPOINT_PHASE, calls, total)
        return result

    return solve
