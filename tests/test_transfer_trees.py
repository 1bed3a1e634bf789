"""The invariant fallback's boosted trees: their stored form answers as scikit-learn's
own model does, stored trees are checked before the compiled predictor reads them, and
the fallback takes them where its folds show axis-aligned gates carrying over better."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from bagserve.core import Bags, MarginalTransferClassifier, artifacts
from bagserve.core.bags import standardise_each_bag
from bagserve.core.errors import BagValidationError
from bagserve.core.estimators._transfer_trees import (
    TREE_PARAMETERS,
    check_trees,
    fit_trees,
    tree_scores,
)
from bagserve.core.selection import GridEdgeWarning
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GridEdgeWarning)
        model = MarginalTransferClassifier(random_state=0).fit(
            Bags.from_arrays(xs), np.concatenate(ys)
        )
    new, y_new = _gated_tasks(3, 1500, 1, gain=([1.5, 0.7, 2.0, 1.2], [3.0, -2.0, 1.0, 4.0]))
    return model, xs, ys, Bags.from_arrays(new), y_new


def test_the_fallback_takes_trees_where_its_folds_show_them_clearly_better(gated_model):
    model, xs, ys, new, y_new = gated_model
    record = model.selection_["normalisation"]
    assert model.normalise_ != "standard" and model.fallback_ is not None
    assert record["fallback_choice"]["chosen"] == "own kernel"
    trees = record["fallback_trees"]
    kernel, boosted = (np.asarray(trees["fold_errors"][k]) for k in ("own kernel", "boosted trees"))
    assert trees["gain"] == pytest.approx((kernel - boosted).mean())
    assert trees["gain"] > trees["margin"] >= trees["se"]
    assert trees["chosen"] == record["fallback_model"] == "boosted trees"
    assert record["fallback_cv_error"] == pytest.approx(boosted.mean())
    assert record["fallback_refine"]["chosen"] == "none" == model.fallback_.refine_
    np.testing.assert_array_equal(record["fallback_fold_errors"], boosted)

    answers = model.predict_tasks(new)
    assert all(a.report.fallback for a in answers)
    # The oracle: scikit-learn's boosting on the same per-sample standardised cells.
    train = standardise_each_bag(Bags.from_arrays(xs))
    oracle = HistGradientBoostingClassifier(**TREE_PARAMETERS, random_state=model.seed_)
    oracle.fit(train.points, np.concatenate(ys))
    for a, x in zip(answers, standardise_each_bag(new), strict=True):
        np.testing.assert_array_equal(a.predictions, oracle.predict(np.asarray(x)))
    with_trees = np.mean([np.mean(a.predictions == v) for a, v in zip(answers, y_new, strict=True)])
    saved, model.fallback_.trees_ = model.fallback_.trees_, None  # its kernel instead
    try:
        kernel_answers = model.predict_tasks(new)
    finally:
        model.fallback_.trees_ = saved
    with_kernel = np.mean(
        [np.mean(a.predictions == v) for a, v in zip(kernel_answers, y_new, strict=True)]
    )
    assert with_trees > with_kernel + 0.01


def test_a_model_with_trees_saves_and_loads_without_pickle(gated_model, tmp_path):
    model, _, _, new, _ = gated_model
    assert model.fallback_.trees_ is not None
    artifacts.save(model, tmp_path / "m")
    assert not list((tmp_path / "m").rglob("*.joblib"))
    expected = model.predict_tasks(new)
    for mmap in (False, True):  # the service's workers: sealed shared memory, read-only
        loaded = artifacts.load(tmp_path / "m", mmap=mmap)
        stored = loaded.fallback_.trees_
        assert stored["tree_offsets"].size == model.fallback_.trees_["tree_offsets"].size
        for a, b in zip(expected, loaded.predict_tasks(new), strict=True):
            np.testing.assert_array_equal(a.scores, b.scores)
            assert a.report.fallback and b.report.fallback


# ------------------------------------------------------------------ stopping early
def _stub_evaluator(n_tasks: int = 6, n: int = 400):
    """What :func:`choose_trees` reads of a fold evaluator, on small gated tasks: three
    leave-two-tasks-out folds, every held-out task scored on all its points."""
    from types import SimpleNamespace

    from bagserve.core.estimators._transfer_cv import misclassification_rate

    xs, ys = _gated_tasks(n_tasks, n, 5)
    tasks = standardise_each_bag(Bags.from_arrays(xs))
    Y = _coded(np.concatenate(ys), 4)
    folds = [
        (np.setdiff1d(np.arange(n_tasks), val), val)
        for val in np.array_split(np.arange(n_tasks), 3)
    ]

    def held_out_points(v):
        lo, hi = tasks.offsets[v], tasks.offsets[v + 1]
        return tasks.points[lo:hi], Y[lo:hi]

    setup = SimpleNamespace(
        folds=folds, data=SimpleNamespace(tasks=tasks, Y=Y), error=misclassification_rate
    )
    return SimpleNamespace(setup=setup, held_out_points=held_out_points), tasks, Y


def test_the_trees_evaluation_stops_only_where_it_cannot_change_the_choice(monkeypatch):
    """The oracle: every fold's trees fitted by scikit-learn and the rule applied by hand.
    Against kernels erring more or less than the trees, the evaluation stops before any
    fold, after some, or runs to the end, and chooses as the complete evaluation does."""
    import bagserve.core.estimators._transfer_fallback as fallback_module
    import bagserve.core.estimators._transfer_trees as trees_module
    from bagserve.core.estimators._transfer_fallback import CAPACITY_GAIN, choose_trees

    kernel, tasks, Y = _stub_evaluator()
    labels = np.argmax(Y, axis=1)
    oracle = []
    for train, val in kernel.setup.folds:
        rows = np.concatenate([np.arange(tasks.offsets[t], tasks.offsets[t + 1]) for t in train])
        model = HistGradientBoostingClassifier(**TREE_PARAMETERS, random_state=0)
        model.fit(tasks.points[rows], labels[rows])
        held = [kernel.held_out_points(int(v)) for v in val]
        oracle.append(np.mean([np.mean(model.predict(x) != np.argmax(y, 1)) for x, y in held]))
    oracle = np.array(oracle)
    monkeypatch.setattr(fallback_module, "n_threads_for", lambda n_jobs: 2)  # rounds of 2 folds
    fitted = []
    real_fit = trees_module.fit_trees
    monkeypatch.setattr(trees_module, "fit_trees", lambda *a: fitted.append(1) or real_fit(*a))
    constant = 0.5
    least = CAPACITY_GAIN * constant
    stop_at_two = (3 * least + oracle[0] + oracle[1]) / 2 - 0.001
    assert stop_at_two * 2 / 3 > least  # so not before the first fold
    seen = set()
    for kernel_errors in (
        np.full(3, 0.2 * least),  # the kernel errs too little to lose to anything
        np.array([oracle[0], oracle[1] - 0.003, oracle[2] + 0.4]),
        # After two folds the trees are behind by what the third could at most undo.
        np.array([stop_at_two, stop_at_two, 0.0]),
        oracle + 0.05,  # the trees clearly better: every fold
        oracle - 0.001,
    ):
        fitted.clear()
        record = choose_trees(kernel, kernel_errors, constant, seed=0)
        diff = kernel_errors - oracle
        se = diff.std(ddof=1) / np.sqrt(diff.size)
        expected = "boosted trees" if diff.mean() > max(se, least) else "own kernel"
        assert record["chosen"] == expected
        assert len(fitted) == len(record["fold_errors"]["boosted trees"])
        np.testing.assert_allclose(record["fold_errors"]["boosted trees"], oracle[: len(fitted)])
        if "stopped_after" in record:
            assert record["chosen"] == "own kernel" and record["stopped_after"] < 3
        seen.add(record.get("stopped_after", 3))
    assert seen == {0, 2, 3}


def test_the_card_says_the_trees_answer_new_batches(gated_model):
    from bagserve.core.card import render_card
    from bagserve.core.training.saving import _calibration_record, _new_batch_record

    model = gated_model[0]
    record = _new_batch_record(model)
    assert record["fallback"] == "boosted trees" and record["fallback_cv"] == "leave-tasks-out"
    assert _calibration_record(model) is None  # no intervals: calibration_ is of new batches
    card = render_card({"new_batches": record}, estimator="MarginalTransferClassifier", kind="cell")
    line = next(x for x in card.splitlines() if x.startswith("- Samples unlike"))
    assert "gradient-boosted trees on per-sample standardised cells" in line
    assert f"fold error {record['fallback_cv_error']:.4g}" in line


def test_trees_are_fitted_on_at_most_tree_points_cells_of_each_task(monkeypatch):
    """Each task gives at most ``TREE_POINTS`` of its cells with their own targets, the
    same ones in every call (folds and final fit alike) and whatever the order of its
    cells, as ``subsample_bags`` draws them; a smaller task gives all of them."""
    import bagserve.core.estimators._transfer_trees as trees_module
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
