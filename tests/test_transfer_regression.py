"""Marginal-transfer regression on real per-site data (Munnell's state productivity
panel, 48 states x 17 years; ``core.datasets.load_state_productivity``)."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import MarginalTransferRegressor
from bagserve.core.datasets import load_state_productivity
from sklearn.linear_model import RidgeCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


@pytest.fixture(scope="module")
def states():
    return load_state_productivity()


def test_the_data_are_munnells_panel(states):
    tasks, y, divisions, codes = states
    assert len(tasks) == 48 and set(tasks.sizes) == {17} and tasks.dim == 4
    assert y.shape == (816,) and np.unique(divisions).size == 9
    # Known values: Alabama's 1970 gross state product was 28,418 (millions of dollars).
    assert codes[0] == "AL" and y[0] == pytest.approx(np.log(28418.0), rel=1e-12)


def test_the_linear_cell_model_is_the_weighted_ridge_of_eq_7_on_real_data(states):
    """The linear cell model is a ridge on the pooled standardised cells with every
    task weighted equally (paper 004 eq. 7) and an unpenalised offset, at the ridge
    it chose: the weighted normal equations solved here by hand."""
    tasks, y, _, _ = states
    model = MarginalTransferRegressor(cell_model="linear", calibrate="none").fit(tasks, y)
    alpha = model.cell_model_["alpha"]
    x = tasks.points
    A = np.hstack([(x - x.mean(axis=0)) / x.std(axis=0), np.ones((tasks.n_points, 1))])
    w = np.repeat(tasks.n_points / (len(tasks) * tasks.sizes), tasks.sizes)
    penalty = alpha * np.diag([1.0] * x.shape[1] + [0.0])
    beta = np.linalg.solve(A.T @ (w[:, None] * A) + penalty, A.T @ (w * y))
    np.testing.assert_allclose(model.predict(tasks), A @ beta, rtol=1e-9)


def test_leave_one_division_out_is_no_worse_than_pooled_ridge(states):
    """On three census divisions held out in turn (the model given the other states'
    divisions, so it chooses leave-one-division-out), the default model's RMSE of
    log GSP is no worse than a cross-validated pooled ridge's on the same splits
    (bench/bench_dg_regression.py has all nine, and HGB)."""
    tasks, y, divisions, _ = states
    per = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    sse_model = sse_ridge = 0.0
    for held in ("Mountain", "South Atlantic", "Pacific"):
        test = np.flatnonzero(divisions == held)
        train = np.flatnonzero(divisions != held)
        y_train = np.concatenate([per[t] for t in train])
        y_test = np.concatenate([per[t] for t in test])
        model = MarginalTransferRegressor(n_components=64, random_state=0)
        model.fit(tasks[train], y_train, groups=divisions[train])
        # Standardising each state erases its level, which log GSP depends on: the
        # leave-one-division-out folds see it and keep the states as measured.
        assert model.selection_["folds"] == "leave one batch out"
        assert model.calibration_ == "none"
        sse_model += float(np.sum((model.predict(tasks[test]) - y_test) ** 2))
        ridge = make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-4, 2, 13)))
        ridge.fit(tasks[train].points, y_train)
        sse_ridge += float(np.sum((ridge.predict(tasks[test].points) - y_test) ** 2))
    # Where the folds keep the linear cell model it is this pooled ridge (the same
    # ridges, the same cross-validation): equal up to the order of float sums.
    assert sse_model <= sse_ridge * (1 + 1e-9), (sse_model, sse_ridge)
