"""The boosted-trees cell model: its stored form answers as scikit-learn's own model
does, stored trees are checked before the compiled predictor reads them, each sample
gives the same cells whatever their order, and a model with trees saves and loads
without pickle."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import Bags, MarginalTransferClassifier, artifacts
from bagserve.core.errors import BagValidationError
from bagserve.core.estimators.transfer.trees import (
    TREE_PARAMETERS,
    check_trees,
    fit_trees,
    tree_scores,
)
from sklearn.ensemble import HistGradientBoostingClassifier
from threadpoolctl import threadpool_limits


def _coded(codes: np.ndarray, n_classes: int) -> np.ndarray:
    """The estimators' ±1 coding: one column for two classes."""
    if n_classes == 2:
        return (2.0 * codes - 1.0)[:, None]
    Y = -np.ones((codes.size, n_classes))
    Y[np.arange(codes.size), codes] = 1.0
    return Y


def _cells(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5))
    codes = (x[:, 0] > 0.3).astype(int) + (x[:, 1] > 0.5) + (x[:, 2] * x[:, 3] > 0.2)
    return x, codes


@pytest.mark.parametrize("n_classes", [2, 4])
def test_stored_trees_answer_as_scikit_learn_does(n_classes):
    """Scores are ``2 p - 1`` of scikit-learn's own probabilities, cells with a missing
    marker included (the oracle: the same boosting fitted by scikit-learn)."""
    x, codes = _cells(3000, 0)
    if n_classes == 2:
        codes = (codes > 1).astype(int)
    trees = fit_trees(x, _coded(codes, n_classes), seed=3)
    oracle = HistGradientBoostingClassifier(**TREE_PARAMETERS, random_state=3).fit(x, codes)
    new, _ = _cells(2000, 1)
    new[:7, 2] = np.nan
    expected = 2.0 * oracle.predict_proba(new) - 1.0
    if n_classes == 2:
        expected = expected[:, 1:]
    scores = tree_scores(trees, new)
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-12)
    with threadpool_limits(1, user_api="openmp"):  # as in a service worker
        np.testing.assert_array_equal(tree_scores(trees, new), scores)


def test_a_class_the_trees_never_saw_scores_minus_one():
    x, codes = _cells(2000, 2)
    codes = np.minimum(codes, 2)  # classes 0-2 of a 5-class problem
    trees = fit_trees(x, _coded(codes, 5), seed=0)
    scores = tree_scores(trees, x[:50])
    assert scores.shape == (50, 5)
    np.testing.assert_array_equal(scores[:, 3:], -1.0)
    oracle = HistGradientBoostingClassifier(**TREE_PARAMETERS, random_state=0).fit(x, codes)
    np.testing.assert_allclose(scores[:, :3], 2.0 * oracle.predict_proba(x[:50]) - 1.0, atol=1e-12)
    one = fit_trees(x, _coded(np.full(x.shape[0], 2), 5), seed=0)
    np.testing.assert_array_equal(
        tree_scores(one, x[:3]), np.where(np.arange(5) == 2, 1.0, -1.0)[None].repeat(3, 0)
    )


def _corrupted(trees: dict, name: str, index: int, value) -> dict:
    out = {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in trees.items()}
    out[name][index] = value
    return out


@pytest.fixture(scope="module")
def small_trees():
    x, codes = _cells(1500, 4)
    return fit_trees(x, _coded(codes, 4), seed=0), x


