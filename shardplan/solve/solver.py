"""The ILP: one option per node, minimising compute + collectives, under a per-device memory budget.

Solved with OR-Tools CP-SAT. Each node has one boolean per option (exactly one true); each pair of
nodes with a cost table gets a boolean per pair of options, tied to both nodes' choices (Alpa's
edge formulation); every memory checkpoint is a linear constraint. Costs are integers in units of
``TIME_UNIT`` seconds, memory in units chosen so the budget fits comfortably in 64 bits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time

import numpy as np
from ortools.sat.python import cp_model

from shardplan.ir.problem import Problem

TIME_UNIT = 1e-10   # seconds per objective unit: 0.1 ns keeps microsecond costs distinct


@dataclasses.dataclass(frozen=True)
class SolverStats:
    status: str
    objective: float          # seconds
    bound: float              # seconds, a lower bound on the optimum
    gap: float                # (objective - bound) / objective
    wall_time: float          # seconds
    num_variables: int
    num_constraints: int
    memory_bound: bool = False  # the budget shaped the plan: the unconstrained optimum does not fit


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: list[int]         # option index per node
    stats: SolverStats
    peak_memory: float        # bytes per device at the fullest checkpoint


def _int(values: np.ndarray, unit: float) -> list[int]:
    return [int(round(v / unit)) for v in values]


def solve(problem: Problem, *, budget_bytes: float | None, time_limit: float = 30.0,
          minimize_memory: bool = False, workers: int = 2,
          relative_gap: float = 0.0, hint: list[int] | None = None, status_line=None) -> Solution | None:
    """Solve; ``None`` when no assignment fits ``budget_bytes``.

    With ``minimize_memory`` the objective is the peak memory instead (used to report the
    smallest budget that works).
    """
    start = time.perf_counter()
    model = cp_model.CpModel()
    x = []
    for n, node in enumerate(problem.nodes):
        vs = [model.NewBoolVar(f"n{n}_{i}") for i in range(len(node.options))]
        model.AddExactlyOne(vs)
        x.append(vs)
    objective = []
    products = []      # (node a, node b, product booleans) of each full edge table
    for n, node in enumerate(problem.nodes):
        lo = float(node.cost.min())
        for v, c in zip(x[n], _int(node.cost - lo, TIME_UNIT)):
            if c:
                objective.append(c * v)
    offset = sum(float(node.cost.min()) for node in problem.nodes)
    # Minimising memory needs no cost terms: leave the edge variables out of that model.
    for (a, b), table in ([] if minimize_memory else problem.edges.items()):
        lo = float(table.min())
        offset += lo
        table = table - lo
        if not table.any():
            continue
        # Split off the parts that depend on one side only; the rest needs product variables.
        row = table.min(axis=1)
        col = (table - row[:, None]).min(axis=0)
        rest = table - row[:, None] - col[None, :]
        for v, c in zip(x[a], _int(row, TIME_UNIT)):
            if c:
                objective.append(c * v)
        for v, c in zip(x[b], _int(col, TIME_UNIT)):
            if c:
                objective.append(c * v)
        ints = np.rint(rest / TIME_UNIT).astype(np.int64)
        if not ints.any():
            continue
        # Full product with marginal constraints: tight LP relaxation (exact on trees).
        z = [[model.NewBoolVar("") for _ in range(ints.shape[1])] for _ in range(ints.shape[0])]
        products.append((a, b, z))
        for i in range(ints.shape[0]):
            model.Add(sum(z[i]) == x[a][i])
        for j in range(ints.shape[1]):
            model.Add(sum(z[i][j] for i in range(ints.shape[0])) == x[b][j])
        for i, j in zip(*np.nonzero(ints)):
            objective.append(int(ints[i, j]) * z[i][j])

    peak = None
    mem_unit = max(1.0, float(max((node.memory.max() for node in problem.nodes), default=1.0)) / 1e6)
    if problem.base_memory.size:
        exprs = []
        for p in range(len(problem.base_memory)):
            terms = []
            for n, node in enumerate(problem.nodes):
                row = node.memory[p]
                lo = float(row.min())
                for v, c in zip(x[n], _int(row - lo, mem_unit)):
                    if c:
                        terms.append(c * v)
            fixed = (problem.base_memory[p] + sum(float(node.memory[p].min()) for node in problem.nodes))
            exprs.append((terms, fixed))
        if minimize_memory:
            worst = max(problem.base_memory[p] + sum(float(n.memory[p].max()) for n in problem.nodes)
                        for p in range(len(problem.base_memory)))
            peak = model.NewIntVar(0, int(np.ceil(worst / mem_unit)) + 1, "peak")
            for terms, fixed in exprs:
                model.Add(sum(terms) + int(np.ceil(fixed / mem_unit)) <= peak)
        elif budget_bytes is not None:
            for terms, fixed in exprs:
                model.Add(sum(terms) <= int((budget_bytes - fixed) // mem_unit))

    # The constant part of the step time goes into the objective too: CP-SAT's relative gap is
    # then a fraction of the predicted step, as ``relative_gap`` promises, not of its variable part.
    off_units = int(round(offset / TIME_UNIT))
    if minimize_memory:
        model.Minimize(peak)
    else:
        model.Minimize(sum(objective) + off_units)
    start_choice = hint if hint is not None else greedy(problem)
    # A complete hint (the product booleans too) is a solution CP-SAT takes as it is: it starts
    # from the local-search plan instead of having to repair a partial assignment.
    for n, best in enumerate(start_choice):
        for i, v in enumerate(x[n]):
            model.AddHint(v, i == best)
    for a, b, z in products:
        for i, row in enumerate(z):
            for j, v in enumerate(row):
                model.AddHint(v, i == start_choice[a] and j == start_choice[b])

    solver = cp_model.CpSolver()
    # The limit is in CP-SAT's deterministic time (about seconds of work on one core), so the same
    # problem gives the same plan however loaded the machine is. The wall-clock cap is only a
    # backstop, set far enough out that load alone never reaches it (a plan must not depend on it).
    solver.parameters.max_deterministic_time = time_limit
    solver.parameters.max_time_in_seconds = 10 * time_limit
    solver.parameters.num_workers = workers
    solver.parameters.interleave_search = True   # deterministic with several workers
    solver.parameters.random_seed = 0
    solver.parameters.relative_gap_limit = relative_gap
    callback = _Reporter(status_line, minimize_memory, mem_unit) if status_line is not None \
        and status_line.enabled else None
    # CP-SAT's own SIGINT handler would end the search quietly and hand back a half-searched plan
    # as if it were the answer: Ctrl-C must stop planning instead (KeyboardInterrupt).
    solver.parameters.catch_sigint_signal = False
    with _registered(solver):
        status = _solve_interruptibly(solver, model, callback)
    if status == cp_model.MODEL_INVALID:   # a bug of ours, never the user's input: say so loudly
        raise RuntimeError(f"shardplan built an invalid CP-SAT model: {model.Validate()}")
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = [next(i for i, v in enumerate(vs) if solver.Value(v)) for vs in x]
        status_name = solver.StatusName(status)
    elif status == cp_model.UNKNOWN and budget_bytes is None and not minimize_memory:
        # Without a memory constraint every assignment is feasible: keep the local-search start.
        choice, status_name = start_choice, "HEURISTIC"
    else:
        return None
    proto = model.Proto()
    if minimize_memory:
        obj = bound = float(solver.ObjectiveValue()) * mem_unit
    else:
        obj = total_cost(problem, choice)
        bound = min(obj, offset + (solver.BestObjectiveBound() - off_units) * TIME_UNIT)
    stats = SolverStats(
        status=status_name, objective=obj, bound=bound,
        gap=0.0 if obj <= 0 else max(0.0, (obj - bound) / obj),
        wall_time=time.perf_counter() - start,
        num_variables=len(proto.variables), num_constraints=len(proto.constraints))
    return Solution(choice, stats, peak_memory(problem, choice))


def _solve_interruptibly(solver, model, callback):
    """Solve on a worker thread, so that Ctrl-C raises KeyboardInterrupt here at once and stops the search.

    (Wait on an Event, not ``Thread.join(timeout)``: a KeyboardInterrupt inside ``join`` marks the
    thread finished on Python 3.11 and the process aborts at exit.)
    """
    if threading.current_thread() is not threading.main_thread():
        return solver.Solve(model, callback)
    result, done = {}, threading.Event()

    def run():
        try:
            result["status"] = solver.Solve(model, callback)
        except BaseException as e:      # handed to the caller's thread below
            result["error"] = e
        finally:
            done.set()
    worker = threading.Thread(target=run, name="cp-sat", daemon=True)
    worker.start()
    try:
        while not done.wait(0.1):
            pass
    except BaseException:
        solver.StopSearch()
        done.wait()
        raise
    finally:
        if done.is_set():
            worker.join()
    if "error" in result:
        raise result["error"]
    return result["status"]


class Stopped(Exception):
    """The planning this solve belongs to was stopped from another thread (:class:`StopToken`)."""


class StopToken:
    """Stops the CP-SAT solves of the threads it is given to (:func:`stoppable`): the one
    running ends at once, the next raises :class:`Stopped`. For planning on a second thread
    that the caller gives up on (Ctrl-C, or an error of its own)."""

    def __init__(self):
        self._lock, self._stopped, self._live = threading.Lock(), False, set()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for solver in self._live:
                solver.StopSearch()


_thread = threading.local()


@contextlib.contextmanager
def stoppable(token: StopToken):
    """This thread's CP-SAT solves meanwhile stop when ``token`` is stopped."""
    before = getattr(_thread, "token", None)
    _thread.token = token
    try:
        yield
    finally:
        _thread.token = before


