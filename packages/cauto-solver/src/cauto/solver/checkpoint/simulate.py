"""The judge of every schedule: run an op sequence over a chain, tracking live buffers.

Buffers: a^i (x_i bytes, a stage input standing alone), ā^i (x̄_i, all that stage i−1 keeps when
recorded; it contains a^i), δ^i (x_i). At the start a^0 and δ^{L+1} (the loss gradient) are live;
at the end exactly δ^0 is. The rules (the memory model rotor's DP in rotor.py must match):

* ``F_ck i``: needs a^i (alone or inside ā^i); while it runs, x_{i+1} + ftmp_i more bytes are live;
  then a^{i+1} is live.
* ``F_n i``: as ``F_ck``, then the lone a^i is dropped.
* ``F_all i``: needs a^i; while it runs, x̄_{i+1} + ftmp_i more bytes; then ā^{i+1} is live.
* ``B i``: needs ā^{i+1}, δ^{i+1} and a^i; while it runs, x_i + btmp_i more bytes (δ^i being written);
  then ā^{i+1} and δ^{i+1} are freed, δ^i is live and a lone a^i is dropped (a^i inside ā^i stays
  until ``B i−1``).

(One of the two public copies of rotor counts δ^{i+1} in the base case and the other δ^i; here both
are live while B i runs, which is what autograd does.) Time is Σ uf over forward ops plus Σ ub over
backward ops. The chain's ``const_bytes`` are live throughout and included in the peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from cauto.solver.checkpoint.chain import Chain
from cauto.solver.checkpoint.schedule import BWD, F_ALL, F_CK, F_N, Op


class ScheduleError(ValueError):
    """An op sequence that cannot run on its chain (a missing input, a leftover buffer)."""


@dataclass(frozen=True)
class Simulation:
    """What one run of an op sequence costs."""

    time_s: float
    """Σ uf of forward ops + Σ ub of backward ops."""
    peak_bytes: int
    """Most bytes live at once (const_bytes included)."""
    forward_counts: tuple[int, ...]
    """How many times each stage ran forward (1 = never recomputed)."""

    def recompute_s(self, chain: Chain) -> float:
        """Time spent on forward recomputation."""
        return self.time_s - chain.compute_s


def simulate(chain: Chain, ops: list[Op]) -> Simulation:
    """Run ``ops`` on ``chain``; raise ScheduleError when the sequence is not a valid training step."""
    n = chain.num_stages
    x, xbar = chain.x_bytes, chain.xbar_bytes
    live: dict[tuple[str, int], int] = {("a", 0): int(x[0]), ("d", n): int(x[n])}
    current = int(x[0]) + int(x[n]) + chain.const_bytes
    peak = current
    time_s = 0.0
    counts = [0] * n

    def need(key, where):
        if key not in live:
            raise ScheduleError(f"{where}: {_name(key)} is not live")

    def has_input(i, where):
        if ("a", i) not in live and ("abar", i) not in live:
            raise ScheduleError(f"{where}: a^{i} is not live")

    def add(key, size, where):
        nonlocal current
        if key in live:
            raise ScheduleError(f"{where}: {_name(key)} is already live")
        live[key] = size
        current += size

    def drop(key):
        nonlocal current
        current -= live.pop(key)

    for step, (op, i) in enumerate(ops):
        where = f"op {step} ({op} {i})"
        if not 0 <= i < n:
            raise ScheduleError(f"{where}: stage out of range 0..{n - 1}")
        if op in (F_CK, F_N, F_ALL):
            has_input(i, where)
            if ("a", i + 1) in live or ("abar", i + 1) in live:
                raise ScheduleError(f"{where}: a^{i + 1} is already live")
            out = int(xbar[i + 1]) if op == F_ALL else int(x[i + 1])
            peak = max(peak, current + out + int(chain.ftmp_bytes[i]))
            add(("abar" if op == F_ALL else "a", i + 1), out, where)
            if op == F_N and ("a", i) in live:
                drop(("a", i))
            time_s += float(chain.fwd_s[i])
            counts[i] += 1
        elif op == BWD:
            need(("abar", i + 1), where)
            need(("d", i + 1), where)
            has_input(i, where)
            peak = max(peak, current + int(x[i]) + int(chain.btmp_bytes[i]))
            drop(("abar", i + 1))
            drop(("d", i + 1))
            add(("d", i), int(x[i]), where)
            if ("a", i) in live:
                drop(("a", i))
            time_s += float(chain.bwd_s[i])
        else:
            raise ScheduleError(f"op {step}: unknown op {op!r}")
    if set(live) != {("d", 0)}:
        left = ", ".join(sorted(_name(k) for k in live))
        raise ScheduleError(f"after the last op the live buffers are {{{left}}}, expected only δ^0")
    return Simulation(time_s=time_s, peak_bytes=peak, forward_counts=tuple(counts))


def _name(key: tuple[str, int]) -> str:
    kind, i = key
    return {"a": "a", "abar": "ā", "d": "δ"}[kind] + f"^{i}"
