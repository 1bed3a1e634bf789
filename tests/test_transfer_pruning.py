"""The marginal-transfer search stops evaluating candidates that cannot win.

The oracle is the search as it was before it pruned: every option of every step scored
on every fold, each step keeping the first option of least mean error, the best
configuration seen winning. The pruned search must choose the same configuration with
the same errors, record every completed configuration's errors unchanged, and visit
configurations in the same order; every configuration it stopped must have a bound no
lower than its choice's error. On data whose steps separate their options, or whose
last step cannot beat an earlier configuration, it must also evaluate fewer folds.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from bagserve.core import Bags, MarginalTransferClassifier
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.estimators import _transfer_cv, _transfer_fallback, _transfer_search
from bagserve.core.estimators._transfer_cv import FoldEvaluator


def _complete_search(ev: FoldEvaluator, grid: dict[str, list[Any]]) -> dict[str, Any]:
    """The coordinate search without pruning (the reference): the same steps, every
    option scored on every fold."""
    visited: list[tuple[Any, ...]] = []

    def err(c: dict[str, Any]) -> float:
        key = FoldEvaluator.key(c)
        if key not in visited:
            visited.append(key)
        return float(ev.score(c).min())

    def best_of(options: list[dict[str, Any]]) -> dict[str, Any]:
        return min(options, key=err)

    others = [t for t in grid["tau"] if t != 1.0]
    current = {k: v[0] for k, v in grid.items()}
    if 1.0 in grid["tau"]:
        current = best_of([{**current, "sigma": s, "tau": 1.0} for s in grid["sigma"]])
    if others:
        gamma, emb = grid["gamma"][len(grid["gamma"]) // 2], grid["emb"][len(grid["emb"]) // 2]
        if 1.0 not in grid["tau"]:
            current = best_of(
                [{**current, "sigma": s, "tau": others[0], "gamma": gamma, "emb": emb}
                 for s in grid["sigma"]]
            )  # fmt: skip
        current = best_of([{**current, "tau": t, "gamma": gamma, "emb": emb} for t in others])
        current = best_of([{**current, "gamma": g} for g in grid["gamma"]])
        current = best_of([{**current, "emb": e} for e in grid["emb"]])
    means = {k: ev.fold_errors[k].mean(axis=0) for k in visited}
    key = min(means, key=lambda k: means[k].min())
    return {
        "visited": visited,
        "cv_error": {k: m.tolist() for k, m in means.items()},
        "best": key,
        "alpha_index": int(np.argmin(means[key])),
    }


def _unevaluated(ev: FoldEvaluator) -> FoldEvaluator:
    """``ev`` with its caches (features, embeddings) but none of its errors."""
    fresh = copy.copy(ev)
    fresh.fold_errors, fresh._partial, fresh._reused_errors = {}, {}, None
    return fresh


@pytest.fixture
def searches(monkeypatch):
    """Every coordinate search of a fit, pruned as the fit runs it and completed by the
    oracle on a copy of its evaluator, with the folds each evaluated."""
    found: list[dict[str, Any]] = []
    counter = {"folds": 0}
    fold_error = FoldEvaluator._fold_error

    def counting(self, cand, f):
        counter["folds"] += 1
        return fold_error(self, cand, f)

    monkeypatch.setattr(FoldEvaluator, "_fold_error", counting)
    pruned_search = _transfer_cv.coordinate_search

    def both(ev, grid):
        oracle_ev = _unevaluated(ev)
        before = counter["folds"]
        oracle = _complete_search(oracle_ev, grid)
        oracle_folds = counter["folds"] - before
        start = _unevaluated(ev)
        start.fold_errors = dict(ev.fold_errors)  # what the fit had evaluated before
        before = counter["folds"]
        record = pruned_search(ev, grid)
        found.append(
            {
                "record": record,
                "oracle": oracle,
                "pruned_folds": counter["folds"] - before,
                "oracle_folds": oracle_folds,
                "known_before": set(start.fold_errors),
            }
        )
        return record

    monkeypatch.setattr(_transfer_search, "coordinate_search", both)
    monkeypatch.setattr(_transfer_fallback, "coordinate_search", both)
    return found


def _fit(strength: float, n: int, seed: int, noise: float = 0.0) -> MarginalTransferClassifier:
    """A fit on one batch of 6 samples (its grid-edge warnings left to the caller)."""
    tasks, y, _ = make_batched_cytometry_tasks(2, 6, n, strength=strength, random_state=seed)
    one = np.asarray(tasks.bag_index() < 6)  # the first batch's 6 samples
    cells = Bags.from_arrays([np.asarray(tasks[t]) for t in range(6)])
    y = np.asarray(y).copy()
    # Labels swapped at random: every configuration errs on every fold.
    rng = np.random.default_rng(seed)
    flip = np.flatnonzero(rng.random(y.size) < noise)
    y[flip] = rng.permutation(y[flip])
    return MarginalTransferClassifier(random_state=0, cv=3).fit(cells, y[one])


def _edge_warnings(**data: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(**data)
    return sorted(str(w.message) for w in caught if "of its grid" in str(w.message))


def _complete_record(ev: FoldEvaluator, grid: dict[str, list[Any]]) -> dict[str, Any]:
    """The selection record of the search without pruning."""
    found = _complete_search(ev, grid)
    alphas = ev.setup.alphas
    names = ("sigma", "tau", "gamma", "emb")
    return {
        "evaluated": [
            {**dict(zip(names, k, strict=True)), "cv_error": found["cv_error"][k]}
            for k in found["visited"]
        ],
        "alpha_grid": alphas,
        "folds": ev.setup.folds,
        "best": {
            **dict(zip(names, found["best"], strict=True)),
            "alpha": float(alphas[found["alpha_index"]]),
        },
    }


def _check_same_choice(found: list[dict[str, Any]]) -> None:
    assert found
    for s in found:
        record, oracle = s["record"], s["oracle"]
        best = record["best"]
        key = FoldEvaluator.key(best)
        assert key == oracle["best"]
        assert best["alpha"] == float(record["alpha_grid"][oracle["alpha_index"]])
        visited = [FoldEvaluator.key(e) for e in record["evaluated"]]
        # The same order as the complete search; it may stop before its end.
        assert visited == oracle["visited"][: len(visited)]
        chosen = min(oracle["cv_error"][oracle["best"]])
        for e, k in zip(record["evaluated"], visited, strict=True):
            if "cv_error" in e:
                assert e["cv_error"] == oracle["cv_error"][k]  # to the last bit
            else:
                # A stopped configuration could not have won.
                assert 0 <= e["pruned_after"] < len(record["folds"])
                assert k != oracle["best"]
                assert "bound" in e or e["pruned_after"] == 0
                assert e.get("bound", np.inf) >= chosen
        if len(visited) < len(oracle["visited"]):
            # The search ended early only at a configuration without any fold error.
            assert min(oracle["cv_error"][oracle["best"]]) == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_pruned_search_chooses_as_the_complete_one_on_folds_that_err(searches, seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(strength=2.5, n=150, seed=seed, noise=0.2)
    _check_same_choice(searches)
    errs = [min(v) for s in searches for v in s["oracle"]["cv_error"].values()]
    assert min(errs) > 0.0  # every configuration errs: no early end, only bounds
    assert sum(s["pruned_folds"] for s in searches) < sum(s["oracle_folds"] for s in searches)


def test_search_ends_at_a_configuration_without_fold_errors(searches):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(strength=0.5, n=300, seed=0)
    _check_same_choice(searches)
    primary = searches[0]
    assert min(primary["oracle"]["cv_error"][primary["oracle"]["best"]]) == 0.0
    assert len(primary["record"]["evaluated"]) < len(primary["oracle"]["visited"])
    assert primary["pruned_folds"] < primary["oracle_folds"]


def test_a_last_step_worse_than_the_best_seen_stops_after_a_round(searches):
    """The second batch of 300-cell samples (default five folds), where the pooled
    model fits better than every share of pooling: the task bandwidths' step, the last
    one, stops its options against it after a round of folds, and the choice is the
    complete search's."""
    tasks, y, _ = make_batched_cytometry_tasks(2, 8, 300, strength=1.5, random_state=1)
    second = np.asarray(tasks.bag_index() >= 8)
    cells = Bags.from_arrays([np.asarray(tasks[t]) for t in range(8, 16)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        MarginalTransferClassifier(random_state=0).fit(cells, np.asarray(y)[second])
    _check_same_choice(searches)
    primary = searches[0]
    assert primary["oracle"]["best"][1] == 1.0  # the pooled model
    stopped = [e for e in primary["record"]["evaluated"] if "bound" in e]
    gammas = {e["gamma"] for e in stopped if e["tau"] != 1.0}
    assert len(gammas) > 1  # the last step's options other than its start
    assert primary["pruned_folds"] < primary["oracle_folds"]


class _DrawnErrors(FoldEvaluator):
    """An evaluator whose fold errors are given rows (folds × λ), of a strategy that
    evaluates folds at once (as many per round as ``n_threads_for`` gives)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.fold_errors, self._partial, self._reused_errors = {}, {}, None
        self.setup = SimpleNamespace(folds=[None] * rows.shape[0], alphas=rows[0])
        self.strategy = SimpleNamespace(concurrent_folds=True)
        self.rounds: list[list[int]] = []

    def _fold_errors(self, cand: dict[str, Any], folds: range) -> list[np.ndarray]:
        self.rounds.append(list(folds))
        return [self.rows[f] for f in folds]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_lower_bound_never_exceeds_the_complete_error(threads, monkeypatch):
    """The bound a stopped evaluation is judged by, against the error its completion
    gives, on fold errors spanning 12 orders of magnitude, some exactly 0 (floating-point
    sums of non-negative terms are monotone in each term), checked after every round of
    folds: one fold, or one per thread and the last few together."""
    monkeypatch.setattr(_transfer_cv, "n_threads_for", lambda n_jobs: threads)
    rng = np.random.default_rng(0)
    cand = {"sigma": ("relative", 1.0), "tau": 1.0, "gamma": None, "emb": 1.0}
    for _ in range(300):
        rows = 10.0 ** rng.uniform(-12, 0, size=(7, 6)) * (rng.random((7, 6)) > 0.2)
        ev = _DrawnErrors(rows)
        bounds: list[float] = []
        ev.score_unless(cand, lambda b, seen=bounds: seen.append(b) or False)
        complete = float(ev.score(cand).min())
        assert complete == float(rows.mean(axis=0).min())
        assert [f for r in ev.rounds for f in r] == list(range(7))
        assert max(map(len, ev.rounds)) <= threads + (threads > 1)
        assert len(bounds) == len(ev.rounds) - 1
        assert bounds == sorted(bounds) and bounds[-1] <= complete


@pytest.mark.parametrize(
    ("threads", "first", "then"), [(1, [[0]], [[1], [2], [3], [4]]), (2, [[0, 1]], [[2, 3, 4]])]
)
def test_a_stopped_evaluation_resumes_where_it_stopped(threads, first, then, monkeypatch):
    monkeypatch.setattr(_transfer_cv, "n_threads_for", lambda n_jobs: threads)
    rows = np.random.default_rng(1).random((5, 3))
    ev = _DrawnErrors(rows)
    cand = {"sigma": ("relative", 1.0), "tau": 1.0, "gamma": None, "emb": 1.0}
    assert ev.score_unless(cand, lambda b: b > 0.0) is None
    assert ev.rounds == first and FoldEvaluator.key(cand) not in ev.fold_errors
    assert np.array_equal(ev.score(cand), rows.mean(axis=0))
    assert ev.rounds == first + then


@pytest.mark.parametrize(
    "data",
    [
        {"strength": 2.5, "n": 150, "seed": 0, "noise": 0.2},  # every fold errs
        {"strength": 0.5, "n": 300, "seed": 0},  # the search ends early
    ],
)
def test_grid_edges_are_those_of_the_complete_search(monkeypatch, data):
    """What the record shows of each grid decides the grid-edge warnings, and with
    them which grids training widens: a search that ends early records the rest of
    its step, and warns as the complete search does."""
    pruned = _edge_warnings(**data)
    monkeypatch.setattr(_transfer_search, "coordinate_search", _complete_record)
    monkeypatch.setattr(_transfer_fallback, "coordinate_search", _complete_record)
    assert pruned and pruned == _edge_warnings(**data)