@contextlib.contextmanager
def _registered(solver):
    token = getattr(_thread, "token", None)
    if token is None:
        yield
        return
    with token._lock:
        if token._stopped:
            raise Stopped("planning stopped")
        token._live.add(solver)
    try:
        yield
    finally:
        with token._lock:
            token._live.discard(solver)


class _Reporter(cp_model.CpSolverSolutionCallback):
    """Shows each better plan CP-SAT finds: its objective, the bound and the gap."""

    def __init__(self, status_line, minimize_memory: bool, mem_unit: float):
        super().__init__()
        self.line, self.memory, self.unit = status_line, minimize_memory, mem_unit

    def on_solution_callback(self) -> None:
        if self.memory:
            self.line.say(f"solving for the least memory: {self.ObjectiveValue() * self.unit / 2**30:.2f} GiB")
            return
        obj = self.ObjectiveValue() * TIME_UNIT        # the objective holds the constant part
        bound = self.BestObjectiveBound() * TIME_UNIT
        gap = (obj - bound) / obj if obj > 0 else 0.0
        self.line.say(f"solving: best plan {obj * 1e3:.3f} ms, bound {bound * 1e3:.3f} ms, gap {gap:.1%}")


def point_memory(problem: Problem, choice: list[int]) -> np.ndarray:
    """Bytes per device at each memory checkpoint for one assignment."""
    totals = problem.base_memory.copy()
    for node, i in zip(problem.nodes, choice):
        totals = totals + node.memory[:, i]
    return totals


