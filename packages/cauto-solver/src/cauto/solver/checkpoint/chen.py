"""Chen et al. 2016 ("sublinear memory", the √n method): the baseline rotor must beat.

Walk the chain summing stage output sizes x_{i+1}; when the running sum exceeds a segment budget
B, keep a^{i+1} as a checkpoint and restart the sum. Every segment but the last runs forward
without recording and is recomputed once, fully recorded, when backward reaches it: in schedule
terms, ``Region(first, last, (Stored(first), ..., Stored(last)))``. The last segment (it holds the
loss) is stored.

B trades checkpoints (x, the bytes kept at segment ends) against segment size (y, the bytes one
recorded segment holds); Chen searches B on a grid around √(x·y). Here x = Σ x_i, y = max x̄_i,
and every grid point is judged by the simulator; the fastest schedule within the memory budget wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cauto.solver.checkpoint.chain import Chain
from cauto.solver.checkpoint.schedule import Region, Schedule, Stored, store_all, to_ops
from cauto.solver.checkpoint.simulate import Simulation, simulate

GRID_STEPS = 12
"""Grid points on each side of √(x·y), a factor 2^(1/4) apart (plus B = 0 and B = ∞)."""


def chen_schedule(chain: Chain, segment_bytes: float) -> Schedule:
    """Chen's two-level schedule for segment budget ``segment_bytes`` (∞: store everything)."""
    n = chain.num_stages
    ends: list[int] = []
    running = 0
    for i in range(n - 1):
        running += int(chain.x_bytes[i + 1])
        if running > segment_bytes:
            ends.append(i)
            running = 0
    items: list = []
    first = 0
    for last in ends:
        items.append(Region(first, last, tuple(Stored(k) for k in range(first, last + 1))))
        first = last + 1
    items.extend(Stored(k) for k in range(first, n))
    return tuple(items)


@dataclass(frozen=True)
class ChenPoint:
    """One grid point of the budget search."""

    segment_bytes: float
    schedule: Schedule
    simulation: Simulation


def chen_grid(chain: Chain, steps: int = GRID_STEPS) -> list[ChenPoint]:
    """Chen schedules for B on a geometric grid around √(x·y), plus B = 0 and B = ∞; distinct ones only."""
    x_total = float(chain.x_bytes[1:].sum())
    y = float(chain.xbar_bytes.max())
    center = math.sqrt(max(x_total * y, 1.0))
    budgets = [0.0] + [center * 2.0 ** (k / 4) for k in range(-steps, steps + 1)] + [math.inf]
    points: list[ChenPoint] = []
    seen: set[Schedule] = set()
    for b in budgets:
        sched = chen_schedule(chain, b) if math.isfinite(b) else store_all(chain.num_stages)
        if sched not in seen:
            seen.add(sched)
            points.append(ChenPoint(b, sched, simulate(chain, to_ops(sched))))
    return points


def solve_chen(chain: Chain, budget_bytes: int, steps: int = GRID_STEPS) -> ChenPoint | None:
    """The fastest Chen schedule whose simulated peak fits ``budget_bytes``; None if no grid point fits."""
    fitting = [p for p in chen_grid(chain, steps) if p.simulation.peak_bytes <= budget_bytes]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (p.simulation.time_s, p.simulation.peak_bytes))
