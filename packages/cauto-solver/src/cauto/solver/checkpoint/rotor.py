"""Rotor: the optimal checkpoint schedule of a heterogeneous chain (Beaumont et al. 2019), in our words.

C(s, t, m) is the least time to run stages s..t forward and back to δ^s when a^s is stored outside
m, δ^{t+1} is live inside m, and the peak of what lives inside m stays ≤ m. With the buffer rules
of simulate.py (δ^{i+1} and δ^i are both live while B i runs), the two decisions for stage s are

* store s (``Stored(s)``): F_all s, then C(s+1, t, m − x̄_{s+1}), then B s. Feasible when
  m ≥ thr_store(s, t) = max(x_{t+1} + x̄_{s+1} + ftmp_s,  x_{s+1} + x̄_{s+1} + x_s + btmp_s);
  cost uf_s + ub_s + C(s+1, t, m − x̄_{s+1}) (just uf_s + ub_s when s = t).
* a region s..j−1, s < j ≤ t (``Region(s, j−1, ·)``): F_ck s, F_n s+1..j−1, then C(j, t, m − x_j),
  then C(s, j−1, m) (δ^j now inside m). Feasible when
  m ≥ thr_region(s, t, j) = x_{t+1} + max(x_{s+1} + ftmp_s, max_{s<k<j} (x_k + x_{k+1} + ftmp_k));
  cost Σ_{k=s}^{j−1} uf_k + C(j, t, m − x_j) + C(s, j−1, m).

These thresholds are exactly the peaks simulate.py measures for the ops they guard, so C(0, L, ·)
is the best over all nested schedules (tests check it against brute force). ALGORITHMS.md's single
base case C(i, i, m) reused inside "store s" would charge δ^{s+1} where δ^{t+1} is live: the split
thresholds above avoid that mismatch.

Memory is discretized into S slots of M/S bytes, every size rounded up, so the DP is conservative:
its schedules never exceed M in bytes. Tables T[s, t, m] (= C) and R[t, j, m] = C(j, t, m − x_j)
are filled by increasing t − s, vectorized with numpy over m and over j: O(S·L³) arithmetic,
O(S·L²) memory. No decision table is kept: backtracking recomputes, for the one cell it visits,
which branch gives the stored value (same float operations, so the comparison is exact).
``least_memory`` solves the same recurrences for the least feasible m, in exact bytes (no slots):
the minimum memory of any nested schedule; in slots it tells _fill where each row starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cauto.solver.checkpoint.chain import Chain
from cauto.solver.checkpoint.schedule import Region, Schedule, Stored

DEFAULT_SLOTS = 500


@dataclass(frozen=True)
class RotorSolution:
    """The DP's answer for one budget."""

    schedule: Schedule | None
    """None when no schedule fits."""
    time_s: float
    """Predicted step time of the chain (forward + backward + recompute); inf when infeasible."""
    budget_bytes: int
    slot_bytes: float
    """Bytes per memory slot (1.0 when the budget was small enough to solve exactly)."""

    @property
    def feasible(self) -> bool:
        """Whether some schedule fits the budget."""
        return self.schedule is not None


def _thresholds(x, xbar, ftmp, btmp):
    """Functions giving thr_store(s, t) and thr_region(s, t) (an array over j = s+1..t)."""
    g = x[:-1] + x[1:] + ftmp  # g[k] = x_k + x_{k+1} + ftmp_k

    def store(s: int, t: int) -> int:
        return int(max(x[t + 1] + xbar[s + 1] + ftmp[s], x[s + 1] + xbar[s + 1] + x[s] + btmp[s]))

    def region(s: int, t: int) -> np.ndarray:
        sweep = np.concatenate(([x[s + 1] + ftmp[s]], g[s + 1:t]))
        return x[t + 1] + np.maximum.accumulate(sweep)

    return store, region


def _to_slots(values: np.ndarray, slot_bytes: float, round_up: bool) -> np.ndarray:
    ratio = np.asarray(values, dtype=float) / slot_bytes
    return (np.ceil(ratio - 1e-9) if round_up else np.rint(ratio)).astype(np.int64)