def peak_memory(problem: Problem, choice: list[int]) -> float:
    """Bytes per device at the fullest checkpoint for one assignment."""
    totals = point_memory(problem, choice)
    return float(totals.max()) if totals.size else 0.0


def total_cost(problem: Problem, choice: list[int]) -> float:
    """Seconds of one assignment: node costs plus the edge tables."""
    return float(sum(n.cost[c] for n, c in zip(problem.nodes, choice))
                 + sum(t[choice[a], choice[b]] for (a, b), t in problem.edges.items()))


def _option_axes(option) -> frozenset[str]:
    entries = option.values() if isinstance(option, dict) else option
    return frozenset(a for axes in entries for a in axes)


def _icm(problem: Problem, choice: list[int], nbrs, allowed=None, sweeps: int = 8) -> list[int]:
    """Iterated conditional modes: move each node to its best option given its neighbours."""
    for _ in range(sweeps):
        changed = False
        for n, node in enumerate(problem.nodes):
            total = node.cost.copy()
            for m, t in nbrs[n]:
                total += t[:, choice[m]]
            if allowed is not None:
                total = np.where(allowed[n], total, np.inf)
            best = int(np.argmin(total))
            if total[best] < total[choice[n]] - 1e-15:
                choice[n], changed = best, True
        if not changed:
            break
    return choice


def greedy(problem: Problem) -> list[int]:
    """A good start for the ILP: local search from several uniform plans, the cheapest kept.

    For every subset of the mesh axes, the search first keeps to options that use only those axes
    (pure data parallel over one axis, say), then is let free. Option 0 of every node is replicated.
    """
    nbrs = {n: [(m, problem.edges.table(n, m)) for m in ms]
            for n, ms in problem.edges.neighbours(len(problem.nodes)).items()}
    axes = sorted(set().union(*(_option_axes(o) for n in problem.nodes for o in n.options)) or set())
    best, best_cost = None, float("inf")
    for r in range(len(axes) + 1):
        for subset in itertools.combinations(axes, r):
            allowed = [np.array([_option_axes(o) <= set(subset) for o in n.options]) for n in problem.nodes]
            start = [int(np.argmin(np.where(ok, n.cost, np.inf))) for n, ok in zip(problem.nodes, allowed)]
            choice = _icm(problem, _icm(problem, start, nbrs, allowed), nbrs)
            cost = total_cost(problem, choice)
            if cost < best_cost:
                best, best_cost = choice, cost
    return best
