"""Refinement of a new task's labels by a Gaussian mixture fitted to the task's own
points (``refine=``), and its choice by the folds."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import Bags, MarginalTransferClassifier, MarginalTransferRegressor, load, save
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.estimators import _transfer_refine
from bagserve.core.estimators._transfer_cv import misclassification_rate
from bagserve.core.estimators._transfer_refine import refine_scores
from scipy.special import logsumexp
from scipy.stats import multivariate_normal


def naive_em(x, labels, classes, reg, iters):
    """Expectation-maximisation written out: one Gaussian per class started at the
    points labelled with it, ``reg`` added to every covariance (the oracle)."""
    weights = np.array([np.mean(labels == c) for c in classes])
    means = np.array([x[labels == c].mean(axis=0) for c in classes])
    covs = np.array(
        [np.cov(x[labels == c].T, bias=True) + reg * np.eye(x.shape[1]) for c in classes]
    )
    for _ in range(iters):
        log = np.column_stack(
            [
                np.log(w) + multivariate_normal(m, c).logpdf(x)
                for w, m, c in zip(weights, means, covs, strict=True)
            ]
        )
        resp = np.exp(log - logsumexp(log, axis=1, keepdims=True))
        nk = resp.sum(axis=0)
        weights = nk / nk.sum()
        means = (resp.T @ x) / nk[:, None]
        covs = np.array(
            [
                ((resp[:, k, None] * (x - means[k])).T @ (x - means[k])) / nk[k]
                + reg * np.eye(x.shape[1])
                for k in range(len(classes))
            ]
        )
    log = np.column_stack(
        [
            np.log(w) + multivariate_normal(m, c).logpdf(x)
            for w, m, c in zip(weights, means, covs, strict=True)
        ]
    )
    return np.exp(log - logsumexp(log, axis=1, keepdims=True))


def clusters(rng, n_classes):
    centres = np.array([[0.0, 0.0], [3.0, 1.0], [0.5, 3.5]])[:n_classes]
    sizes = [300, 200, 150][:n_classes]
    x = np.vstack(
        [
            rng.multivariate_normal(c, [[0.6, 0.3], [0.3, 0.5]], s)
            for c, s in zip(centres, sizes, strict=True)
        ]
    )
    truth = np.repeat(np.arange(n_classes), sizes)
    return x, truth, centres


@pytest.mark.parametrize("n_classes", [2, 3])
def test_refinement_is_the_posterior_of_the_mixture_started_at_the_model_labels(
    monkeypatch, n_classes
):
    """Scores are 2p - 1 (one-vs-rest) or p1 - p0 (two classes) of the posterior of an
    EM run to convergence from the model's labels: a naive EM with scipy's Gaussian
    density is the oracle. Labels from a boundary moved into a population (a batch
    effect) are put right."""
    monkeypatch.setattr(_transfer_refine, "REFINE_MAX_ITER", 2000)
    monkeypatch.setattr(_transfer_refine, "REFINE_TOL", 1e-13)
    rng = np.random.default_rng(0)
    x, truth, centres = clusters(rng, n_classes)
    # A model trained on another batch: nearest centre, all centres moved by 1.3.
    shifted = centres + 1.3
    model_labels = np.argmin(((x[:, None, :] - shifted[None]) ** 2).sum(-1), axis=1)
    assert np.mean(model_labels == truth) < 0.85
    if n_classes == 2:
        scores = np.where(model_labels == 1, 1.0, -1.0)[:, None] * 0.7
    else:
        scores = -np.ones((x.shape[0], n_classes))
        scores[np.arange(x.shape[0]), model_labels] = 0.4
    refined, relabelled = refine_scores(x, scores, seed=0)
    reg = _transfer_refine.REFINE_REG * float(np.mean(np.var(x, axis=0)))
    p = naive_em(x, model_labels, np.arange(n_classes), reg, iters=400)
    expected = (p[:, [1]] - p[:, [0]]) if n_classes == 2 else 2 * p - 1
    np.testing.assert_allclose(refined, expected, atol=1e-6)
    labels = (refined[:, 0] > 0).astype(int) if n_classes == 2 else refined.argmax(axis=1)
    assert relabelled == pytest.approx(np.mean(labels != model_labels), abs=1e-12)
    # As good as the Bayes rule of the true populations, up to estimation.
    cov = [[0.6, 0.3], [0.3, 0.5]]
    sizes = np.bincount(truth)
    bayes = np.argmax(
        [
            np.log(s) + multivariate_normal(c, cov).logpdf(x)
            for c, s in zip(centres, sizes, strict=True)
        ],
        axis=0,
    )
    accuracy, best = np.mean(labels == truth), np.mean(bayes == truth)
    assert accuracy >= best - 0.01 and accuracy > np.mean(model_labels == truth) + 0.1


def test_a_class_too_rare_to_fit_keeps_the_model_labels():
    """A population with fewer than d + 1 cells in the task keeps the model's scores,
    and no other cell is moved into it or out of the common ones into it."""
    rng = np.random.default_rng(1)
    x, truth, _ = clusters(rng, 2)
    x = np.vstack([x, [[8.0, 8.0], [8.5, 8.2]]])  # two cells of a third class, d = 2
    labels = np.concatenate([truth, [2, 2]])
    scores = -np.ones((x.shape[0], 3))
    scores[np.arange(x.shape[0]), labels] = 1.0
    refined, _ = refine_scores(x, scores, seed=0)
    np.testing.assert_array_equal(refined[-2:], scores[-2:])
    assert np.all(refined[:-2, 2] == -1.0)
    assert np.mean(refined[:-2].argmax(axis=1) == truth) > 0.98


def test_refinement_does_not_depend_on_cell_order_and_subsamples_large_tasks(monkeypatch):
    """Large tasks: the mixture is fitted on a seeded subsample and the cells are
    labelled in blocks; the same cells in any order give the same answer bit for bit,
    and the blocks change nothing beyond rounding."""
    monkeypatch.setattr(_transfer_refine, "REFINE_FIT_POINTS", 150)
    rng = np.random.default_rng(2)
    x, truth, _ = clusters(rng, 3)
    scores = -np.ones((x.shape[0], 3))
    scores[np.arange(x.shape[0]), truth] = 1.0
    whole, _ = refine_scores(x, scores, seed=5)
    monkeypatch.setattr(_transfer_refine, "REFINE_BLOCK", 64)
    refined, share = refine_scores(x, scores, seed=5)
    np.testing.assert_allclose(refined, whole, rtol=0, atol=1e-12)
    perm = rng.permutation(x.shape[0])
    again, share_again = refine_scores(x[perm], scores[perm], seed=5)
    np.testing.assert_array_equal(again, refined[perm])
    assert share == share_again
    # Another seed draws other cells to fit on: close, not the same.
    other, _ = refine_scores(x, scores, seed=6)
    assert not np.array_equal(other, refined)
    assert np.mean(other.argmax(1) == refined.argmax(1)) > 0.97


# ----------------------------------------------------------------- in the estimator
def _one_batch(n_cells=300):
    tasks, y, batches = make_batched_cytometry_tasks(2, 4, n_cells, random_state=[0, 1], strength=2)
    per = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    train, test = np.flatnonzero(batches == 0), np.flatnonzero(batches == 1)
    return (
        tasks[train],
        np.concatenate([per[t] for t in train]),
        tasks[test],
        [per[t] for t in test],
    )


def test_the_fallback_refines_new_batches_where_its_folds_show_it_helps():
    """Trained on one batch: the fallback refines (its folds do not show the mixture
    hurting on average: both err on none of their cells), every new-batch sample it
    answers reports the share
    it relabelled (the oracle: its labels with and without the refinement), and the new
    batch is labelled better than by the same model with refine="none"."""
    train, y, test, y_test = _one_batch(600)
    model = MarginalTransferClassifier(n_components=32, random_state=0).fit(train, y)
    plain = MarginalTransferClassifier(n_components=32, refine="none", random_state=0)
    plain.fit(train, y)
    record = model.selection_["normalisation"]["fallback_refine"]
    assert record["chosen"] == "mixture" == model.fallback_.refine_
    assert record["cv_error"]["mixture"] <= record["cv_error"]["none"]
    assert record["rule"] == "with it unless its mean fold error is higher"
    # The primary answers tasks like its folds': it refines only where they show a gain.
    assert model.selection_["refine"]["rule"] == "one standard error, without it first"
    # The disagreement bound counts the fallback as it answers: refined.
    np.testing.assert_array_equal(
        model.selection_["normalisation"]["fallback_fold_errors"], record["fold_errors"]["mixture"]
    )
    answers = model.predict_tasks(test)
    before = plain.predict_tasks(test)
    for a, b in zip(answers, before, strict=True):
        assert a.report.fallback and b.report.fallback
        assert a.report.relabelled == pytest.approx(np.mean(a.predictions != b.predictions))
    acc = np.mean([np.mean(a.predictions == t) for a, t in zip(answers, y_test, strict=True)])
    acc_plain = np.mean([np.mean(b.predictions == t) for b, t in zip(before, y_test, strict=True)])
    assert acc > acc_plain + 0.03 and acc > 0.99
    # A model that does not refine reports nothing.
    assert all(b.report.relabelled is None for b in before)


def test_a_threshold_through_one_population_is_not_refined():
    """Labels that cut one population in two (a gate on a continuum) are no mixture
    of Gaussians: the folds see the refinement hurt and keep the model as it is."""
    rng = np.random.default_rng(3)
    arrays = [rng.normal(size=(300, 2)) * [1.0, 0.5] + rng.normal(0, 0.1, 2) for _ in range(6)]
    labels = [(a[:, 0] + 0.3 * a[:, 1] > 0.2).astype(int) for a in arrays]
    model = MarginalTransferClassifier(
        n_components=32, normalise="none", point_kernel="linear", random_state=0
    ).fit(arrays, labels)
    record = model.selection_["refine"]
    assert record["chosen"] == "none" == model.refine_
    assert record["cv_error"]["mixture"] > record["cv_error"]["none"] + 0.02
    (answer,) = model.predict_tasks([arrays[0]])
    assert answer.report.relabelled is None


def test_refinement_fold_errors_match_models_refitted_on_each_fold():
    """The search's fold errors with and without the mixture equal, fold by fold, those
    of the same fixed model fitted on the fold's training tasks and its held-out tasks
    refined by refine_scores (the oracle, up to the fold solver's tolerance)."""
    train, y, _, _ = _one_batch(200)
    fixed = {
        "n_components": 32,
        "normalise": "standard",
        "point_bandwidth": 2.0,
        "tau": 1.0,
        "alpha": 1e-3,
        "cv_points": 10_000,
        "random_state": 0,
    }
    model = MarginalTransferClassifier(refine="auto", **fixed).fit(train, y)
    record = model.selection_["refine"]
    per = [y[train.offsets[t] : train.offsets[t + 1]] for t in range(len(train))]
    for f, (tr, va) in enumerate(model.selection_["folds"]):
        fold = MarginalTransferClassifier(refine="none", **fixed)
        fold.fit(train[tr], np.concatenate([per[t] for t in tr]))
        errs = {"none": [], "mixture": []}
        for v in va:
            scores = fold.decision_function(train[[v]])
            scores = scores[:, None] if scores.ndim == 1 else scores
            codes = np.searchsorted(fold.classes_, per[v])
            Y = -np.ones((codes.size, fold.classes_.size))
            Y[np.arange(codes.size), codes] = 1.0
            points = np.asarray(fold._normalise(train[[v]]).points)
            errs["none"].append(misclassification_rate(scores, Y))
            refined, _ = refine_scores(points, scores, model.seed_)
            errs["mixture"].append(misclassification_rate(refined, Y))
        for name in errs:
            assert record["fold_errors"][name][f] == pytest.approx(np.mean(errs[name]), abs=2e-3)


def test_refine_is_validated_and_saved(tmp_path):
    train, y, test, _ = _one_batch(150)
    with pytest.raises(ValueError, match="refine must be"):
        MarginalTransferClassifier(refine="gmm").fit(train, y)
    with pytest.raises(ValueError, match="classifiers only"):
        MarginalTransferRegressor(refine="mixture").fit(train, y.astype(float))
    model = MarginalTransferClassifier(
        n_components=32, normalise="standard", refine="mixture", random_state=0
    ).fit(train, y)
    assert model.refine_ == "mixture"
    save(model, tmp_path / "m")
    loaded = load(tmp_path / "m")
    assert loaded.refine_ == "mixture"
    a, b = model.predict_tasks(test), loaded.predict_tasks(test)
    for x, z in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.scores, z.scores)
        assert x.report.relabelled == z.report.relabelled is not None
    # The domain report carries it, NaN where no refinement ran.
    domain = model.domain_report([p.report for p in a])
    np.testing.assert_array_equal(domain.relabelled, [p.report.relabelled for p in a])
    assert domain.relabelled_of(0) == a[0].report.relabelled
    bags = Bags.from_arrays([np.asarray(t) for t in test])
    assert np.isnan(
        MarginalTransferClassifier(
            n_components=32, normalise="standard", refine="none", random_state=0
        )
        .fit(train, y)
        .domain_check(bags)
        .relabelled
    ).all()


