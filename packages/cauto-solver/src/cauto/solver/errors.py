"""Errors of the solver, each saying what was wrong and what to do."""

from __future__ import annotations

from cauto.plan.units import format_bytes


class SolverError(ValueError):
    """The inputs cannot be planned (bad mesh, bad cluster spec, unsupported graph) or the solver failed."""


class InfeasibleBudgetError(SolverError):
    """No plan fits the memory budget.

    ``needed_bytes`` is the least per-device peak of the plans the search evaluated (a plan it really
    reaches: solve again with that budget and it fits) and ``top_tensors`` lists (name, bytes per
    device) of what dominates that plan's peak. ``reason``
    replaces the message where memory is not what fails.
    """

    def __init__(self, budget_bytes: int, needed_bytes: int, top_tensors: list[tuple[str, int]],
                 reason: str | None = None, hint: str | None = None):
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        self.top_tensors = top_tensors
        self.reason = reason
        if reason is not None:  # memory is not what fails (e.g. the plan the runtime needs does not exist)
            super().__init__(reason)
            return
        digits = _digits(budget_bytes, needed_bytes)
        tops = ", ".join(f"{name} {_mib(b, digits)}" for name, b in top_tensors[:5])
        dominated = f"; the peak is dominated by {tops}" if tops else ""
        super().__init__(
            f"no plan fits {_mib(budget_bytes, digits)} per device: the least-memory plan the search finds needs "
            f"{_mib(needed_bytes, digits)} ({needed_bytes} bytes){dominated}. Give more memory, a larger mesh, "
            "or a smaller batch" + (f"; or {hint}" if hint else "")
        )

    def with_hint(self, hint: str) -> InfeasibleBudgetError:
        """The same error with one more thing to try at the end of its message (not where ``reason`` replaced it)."""
        if self.reason is not None:
            return self
        return InfeasibleBudgetError(self.budget_bytes, self.needed_bytes, self.top_tensors, hint=hint)


def _digits(budget_bytes: int, needed_bytes: int) -> int:
    """Decimals of MiB that tell the budget and the need apart (2 to 4)."""
    for digits in range(2, 5):
        if _mib(budget_bytes, digits) != _mib(needed_bytes, digits):
            return digits
    return 4


def _mib(n: int, digits: int = 1) -> str:
    return format_bytes(n, digits=digits, unit="MiB")
