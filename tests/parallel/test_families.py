"""The one loop over the parallelism families (:class:`shardplan.planning.search.Search`), on families and
plans made up here: what it composes, the bound it plans each candidate against, plans made
alongside, and the error where nothing fits. The real families' searches are tested with them
(test_pipeline_search, test_recompute, test_sequence, test_defaults)."""

import dataclasses
import math

import pytest

from shardplan.errors import InfeasibleBudgetError
from shardplan.parallel.families import JOIN, Alongside, Family, Point
from shardplan.planning.search import Search


@dataclasses.dataclass(frozen=True)
class _Cost:
    step_s: float


@dataclasses.dataclass(frozen=True)
class _Plan:
    step_s: float
    chosen: tuple = ()
    warnings: tuple = ()

    @property
    def cost(self):
        return _Cost(self.step_s)


class _Listed(Family):
    """Candidates from a list; each outcome is kept."""

    errors = (KeyError,)

    def __init__(self, name, choices, pinned=False):
        super().__init__(None)
        self.name, self.choices, self._pinned, self.outcomes = name, choices, pinned, []

    def pinned(self):
        return self._pinned

    def explore(self, point, search, alone=True):
        for c in self.choices:
            self.outcomes.append((c, (yield c)))

    def record(self, plan, choice, note):
        return dataclasses.replace(plan, chosen=plan.chosen + ((self.name, choice),))

    def finish(self, plan, completed):
        return dataclasses.replace(plan, warnings=plan.warnings + (f"{self.name}: {len(completed)} planned",))


class _Made(Search):
    """The loop with a made-up leaf: ``price(choices)`` is a plan's step, or raises."""

    def __init__(self, families, price, beat=math.inf):
        super().__init__(families, budget=lambda mesh: 0, options=None, cache=False, beat=beat)
        self.price, self.beats = price, []

    def _leaf(self, point):
        from shardplan.parallel.families import Outcome
        choices = tuple(c for _, c, _ in point.chosen)
        self.beats.append((choices, self.beat))
        step = self.price(choices)
        if step >= self.beat:
            return Outcome()
        plan = self._recorded(_Plan(step), point)
        self._keep(plan, ("rest", choices))
        return Outcome(plan)


def _point():
    return Point(trace=lambda: None, mesh=None)


def test_every_combination_is_planned_against_the_best_so_far_and_the_fastest_kept():
    outer, inner = _Listed("outer", ["a", "b"]), _Listed("inner", [1, 2, 3])
    search = _Made([outer, inner], price=lambda c: {"a": 10, "b": 5}[c[0]] + c[1])
    plan, rest = search.run(_point())
    assert plan.chosen == (("outer", "b"), ("inner", 1)) and plan.step_s == 6
    assert rest == ("rest", ("b", 1))
    assert [c for c, _ in search.beats] == [(o, i) for o in "ab" for i in (1, 2, 3)]
    assert [b for _, b in search.beats] == [math.inf, 11, 11, 11, 6, 6]      # the best of the whole search
    # a2, a3, b2, b3 were no faster than the best so far: dropped, not kept
    assert plan.warnings == ("outer: 2 planned", "inner: 2 planned")
    # The outer family is sent each candidate's best plan over everything nested in it.
    assert [(c, o.plan.step_s) for c, o in outer.outcomes] == [("a", 11), ("b", 6)]


def test_a_family_searches_on_what_its_candidates_gave():
    class Halving(Family):
        name = "halving"

        def pinned(self):
            return False

        def explore(self, point, search, alone=True):
            n = 8
            while n >= 1 and (yield n).plan is not None:
                n //= 2

    search = _Made([Halving(None)], price=lambda c: {8: 3.0, 4: 2.0, 2: 2.5}[c[0]])
    plan, _ = search.run(_point())
    assert plan.step_s == 2.0 and [c for c, _ in search.beats] == [(8,), (4,), (2,)]   # 2 was slower: stop


def test_a_candidate_planned_alongside_joins_where_its_family_says_and_wins_ties():
    order = []

    class Deferring(Family):
        name = "deferring"

        def pinned(self):
            return False

        def explore(self, point, search, alone=True):
            assert alone                       # every family inside is pinned
            yield Alongside("none")
            yield "deep"
            order.append(("deep planned, best so far", search.best[0].chosen))
            outcome = yield JOIN
            order.append(("joined", outcome.plan.chosen))

        record = _Listed.record

    class Synchronous(_Made):
        """``_alongside`` and ``_join`` made up too: the plan is made when it is joined."""

        def _alongside(self, k, point):
            order.append("started alongside")
            return "pending", self.families[k + 1].enter("x", point)

        def _join(self, pending):
            from shardplan.parallel.families import Outcome
            plan = self._recorded(_Plan(5.0), pending[1])
            self._keep(plan, ("alongside",), ties=True)
            return Outcome(plan)

    search = Synchronous([Deferring(None), _Listed("inner", ["x"], pinned=True)], price=lambda c: 5.0)
    plan, rest = search.run(_point())
    assert order == ["started alongside", ("deep planned, best so far", (("deferring", "deep"), ("inner", "x"))),
                     ("joined", (("deferring", "none"), ("inner", "x")))]
    assert plan.chosen[0] == ("deferring", "none") and rest == ("alongside",)       # a tie: the plan alongside
    # A family that ends with a candidate still alongside has it joined at its end.

    class Forgetful(Deferring):
        def explore(self, point, search, alone=True):
            yield Alongside("none")

    plan, _ = Synchronous([Forgetful(None), _Listed("inner", ["x"], pinned=True)], price=lambda c: 5.0).run(_point())
    assert plan.chosen[0] == ("deferring", "none")


def test_nothing_fits_raises_the_error_that_needed_least_memory_with_each_familys_word():
    class Explaining(_Listed):
        def explain(self, error):
            error.args = (error.args[0] + f" [{self.name}]",)
            return error

    def price(c):
        raise InfeasibleBudgetError(f"needs {c}", budget_bytes=1, min_feasible_bytes={"a": 30, "b": 20}[c[0]],
                                    largest_tensors=[])

    with pytest.raises(InfeasibleBudgetError, match=r"needs \('b',\) \[one\]") as caught:
        _Made([Explaining("one", ["a", "b"])], price=price).run(_point())
    assert caught.value.min_feasible_bytes == 20


def test_a_family_error_ends_its_candidate_only():
    fam = _Listed("one", ["bad", "good"])

    def price(c):
        if c[0] == "bad":
            raise KeyError("does not apply")
        return 1.0
    plan, _ = _Made([fam], price=price).run(_point())
    assert plan.chosen == (("one", "good"),) and isinstance(fam.outcomes[0][1].error, KeyError)


def test_a_search_started_with_a_bound_none_beats_returns_none():
    assert _Made([_Listed("one", ["a"])], price=lambda c: 9.0, beat=5.0).run(_point()) is None