def test_the_fallback_does_not_refine_where_its_folds_show_the_mixture_hurting():
    """Gated cells of samples emulated from the GvHD data (populations no Gaussian
    describes): the fallback's folds show the mixture raising the error on average, so
    it does not refine, and the new batch is labelled at least as well as by the same
    model refining (the oracle: the refinement forced on)."""
    from bagserve.core.datasets import emulate_batches, load_flowcap_gvhd

    from .conftest import SHARED_DATA

    sources, y, _ = load_flowcap_gvhd(SHARED_DATA / "flowcap1_gvhd")
    tasks, labels, batches, _ = emulate_batches(sources, y, 2, 8, 1000, random_state=2)

    def gated(which):
        xs, ys = [], []
        for t in np.flatnonzero(batches == which):
            v = labels[tasks.offsets[t] : tasks.offsets[t + 1]]
            xs.append(np.asarray(tasks[int(t)])[v != 0])
            ys.append(v[v != 0])
        return Bags.from_arrays(xs), ys

    train, y_train = gated(0)
    model = MarginalTransferClassifier(random_state=2).fit(train, np.concatenate(y_train))
    record = model.selection_["normalisation"]["fallback_refine"]
    assert record["rule"] == "with it unless its mean fold error is higher"
    assert record["cv_error"]["mixture"] > record["cv_error"]["none"]
    assert record["chosen"] == "none" == model.fallback_.refine_
    new, y_new = gated(1)

    def accuracy():
        answers = model.predict_tasks(new)
        assert any(a.report.fallback for a in answers)
        return np.mean([np.mean(a.predictions == v) for a, v in zip(answers, y_new, strict=True)])

    chosen = accuracy()
    model.fallback_.refine_ = "mixture"
    assert chosen >= accuracy()