CORRUPTIONS = {
    "a child pointing back (a loop)": ("left", 0),
    "a child outside its tree": ("right", 10_000),
    "a feature the model does not have": ("feature", 5),
    "a negative feature": ("feature", -1),
    "a leaf value that is not finite": ("value", np.nan),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_stored_trees_are_checked_before_the_compiled_predictor_reads_them(small_trees, what):
    trees, x = small_trees
    name, value = CORRUPTIONS[what]
    node = int(np.flatnonzero(~trees["leaf"])[1]) if name != "value" else 0
    bad = _corrupted(trees, name, node, value)
    with pytest.raises(BagValidationError, match="stored trees"):
        tree_scores(bad, x[:5])
    check_trees(trees, x.shape[1])  # the untouched trees pass


def test_stored_trees_with_bad_shapes_or_codes_are_refused(small_trees):
    trees, x = small_trees
    with pytest.raises(BagValidationError, match="tree offsets"):
        check_trees(_corrupted(trees, "tree_offsets", 0, 1), x.shape[1])
    with pytest.raises(BagValidationError, match="class codes"):
        check_trees(dict(trees, classes=np.array([0, 1, 7])), x.shape[1])
    with pytest.raises(BagValidationError, match="whole iterations"):
        check_trees(dict(trees, baseline=np.zeros(2)), x.shape[1])
    with pytest.raises(BagValidationError, match="incomplete"):
        check_trees({k: v for k, v in trees.items() if k != "left"}, x.shape[1])


# ------------------------------------------------------------------ the fallback's choice
def _gated_tasks(n_tasks: int, n: int, seed: int, gain=None) -> tuple[list, list]:
    """Cells whose populations are boxes on one or two markers, as gates are drawn,
    and a rest class (0) of every other cell; ``gain``: a per-marker affine
    instrument (scale, offset) of a new batch."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for _ in range(n_tasks):
        x = rng.uniform(-2, 2, size=(n, 4))
        y = np.zeros(n, dtype=int)
        y[(x[:, 0] > 0.5) & (x[:, 1] > 0.5)] = 1
        y[(x[:, 0] < -0.5) & (x[:, 2] > 0.0)] = 2
        y[x[:, 3] > 1.2] = 3
        xs.append(x if gain is None else x * gain[0] + gain[1])
        ys.append(y)
    return xs, ys


@pytest.fixture(scope="module")
def gated_model():
    xs, ys = _gated_tasks(6, 1500, 0)
    model = MarginalTransferClassifier(cell_model="trees", random_state=0)
    model.fit(Bags.from_arrays(xs), np.concatenate(ys))
    new, y_new = _gated_tasks(3, 1500, 1, gain=([1.5, 0.7, 2.0, 1.2], [3.0, -2.0, 1.0, 4.0]))
    return model, xs, ys, Bags.from_arrays(new), y_new


def test_trees_on_calibrated_cells_carry_gates_to_a_new_instrument(gated_model):
    """Boxes drawn on one or two markers, a new batch that scales and shifts every
    marker: calibrated by its landmarks (the instrument shows in their likelihood),
    the trees label 94 % of its cells, where they label 99.6 % of a sample of the
    training batch and 20 % of the new batch uncalibrated. The landmarks' Gaussian
    populations fit uniform boxes only roughly: that is the gap."""
    model, _, _, new, y_new = gated_model
    assert model.calibration_ == "landmarks"
    answers = model.predict_tasks(new)
    assert all(a.report.calibrated == "landmarks" for a in answers)
    accuracy = np.mean(np.concatenate([a.predictions for a in answers]) == np.concatenate(y_new))
    assert accuracy > 0.92


def test_a_model_with_trees_saves_and_loads_without_pickle(gated_model, tmp_path):
    model, _, _, new, _ = gated_model
    trees = model.cell_model_["trees"]
    artifacts.save(model, tmp_path / "m")
    assert not list((tmp_path / "m").rglob("*.joblib"))
    expected = model.predict_tasks(new)
    for mmap in (False, True):  # the service's workers: sealed shared memory, read-only
        loaded = artifacts.load(tmp_path / "m", mmap=mmap)
        stored = loaded.cell_model_["trees"]
        assert stored["tree_offsets"].size == trees["tree_offsets"].size
        for a, b in zip(expected, loaded.predict_tasks(new), strict=True):
            np.testing.assert_array_equal(a.scores, b.scores)
            assert a.report.calibrated == b.report.calibrated == model.calibration_


# ------------------------------------------------------------------ stopping early
def test_trees_are_fitted_on_at_most_tree_points_cells_of_each_task(monkeypatch):
    """Each task gives at most ``TREE_POINTS`` of its cells with their own targets, the
    same ones in every call (folds and final fit alike) and whatever the order of its
    cells, as ``subsample_bags`` draws them; a smaller task gives all of them."""
    import bagserve.core.estimators.transfer.trees as trees_module
    from bagserve.core.bags import subsample_bags

    xs, ys = _gated_tasks(3, 300, 2)
    xs[1] = xs[1][:80]
    ys[1] = ys[1][:80]
    tasks = Bags.from_arrays(xs)
    Y = _coded(np.concatenate(ys), 4)
    seen = []
    real_fit = trees_module.fit_trees
    monkeypatch.setattr(
        trees_module, "fit_trees", lambda p, y, seed: seen.append((p, y)) or real_fit(p, y, seed)
    )
    monkeypatch.setattr(trees_module, "TREE_POINTS", 100)
    first = trees_module.fit_task_trees(tasks, Y, seed=0)
    again = trees_module.fit_task_trees(tasks, Y, seed=0, which=[0, 1, 2])
    (points, targets), (points2, _) = seen
    np.testing.assert_array_equal(points, points2)
    for name in ("value", "feature", "threshold", "tree_offsets"):
        np.testing.assert_array_equal(first[name], again[name])
    np.testing.assert_array_equal(points, subsample_bags(tasks, 100, seed=0).points)
    assert points.shape == (100 + 80 + 100, 4)
    parts = np.split(np.arange(points.shape[0]), [100, 180])
    for t, part in enumerate(parts):
        rows = [np.flatnonzero((xs[t] == p).all(axis=1))[0] for p in points[part]]
        assert len(set(rows)) == len(rows)  # distinct cells of task t
        np.testing.assert_array_equal(targets[part], _coded(ys[t], 4)[rows])
    # Task 2 alone (a fold training on it), its cells shuffled: the same cells.
    order = np.random.default_rng(1).permutation(300)
    shuffled = Bags.from_arrays([xs[0], xs[1], xs[2][order]])
    Ys = _coded(np.concatenate([ys[0], ys[1], ys[2][order]]), 4)
    seen.clear()
    trees_module.fit_task_trees(shuffled, Ys, seed=0, which=[2])
    alone, alone_targets = seen[0]
    np.testing.assert_array_equal(alone, points[180:])
    np.testing.assert_array_equal(alone_targets, targets[180:])
    monkeypatch.setattr(trees_module, "TREE_POINTS", 10_000)
    seen.clear()
    trees_module.fit_task_trees(tasks, Y, seed=0)
    np.testing.assert_array_equal(seen[0][0], tasks.points)
