"""Folds evaluated at once give the model that folds evaluated one by one give.

The marginal-transfer search evaluates a candidate's folds on one thread each (where
its solver strategy allows it), after computing what they share (bandwidths, held-out
points, per-task statistics) on the caller's thread. The oracle is the same fit with
one fold at a time. Every configuration both evaluated to the end must have the same
errors, to the last bit; so must every other record of the selection (normalisation,
refinement, fallback, calibration), the choice and the model's answers. Which
candidates stop early may differ: the bound is checked after each round of folds, so
the one-by-one search stops at least as early, never later.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from bagserve.core import MarginalTransferClassifier, MarginalTransferRegressor
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.estimators import _transfer_cv, _transfer_nystroem
from sklearn.base import clone

from .exact import assert_same


def _fit(model, tasks, y, groups, threads: int, monkeypatch) -> tuple[Any, list[int]]:
    """``model`` fitted with ``threads`` folds at once, and the size of every round."""
    monkeypatch.setattr(_transfer_cv, "n_threads_for", lambda n_jobs: threads)
    rounds: list[int] = []
    evaluate = _transfer_cv.FoldEvaluator._fold_errors

    def counting(self, cand, folds):
        rounds.append(len(folds))
        return evaluate(self, cand, folds)

    monkeypatch.setattr(_transfer_cv.FoldEvaluator, "_fold_errors", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = clone(model).fit(tasks, y, groups=groups)
    monkeypatch.undo()
    return fitted, rounds


def _searches(selection: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The ``evaluated`` lists of every coordinate search in a selection record."""
    found = []
    if isinstance(selection, dict):
        for k, v in selection.items():
            if k == "evaluated":
                found.append(v)
            else:
                found.extend(_searches(v))
    return found


def _without_searches(selection: Any) -> Any:
    if isinstance(selection, dict):
        return {k: _without_searches(v) for k, v in selection.items() if k != "evaluated"}
    return selection


def _assert_same_model(serial, concurrent, tasks) -> None:
    assert_same(_without_searches(serial.selection_), _without_searches(concurrent.selection_))
    searches = zip(_searches(serial.selection_), _searches(concurrent.selection_), strict=True)
    for one, many in searches:
        # The same configurations, visited in the same order.
        assert [{k: e[k] for k in ("sigma", "tau", "gamma", "emb")} for e in one] == [
            {k: e[k] for k in ("sigma", "tau", "gamma", "emb")} for e in many
        ]
        for a, b in zip(one, many, strict=True):
            if "cv_error" in a:
                # Completed one by one: completed at once too, with the same errors.
                assert "cv_error" in b and a["cv_error"] == b["cv_error"]
            elif "cv_error" not in b:
                assert a["pruned_after"] <= b["pruned_after"]
    assert np.array_equal(serial.predict(tasks), concurrent.predict(tasks))
    if hasattr(serial, "decision_function"):
        assert np.array_equal(serial.decision_function(tasks), concurrent.decision_function(tasks))


@pytest.fixture(scope="module")
def data():
    return make_batched_cytometry_tasks(2, 4, 300, random_state=0, strength=1.5)


@pytest.mark.parametrize("batched", [False, True])
def test_classifier_folds_at_once_are_folds_one_by_one(data, batched, monkeypatch):
    tasks, y, batches = data
    groups = batches if batched else None
    model = MarginalTransferClassifier(random_state=0, cv=5)
    serial, one_by_one = _fit(model, tasks, y, groups, 1, monkeypatch)
    concurrent, at_once = _fit(model, tasks, y, groups, 3, monkeypatch)
    assert set(one_by_one) == {1}
    # 5 folds on 3 threads: 3, then the last 2 (2 batches' folds: both at once).
    assert max(at_once) == 3 and 2 in at_once
    _assert_same_model(serial, concurrent, tasks)


def test_regressor_folds_at_once_are_folds_one_by_one(data, monkeypatch):
    tasks, _, _ = data
    rng = np.random.default_rng(0)
    means = np.array([np.asarray(tasks[t]).mean(axis=0)[0] for t in range(len(tasks))])
    y = np.concatenate(
        [np.asarray(tasks[t])[:, 1] * means[t] + 0.1 * rng.standard_normal(tasks.sizes[t])
         for t in range(len(tasks))]
    )  # fmt: skip
    model = MarginalTransferRegressor(random_state=0, cv=4)
    serial, _ = _fit(model, tasks, y, None, 1, monkeypatch)
    concurrent, at_once = _fit(model, tasks, y, None, 2, monkeypatch)
    assert max(at_once) > 1
    _assert_same_model(serial, concurrent, tasks)


def test_folds_at_once_share_statistics_computed_before_them(data, monkeypatch):
    """The per-task statistics the folds read are complete before any fold runs: no
    fold fills in statistics while another reads them."""
    tasks, y, _ = data
    running = {"folds": 0, "late": 0}
    compute = _transfer_nystroem.task_statistics
    errors = _transfer_nystroem.NystroemFeatureStrategy.fold_errors

    def statistics(*args, **kwargs):
        stats = compute(*args, **kwargs)
        running["late"] += running["folds"] > 0
        return stats

    def fold_errors(self, fold, alphas, cache):
        running["folds"] += 1
        try:
            key = ("statistics", fold.params.sigma)
            assert cache[key].done[fold.train].all()
            return errors(self, fold, alphas, cache)
        finally:
            running["folds"] -= 1

    monkeypatch.setattr(_transfer_nystroem, "task_statistics", statistics)
    monkeypatch.setattr(_transfer_nystroem.NystroemFeatureStrategy, "fold_errors", fold_errors)
    monkeypatch.setattr(_transfer_cv, "n_threads_for", lambda n_jobs: 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        MarginalTransferClassifier(random_state=0, cv=5).fit(tasks, y)
    assert running["late"] == 0