class RotorTable:
    """The filled DP tables of a chain for a budget: ``best(m)`` and ``schedule(m)`` for any m ≤ S."""

    def __init__(self, chain: Chain, budget_bytes: int, slots: int = DEFAULT_SLOTS, round_up: bool = True):
        self.chain = chain
        self.budget_bytes = int(budget_bytes)
        usable = self.budget_bytes - chain.const_bytes - int(chain.x_bytes[0])
        if usable <= slots:
            self.slot_bytes = 1.0
            self.slots = max(usable, 0)
        else:
            self.slot_bytes = usable / slots
            self.slots = slots
        q = self.slot_bytes
        self.x = _to_slots(chain.x_bytes, q, round_up)
        self.xbar = _to_slots(chain.xbar_bytes, q, round_up)
        self.ftmp = _to_slots(chain.ftmp_bytes, q, round_up)
        self.btmp = _to_slots(chain.btmp_bytes, q, round_up)
        self._fill()

    def _fill(self) -> None:
        n, S = self.chain.num_stages, self.slots
        uf, ub = self.chain.fwd_s, self.chain.bwd_s
        x, xbar = self.x, self.xbar
        store, region = _thresholds(x, xbar, self.ftmp, self.btmp)
        cum_uf = np.concatenate(([0.0], np.cumsum(uf)))
        T = np.full((n, n, S + 1), np.inf)
        # R[t, j, m] = C(j, t, m − x_j) + Σ_{k<j} uf_k: the forward sweep's time is folded in here
        R = np.full((n, n, S + 1), np.inf)
        # lo[s, t]: the least m with C(s, t, m) finite; rows are computed from lo on, and a region's
        # threshold is applied only where it binds
        lo, _ = _least_table(x, xbar, self.ftmp, self.btmp)
        buf = np.empty((n, S + 1))

        def put(s, t, row):
            T[s, t] = row
            shift = int(x[s])
            if shift <= S:
                np.add(row[:S + 1 - shift], cum_uf[s], out=R[t, s, shift:])

        for i in range(n):
            row = np.full(S + 1, np.inf)
            if lo[i, i] <= S:
                row[lo[i, i]:] = uf[i] + ub[i]
            put(i, i, row)
        for d in range(1, n):
            for s in range(n - d):
                t = s + d
                thr, keep = store(s, t), int(xbar[s + 1])
                thr_j = region(s, t)
                sub_lo = np.maximum(lo[s, s:t], x[s + 1:t + 1] + lo[s + 1:t + 1, t])
                lo_store = max(thr, keep + int(lo[s + 1, t]))
                first = int(lo[s, t])
                row = np.full(S + 1, np.inf)
                if first <= S:
                    cand = np.add(R[t, s + 1:t + 1, first:], T[s, s:t, first:], out=buf[:d, :S + 1 - first])
                    for r in np.flatnonzero(thr_j > np.maximum(sub_lo, first)).tolist():
                        cand[r, :thr_j[r] - first] = np.inf
                    row[first:] = cand.min(axis=0) - cum_uf[s]
                    if lo_store <= S:
                        np.minimum(row[lo_store:], uf[s] + ub[s] + T[s + 1, t, lo_store - keep:S + 1 - keep],
                                   out=row[lo_store:])
                put(s, t, row)
        self._T, self._R, self._cum_uf = T, R, cum_uf
        self._store, self._region = store, region

    def best(self, m: int | None = None) -> float:
        """C(0, L, m) in seconds (m defaults to all slots); inf when infeasible."""
        m = self.slots if m is None else m
        return float(self._T[0, self.chain.num_stages - 1, m])

    def schedule(self, m: int | None = None) -> Schedule | None:
        """The optimal schedule at m slots (default all), rebuilt by backtracking; None if infeasible."""
        m = self.slots if m is None else m
        if not np.isfinite(self.best(m)):
            return None
        return self._level(0, self.chain.num_stages - 1, m)

    def _decision(self, s: int, t: int, m: int) -> int:
        """Which branch gives C(s, t, m): s for "store s", else j for the region s..j−1.

        Recomputed with the same float operations as _fill, so equality is exact; ties go to
        "store", then to the smallest j (fewer recomputed stages first).
        """
        T, R, uf, ub = self._T, self._R, self.chain.fwd_s, self.chain.bwd_s
        value = T[s, t, m]
        if s == t:
            return s
        keep = int(self.xbar[s + 1])
        if m >= self._store(s, t) and uf[s] + ub[s] + T[s + 1, t, m - keep] == value:
            return s
        for r, thr in enumerate(self._region(s, t).tolist()):
            j = s + 1 + r
            if m >= thr and (R[t, j, m] + T[s, j - 1, m]) - self._cum_uf[s] == value:
                return j
        raise AssertionError(f"rotor backtrack found no branch for cell ({s}, {t}, {m})")

    def _level(self, s: int, t: int, m: int) -> Schedule:
        items: list = []
        while True:
            c = self._decision(s, t, m)
            if c == s:
                items.append(Stored(s))
                if s == t:
                    return tuple(items)
                m -= int(self.xbar[s + 1])
                s += 1
            else:
                items.append(Region(s, c - 1, self._level(s, c - 1, m)))
                m -= int(self.x[c])
                s = c


