"""The sharding ILP (Alpa §4 in our words), built with PuLP and solved by CBC or HiGHS.

The coefficients come from strategies/groups.py (``Problem``: nodes mapped onto variables, with
costs from cost/model.py and memory terms from memory/model.py); this module writes them into one
mixed-integer program. Each part below names the function that adds it.

Variables
    x[v, p] ∈ {0,1}       option p of variable v                                 ``_choice_variables``
    e[a, b, r, s] ∈ [0,1]  option pair of variables a < b joined by an edge whose cost is not
                          separable (``Problem.pair_cost``), per class r of a's options and class s of
                          b's (options whose cost and memory rows are identical share a class, so
                          125x125 pairs on 3-D meshes shrink to a few hundred entries)  ``_pair_variables``
    c_k ≥ 0               activation bytes saved up to the k-th memory check point     ``_memory_rows``
    peak ≥ 0              only with ``minimize_peak``: the memory limit M, minimized      ``build``
Constraints
    one_v       Σ_p x[v, p] = 1                                  one option per variable
                                                                                        ``_choice_variables``
    row_a_b_r   Σ_s e[a, b, r, s] = Σ_{p in class r} x[a, p]     e is the outer product of two one-hots
    col_a_b_s   Σ_r e[a, b, r, s] = Σ_{q in class s} x[b, q]     (exact for one-hot x, which also makes
                                                                 e integral: e is continuous)
                                                                                        ``_pair_variables``
    With a memory limit M (``memory_budget`` bytes, or ``peak``), all in MiB, where
    S = Σ_(placeholders) state · x (parameters with optimizer state, inputs, buffers):  ``_memory_rows``
    cum_k       c_k = c_{k−1} + Σ_{ops i in (t_{k−1}, t_k]} (saved_i · x + gathered_i · e)
                (cumulative saved bytes; gathered: parameter copies an op saves after an
                all-gather, a function of the pair)
    mem_k       S + c_k + transient_{t_k} · x ≤ M                at every check point t_k (Alpa's
                                                                 per-step peak)
    mem_state   S ≤ M                                            when there is no check point
    mem_backward_i  S + c_last + backward_extra_n · x ≤ M        per node n whose backward adds bytes
                                                                 (memory.backward_extra_bytes)
    mem_grads   S + Σ_params 2 · grad · x ≤ M                    end of backward: gradients and their
                                                                 synchronized copies
    Check points t_k are the op steps with a transient term and the last op step; with saved bytes
    never decreasing, the other steps cannot hold the peak. Without M the memory rows are left out.
Objective                                                                               ``build``
    min Σ_v node_cost[v] · x[v] + Σ_(a,b) pair_cost[a, b] · e[a, b]     (seconds, handed to the
    solver in microseconds with a relative gap of 1e-9, so that differences of well under a
    microsecond still decide), or with ``minimize_peak`` (an infeasible budget) min peak.

``solve_ilp`` solves the model with one thread and a fixed seed (``_solver``: same inputs, same
plan); a solve the time limit cut short reports its gap (``_gap``: HiGHS's own, or for CBC the LP
relaxation's bound, the same model built with ``relax``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import pulp

from cauto.plan.options import SOLVERS
from cauto.solver.errors import SolverError
from cauto.solver.strategies.groups import Problem


@dataclass
class IlpResult:
    """What the solver returned: one option per variable, status and numbers for the plan."""

    choice: list[int]
    status: str
    objective: float
    gap: float | None
    time_s: float
    num_variables: int
    num_constraints: int
    feasible: bool


#: objective scale handed to the solver: microseconds
SCALE = 1e6
#: memory rows are handed to the solver in MiB: byte-sized coefficients (1e9 next to the c variables'
#: 1) made HiGHS's presolve call feasible models infeasible
MEM_SCALE = 2.0 ** -20
GAP_REL = 1e-9


def _solver(name: str, time_limit_s: float):
    if name == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=1, gapRel=GAP_REL,
                                 options=["randomSeed 42"])
    if name == "highs":
        solver = pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1, gapRel=GAP_REL, random_seed=42)
        if not solver.available():
            raise SolverError("HiGHS is not available: pip install highspy (or use solver='cbc')")
        return solver
    raise SolverError(f"unknown solver {name!r}; use one of {SOLVERS}")


def _dot(coef: np.ndarray, xs: list) -> list:
    return [(xs[i], float(c)) for i, c in enumerate(coef) if c != 0.0]


def _expr(terms: list) -> pulp.LpAffineExpression:
    """A sum of (variable, coefficient) terms; repeated variables add up (LpAffineExpression keeps the last)."""
    acc: dict = {}
    for var, coef in terms:
        acc[var] = acc.get(var, 0.0) + coef
    return pulp.LpAffineExpression(list(acc.items()))


def build(problem: Problem, memory_budget: int | None, *, minimize_peak: bool = False, relax: bool = False):
    """The PuLP model of ``problem`` (module docstring); returns (model, x variables)."""
    prob = pulp.LpProblem("cauto_sharding", pulp.LpMinimize)
    x = _choice_variables(prob, problem, pulp.LpContinuous if relax else pulp.LpBinary)
    objective = []
    for v, xs in enumerate(x):
        objective += _dot(problem.node_cost[v] * SCALE, xs)
    pair_e = _pair_variables(prob, problem, x, objective)
    peak = None
    if memory_budget is not None or minimize_peak:
        peak = pulp.LpVariable("peak", 0) if minimize_peak else None
        _memory_rows(prob, problem, x, pair_e, peak if minimize_peak else float(memory_budget) * MEM_SCALE)
    if minimize_peak:
        prob.setObjective(pulp.LpAffineExpression([(peak, 1.0)]))
    else:
        prob.setObjective(_expr(objective))
    return prob, x


def _choice_variables(prob: pulp.LpProblem, problem: Problem, cat: str) -> list[list]:
    """x[v][p], with the row ``one_v`` choosing one option per variable."""
    x = [[pulp.LpVariable(f"x_{v}_{p}", 0, 1, cat) for p in range(n)] for v, n in enumerate(problem.var_sizes)]
    for v, xs in enumerate(x):
        prob += pulp.lpSum(xs) == 1, f"one_{v}"
    return x


def _pair_variables(prob: pulp.LpProblem, problem: Problem, x: list[list],
                    objective: list) -> dict[tuple[int, int], tuple[list, np.ndarray, np.ndarray]]:
    """e of every pair with a cost matrix, with its transport rows; adds the pair costs to ``objective``.
    Returns (a, b) -> (e[r][s], the first option of each class of a's, the first of each class of b's)."""
    pair_e: dict[tuple[int, int], tuple[list, np.ndarray, np.ndarray]] = {}
    for (a, b), m in sorted(problem.pair_cost.items()):
        mats = [m, *problem.pair_mem.get((a, b), [])]
        _, row_of = np.unique(np.hstack(mats), axis=0, return_inverse=True)
        row_of = row_of.reshape(-1)
        first_row = [int(np.flatnonzero(row_of == i)[0]) for i in range(row_of.max() + 1)]
        _, col_of = np.unique(np.vstack([mm[first_row] for mm in mats]), axis=1, return_inverse=True)
        col_of = col_of.reshape(-1)
        first_col = [int(np.flatnonzero(col_of == j)[0]) for j in range(col_of.max() + 1)]
        reduced = m[np.ix_(first_row, first_col)]
        na, nb = reduced.shape
        e = [[pulp.LpVariable(f"e_{a}_{b}_{i}_{j}", 0, 1) for j in range(nb)] for i in range(na)]
        for i in range(na):
            members = [x[a][p] for p in np.flatnonzero(row_of == i)]
            prob += pulp.lpSum(e[i]) == pulp.lpSum(members), f"row_{a}_{b}_{i}"
        for j in range(nb):
            members = [x[b][q] for q in np.flatnonzero(col_of == j)]
            prob += pulp.lpSum(e[i][j] for i in range(na)) == pulp.lpSum(members), f"col_{a}_{b}_{j}"
        objective += [(e[i][j], float(reduced[i, j]) * SCALE) for i in range(na) for j in range(nb)
                      if reduced[i, j] != 0.0]
        pair_e[(a, b)] = (e, np.array(first_row), np.array(first_col))
    return pair_e


def _memory_rows(prob: pulp.LpProblem, problem: Problem, x: list[list],
                 pair_e: dict[tuple[int, int], tuple[list, np.ndarray, np.ndarray]], limit) -> None:
    """The memory rows cum_k, mem_k (or mem_state), mem_backward_i and mem_grads under ``limit`` (MiB,
    or the peak variable)."""
    state = _expr([t for v, coef in problem.state_terms for t in _dot(coef * MEM_SCALE, x[v])])
    prev = None
    pending: list = []
    last = len(problem.step_terms) - 1
    for t, step in enumerate(problem.step_terms):
        tv, trans = step.transient
        for sv, saved in step.saved:
            pending += _dot(saved * MEM_SCALE, x[sv])
        for a, b, i in step.pair_saved:
            e, rows, cols = pair_e[(a, b)]
            mem = problem.pair_mem[(a, b)][i][np.ix_(rows, cols)]
            pending += [(e[r][c], float(mem[r, c]) * MEM_SCALE) for r, c in zip(*np.nonzero(mem))]
        if not trans.any() and t != last:
            continue
        c = pulp.LpVariable(f"c_{t}", 0)
        prob += c == _expr(pending) + (prev if prev is not None else 0), f"cum_{t}"
        prob += state + c + _expr(_dot(trans * MEM_SCALE, x[tv])) <= limit, f"mem_{t}"
        prev, pending = c, []
    if prev is None:
        prob += state <= limit, "mem_state"
    if prev is not None:  # one check per node whose backward adds bytes (memory.backward_extra_bytes)
        for i, (v, coef) in enumerate(problem.backward_terms):
            prob += state + prev + _expr(_dot(coef * MEM_SCALE, x[v])) <= limit, f"mem_backward_{i}"
    if problem.grad_terms:
        grads = _expr([t for v, coef in problem.grad_terms for t in _dot(coef * MEM_SCALE, x[v])])
        prob += state + grads <= limit, "mem_grads"


@contextlib.contextmanager
def _quiet_stdout():
    """Silence the C-level banner highspy prints on stdout whatever its options say."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real file descriptor 1 (embedded interpreters)
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def _run(prob, backend) -> None:
    with _quiet_stdout() if isinstance(backend, pulp.HiGHS) else contextlib.nullcontext():
        prob.solve(backend)


