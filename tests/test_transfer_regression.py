"""Marginal-transfer regression on real per-site data (Munnell's state productivity
panel, 48 states x 17 years; ``core.datasets.load_state_productivity``)."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import MarginalTransferRegressor
from bagserve.core.datasets import load_state_productivity
from sklearn.linear_model import Ridge, RidgeCV
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


def test_the_pooled_linear_model_is_weighted_ridge_on_real_data(states):
    """The low-capacity part alone (linear k_X, pooled) is the weighted ridge of eq. 7
    on [x, 1]: scikit-learn's Ridge with sample weights 1/(N n_i) and no intercept."""
    tasks, y, _, _ = states
    model = MarginalTransferRegressor(
        point_kernel="linear", pooling=True, normalise="none", alpha=1e-3, random_state=0
    ).fit(tasks, y)
    X = np.hstack([tasks.points, np.ones((tasks.n_points, 1))])
    w = np.repeat(1.0 / (len(tasks) * tasks.sizes), tasks.sizes)
    ridge = Ridge(alpha=1e-3, fit_intercept=False).fit(X, y, sample_weight=w)
    np.testing.assert_allclose(model.predict(tasks), ridge.predict(X), rtol=1e-8)


def test_leave_one_division_out_beats_pooled_ridge(states):
    """On three census divisions held out in turn (the model given the other states'
    divisions, so it judges its fallback leave-one-division-out), the default model's RMSE of log
    GSP is no worse than a cross-validated pooled ridge's on the same splits
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
        # folds see it, leave-one-division-out too, and the model keeps no fallback.
        record = model.selection_["normalisation"]
        assert model.normalise_ == "none" and model.fallback_ is None
        assert record["fallback_cv"] == "leave-one-batch-out"
        assert record["fallback_cv_error"] > 0.5 * record["constant_error"]
        sse_model += float(np.sum((model.predict(tasks[test]) - y_test) ** 2))
        ridge = make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-4, 2, 13)))
        ridge.fit(tasks[train].points, y_train)
        sse_ridge += float(np.sum((ridge.predict(tasks[test].points) - y_test) ** 2))
    assert sse_model <= sse_ridge, (np.sqrt(sse_model / 816), np.sqrt(sse_ridge / 816))