def solve_rotor(chain: Chain, budget_bytes: int, *, slots: int = DEFAULT_SLOTS,
                round_up: bool = True) -> RotorSolution:
    """The fastest nested checkpoint schedule whose peak (const_bytes and a^0 included) fits the budget.

    With ``round_up`` (the default) every size is rounded up to whole slots and the answer is
    guaranteed to fit. Rounded to the nearest slot, the DP may also propose schedules that do
    not fit: simulate before use (api.choose_schedule does, and keeps the better of the two).
    """
    table = RotorTable(chain, budget_bytes, slots, round_up)
    if table.budget_bytes - chain.const_bytes - int(chain.x_bytes[0]) < 0:
        return RotorSolution(None, float("inf"), table.budget_bytes, table.slot_bytes)
    return RotorSolution(table.schedule(), table.best(), table.budget_bytes, table.slot_bytes)


@dataclass(frozen=True)
class LeastMemory:
    """The least peak any nested schedule reaches, and one schedule reaching it."""

    peak_bytes: int
    schedule: Schedule


def _least_table(x, xbar, ftmp, btmp) -> tuple[np.ndarray, np.ndarray]:
    """need[s, t], the least m with C(s, t, m) finite, and the branch reaching it (s: store, j: region).

    The same recurrences as C on thresholds alone: store s needs max(thr_store, x̄_{s+1} + need[s+1, t]),
    the region s..j−1 needs max(thr_region_j, x_j + need[j, t], need[s, j−1]).
    """
    n = len(ftmp)
    store, region = _thresholds(x, xbar, ftmp, btmp)
    need = np.zeros((n, n), dtype=np.int64)
    pick = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        need[i, i], pick[i, i] = store(i, i), i
    for d in range(1, n):
        for s in range(n - d):
            t = s + d
            keep = max(store(s, t), int(xbar[s + 1] + need[s + 1, t]))
            cand = np.maximum(np.maximum(region(s, t), x[s + 1:t + 1] + need[s + 1:t + 1, t]), need[s, s:t])
            k = int(np.argmin(cand))
            if cand[k] < keep:
                need[s, t], pick[s, t] = cand[k], s + 1 + k
            else:
                need[s, t], pick[s, t] = keep, s
    return need, pick


def least_memory(chain: Chain) -> LeastMemory:
    """Exact least feasible memory (bytes, const_bytes and a^0 included) with a schedule reaching it."""
    n = chain.num_stages
    need, pick = _least_table(chain.x_bytes.astype(np.int64), chain.xbar_bytes.astype(np.int64),
                              chain.ftmp_bytes.astype(np.int64), chain.btmp_bytes.astype(np.int64))

    def level(s: int, t: int) -> Schedule:
        items: list = []
        while True:
            c = int(pick[s, t])
            if c == s:
                items.append(Stored(s))
                if s == t:
                    return tuple(items)
                s += 1
            else:
                items.append(Region(s, c - 1, level(s, c - 1)))
                s = c

    base = chain.const_bytes + int(chain.x_bytes[0])
    return LeastMemory(peak_bytes=base + int(need[0, n - 1]), schedule=level(0, n - 1))