def _read_choice(x) -> list[int]:
    return [int(np.argmax([v.varValue or 0.0 for v in xs])) for xs in x]


def _gap(prob, problem: Problem, memory_budget, minimize_peak: bool, solver: str, time_limit_s: float,
         objective: float) -> float | None:
    """Relative gap of a solution the time limit cut short: HiGHS reports it; for CBC the LP relaxation
    (solved under the same time limit) bounds it. None when no bound is known."""
    model = getattr(prob, "solverModel", None)
    if solver == "highs" and model is not None:
        gap = float(model.getInfo().mip_gap)
        return gap if np.isfinite(gap) else None
    relaxed, _ = build(problem, memory_budget, minimize_peak=minimize_peak, relax=True)
    _run(relaxed, _solver(solver, time_limit_s))
    if relaxed.sol_status != pulp.LpSolutionOptimal:
        return None
    bound = float(pulp.value(relaxed.objective) or 0.0) / (MEM_SCALE if minimize_peak else SCALE)
    return max(0.0, (objective - bound) / objective) if objective > 0 else 0.0


def solve_ilp(problem: Problem, memory_budget: int | None, *, solver: str = "cbc", time_limit_s: float = 60.0,
              minimize_peak: bool = False) -> IlpResult:
    """Solve the model; ``feasible`` is False when no assignment fits ``memory_budget``."""
    start = time.perf_counter()
    prob, x = build(problem, memory_budget, minimize_peak=minimize_peak)
    _run(prob, _solver(solver, time_limit_s))
    elapsed = time.perf_counter() - start
    nvars, ncons = prob.numVariables(), prob.numConstraints()
    status = pulp.LpStatus.get(prob.status, "Undefined")
    if status == "Infeasible" or (prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)):
        if status in ("Infeasible", "Undefined") or prob.sol_status == pulp.LpSolutionInfeasible:
            return IlpResult([], "infeasible", float("nan"), None, elapsed, nvars, ncons, False)
        raise SolverError(f"{solver} returned status {status!r} (solution status {prob.sol_status}); "
                          f"raise the time limit ({time_limit_s} s) or try the other solver")
    choice = _read_choice(x)
    objective = float(pulp.value(prob.objective) or 0.0) / (MEM_SCALE if minimize_peak else SCALE)
    if prob.sol_status == pulp.LpSolutionOptimal:
        return IlpResult(choice, "optimal", objective, 0.0, elapsed, nvars, ncons, True)
    gap = _gap(prob, problem, memory_budget, minimize_peak, solver, time_limit_s, objective)
    return IlpResult(choice, "time_limit", objective, gap, time.perf_counter() - start, nvars, ncons, True)
