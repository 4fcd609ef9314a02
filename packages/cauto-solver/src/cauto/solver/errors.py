"""Errors of the solver, each saying what was wrong and what to do."""

from __future__ import annotations


class SolverError(ValueError):
    """The inputs cannot be planned (bad mesh, bad cluster spec, unsupported graph) or the solver failed."""


class InfeasibleBudgetError(SolverError):
    """No plan fits the memory budget.

    ``needed_bytes`` is the least per-device peak any plan reaches (the best plan's need) and
    ``top_tensors`` lists (name, bytes per device) of what dominates that plan's peak.
    """

    def __init__(self, budget_bytes: int, needed_bytes: int, top_tensors: list[tuple[str, int]]):
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        self.top_tensors = top_tensors
        tops = ", ".join(f"{name} {_mib(b)}" for name, b in top_tensors[:5])
        super().__init__(
            f"no plan fits {_mib(budget_bytes)} per device: the plan with the least memory needs "
            f"{_mib(needed_bytes)}; the peak is dominated by {tops}. Give more memory, a larger mesh, "
            "or a smaller batch"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
