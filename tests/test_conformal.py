"""Conformal prediction on bags: closed-form leave-one-bag-out models against brute-force
refits, jackknife+ order statistics, simulated coverage, calibration, persistence."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from bagserve.core import (
    Bags,
    DistributionRidge,
    DistributionRidgeClassifier,
    MeanEmbedding,
    SlicedWasserstein,
    load,
    save,
)
from bagserve.core.conformal import jackknife_plus_ranks, jackknife_plus_set, softmax
from bagserve.core.datasets import make_entropy_bags, make_gmm_modes
from bagserve.core.representations.base import FeatureEmbedding
from bagserve.core.selection import GridEdgeWarning, ridge_selection_scores
from sklearn.exceptions import NotFittedError

from .conftest import random_bags


def _sw(seed: int = 0) -> SlicedWasserstein:
    return SlicedWasserstein(n_directions=10, n_levels=12, random_state=seed)


def _targets(bags: Bags) -> np.ndarray:
    return np.array([b[:, 0].mean() + np.std(b[:, 1]) for b in bags])


# Every path that stores leave-one-out state: the dual (kernel) solve with explicit and
# with point-based embeddings, the primal random-feature solve (n_components), the
# primal linear solve of narrow explicit features; with and without an intercept.
PATHS = {
    "dual-sw2": {"representation": _sw(), "gamma": 0.4, "alpha": 1e-3},
    "dual-sw1-matern": {
        "representation": SlicedWasserstein(p=1, n_directions=8, n_levels=10, random_state=0),
        "kernel": "matern32",
        "gamma": 0.3,
        "alpha": 1e-3,
    },
    "dual-mmd-exact": {"representation": MeanEmbedding(bandwidth=1.5), "gamma": 1.0, "alpha": 1e-3},
    "primal-rff": {"representation": _sw(), "gamma": 0.4, "alpha": 1e-3, "n_components": 30},
    "primal-linear": {
        "representation": MeanEmbedding(method="rff", n_components=8, random_state=0),
        "kernel": "linear",
        "alpha": 1e-3,
    },
}


def _brute_force_loo(model: DistributionRidge, train: Bags, Y: np.ndarray, at: Bags) -> np.ndarray:
    """``μ̂_{-i}(x)`` by refitting on ``T - 1`` bags: same fitted representation, same
    ``γ``, ``alpha`` rescaled so that the effective ridge ``alpha·T`` stays fixed."""
    T = len(train)
    emb = model.representation_.embed(train)
    out = []
    for i in range(T):
        keep = np.delete(np.arange(T), i)
        if isinstance(emb, FeatureEmbedding):
            sub = FeatureEmbedding(emb.features[keep], emb.geometry)
        else:  # the exact mean embedding keeps bags: embed the remaining ones
            sub = model.representation_.embed(train.take(keep))
        params = model.get_params(deep=False)
        params.update(gamma=model.gamma_, alpha=model.alpha_ * T / (T - 1))
        refit = DistributionRidge(**params).fit_embedded(model.representation_, sub, Y[keep])
        out.append(refit.predict(at).reshape(len(at), -1))
    return np.stack(out, axis=1)  # (n_bags, T, n_outputs)


@pytest.mark.parametrize("fit_intercept", [True, False])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_closed_form_loo_models_equal_brute_force_refits(rng, path, fit_intercept):
    train = random_bags(rng, n_bags=16, weighted=True)
    new = random_bags(rng, n_bags=7, sizes=(1, 50))
    y = _targets(train)
    Y = np.stack([y, np.sin(3 * y)], axis=1)
    model = DistributionRidge(**PATHS[path], fit_intercept=fit_intercept, random_state=0)
    model.fit(train, Y)
    assert model.primal_ == path.startswith("primal")
    ref = _brute_force_loo(model, train, Y, new)
    closed = model.loo_predict(new)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(closed, ref, rtol=1e-8, atol=1e-8 * scale)
    # At the training bags the left-out model's prediction is y_i - e_i.
    diag = np.arange(len(train))
    at_train = _brute_force_loo(model, train, Y, train)[diag, diag]
    np.testing.assert_allclose(model.loo_residuals_, Y - at_train, rtol=1e-8, atol=1e-8 * scale)
    # One output alone gives the same leave-one-out models (outputs are independent).
    single = DistributionRidge(**PATHS[path], fit_intercept=fit_intercept, random_state=0)
    single.fit(train, Y[:, 1])
    np.testing.assert_allclose(single.loo_predict(new), closed[:, :, 1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fit_intercept", [True, False])
def test_loo_residuals_are_those_the_selection_averages(rng, fit_intercept):
    """The stored residuals and the closed-form selection criterion are the same LOO."""
    train = random_bags(rng, n_bags=25)
    y = _targets(train)
    alphas = np.logspace(-4, 0, 5)
    # jackknife+ chosen explicitly: with a searched alpha the default calibration is CV+.
    model = DistributionRidge(
        _sw(), gamma=0.4, alpha=alphas, fit_intercept=fit_intercept, calibration="jackknife+"
    )
    with pytest.warns(GridEdgeWarning):
        model.fit(train, y)
    ai = int(np.flatnonzero(alphas == model.alpha_)[0])
    np.testing.assert_allclose(
        np.mean(model.loo_residuals_**2), model.selection_["score"][0, ai], rtol=1e-8
    )
    # ... and an independent evaluation of the criterion at the chosen alpha only.
    emb = model.representation_.embed(train)
    vals, vecs = np.linalg.eigh(model.kernel_(emb.sq_distances(), model.gamma_))
    (score,) = ridge_selection_scores(
        vals, vecs, y[:, None], np.array([model.alpha_]), fit_intercept=fit_intercept
    )
    np.testing.assert_allclose(np.mean(model.loo_residuals_**2), score, rtol=1e-8)


def _jackknife_plus_oracle(
    loo: np.ndarray,
    resid: np.ndarray,
    coverage: str,
    new_scale: np.ndarray | None = None,
    train_scale: np.ndarray | None = None,
) -> np.ndarray:
    """Barber et al. (2021) eq. 6 read literally: sort, index with exact rationals; with
    scales, the locally weighted residuals σ(x)·R_i/σ_i (Lei et al. 2018, §5.2)."""
    T = loo.shape[1]
    alpha = 1 - Fraction(coverage)
    k_lo = math.floor(alpha * (T + 1))
    k_hi = math.ceil((1 - alpha) * (T + 1))
    R = np.abs(resid)[None, :]
    if new_scale is not None:
        R = R / train_scale[None, :] * new_scale[:, None]
    lo = np.sort(loo - R, axis=1)
    hi = np.sort(loo + R, axis=1)
    lower = lo[:, k_lo - 1] if k_lo >= 1 else np.full(len(loo), -np.inf)
    upper = hi[:, k_hi - 1] if k_hi <= T else np.full(len(loo), np.inf)
    return np.stack([lower, upper], axis=1)


@pytest.mark.parametrize("n_bags", [9, 19, 20, 39])
@pytest.mark.parametrize("coverage", ["0.8", "0.9", "0.95"])
def test_interval_is_the_jackknife_plus_order_statistic(rng, n_bags, coverage):
    train = random_bags(rng, n_bags=n_bags)
    new = random_bags(rng, n_bags=6)
    model = DistributionRidge(_sw(), gamma=0.4, alpha=1e-3).fit(train, _targets(train))
    got = model.predict_interval(new, coverage=float(coverage))
    # The residuals are scaled by max(1, domain score): the new bags' against all
    # training bags, each training bag's against the others.
    new_scale = np.maximum(1.0, model.domain_check(new).score)
    train_scale = np.maximum(1.0, model.domain_scores_)
    resid = model.loo_residuals_[:, 0]
    ref = _jackknife_plus_oracle(model.loo_predict(new), resid, coverage, new_scale, train_scale)
    np.testing.assert_array_equal(got, ref)
    assert got.shape == (6, 2)
    plain = DistributionRidge(_sw(), gamma=0.4, alpha=1e-3, interval_scaling="none")
    plain.fit(train, _targets(train))
    ref = _jackknife_plus_oracle(plain.loo_predict(new), resid, coverage)
    np.testing.assert_array_equal(plain.predict_interval(new, coverage=float(coverage)), ref)


def test_ranks_survive_floating_point_coverage():
    # 1 - 0.9 = 0.0999…: a naive floor(α(T+1)) gives 1 instead of 2 for T = 19.
    assert jackknife_plus_ranks(19, 0.9) == (2, 18)
    assert jackknife_plus_ranks(99, 0.9) == (10, 90)
    assert jackknife_plus_ranks(99, 0.8) == (20, 80)
    assert jackknife_plus_ranks(8, 0.9) == (0, 9)  # fewer than 1/α - 1 models


def test_too_few_bags_give_unbounded_intervals_and_full_sets(rng):
    train = random_bags(rng, n_bags=8)
    y = _targets(train)
    model = DistributionRidge(_sw(), gamma=0.4, alpha=1e-3).fit(train, y)
    iv = model.predict_interval(train, coverage=0.9)
    assert np.all(iv[:, 0] == -np.inf) and np.all(iv[:, 1] == np.inf)
    assert np.all(np.isfinite(model.predict_interval(train, coverage=0.5)))
    labels = (y > np.median(y)).astype(int)
    clf = DistributionRidgeClassifier(_sw(), gamma=0.4, alpha=1e-3).fit(train, labels)
    assert clf.predict_set(train, coverage=0.9).all()


def test_multi_output_intervals_are_per_output(rng):
    train = random_bags(rng, n_bags=30)
    new = random_bags(rng, n_bags=5)
    y = _targets(train)
    Y = np.stack([y, -2 * y + 1], axis=1)
    both = DistributionRidge(_sw(), gamma=0.4, alpha=1e-3).fit(train, Y)
    iv = both.predict_interval(new, coverage=0.8)
    assert iv.shape == (5, 2, 2)
    for j in range(2):
        one = DistributionRidge(_sw(), gamma=0.4, alpha=1e-3).fit(train, Y[:, j])
        np.testing.assert_allclose(iv[:, j], one.predict_interval(new, 0.8), rtol=1e-10)


def test_chunks_and_batches_do_not_change_a_bags_interval(rng, monkeypatch):
    import bagserve.core.estimators._ridge_base as ridge

    train = random_bags(rng, n_bags=30)
    new = random_bags(rng, n_bags=11, sizes=(1, 40))
    model = DistributionRidge(_sw(), gamma=0.4, alpha=1e-3).fit(train, _targets(train))
    whole = model.predict_interval(new)
    alone = model.predict_interval(new[[4]])
    np.testing.assert_array_equal(whole[4], alone[0])
    # The leave-one-out values themselves (an order statistic can hide a last-bit change).
    np.testing.assert_array_equal(model.loo_predict(new)[4], model.loo_predict(new[[4]])[0])
    monkeypatch.setattr(ridge, "_LOO_CHUNK_ELEMENTS", 3 * 30)  # chunks of 3 bags
    np.testing.assert_array_equal(model.predict_interval(new), whole)
    np.testing.assert_array_equal(model.loo_predict(new)[4], model.loo_predict(new[[4]])[0])


@pytest.mark.parametrize("rep", ["sw2", "mmd-exact"])
def test_embedded_bags_give_the_same_answers_as_bags(rng, monkeypatch, rep):
    """The runtime embeds a request once and passes the embedding to every method."""
    import bagserve.core.estimators._ridge_base as ridge

    train = random_bags(rng, n_bags=30)
    new = random_bags(rng, n_bags=11, sizes=(1, 40))
    y = _targets(train)
    representation = _sw() if rep == "sw2" else MeanEmbedding(bandwidth=1.5)
    reg = DistributionRidge(representation, gamma=0.4, alpha=1e-3).fit(train, y)
    labels = np.digitize(y, np.quantile(y, [1 / 3, 2 / 3]))
    clf = DistributionRidgeClassifier(representation, gamma=0.4, alpha=1e-3).fit(train, labels)
    for chunk in (ridge._LOO_CHUNK_ELEMENTS, 3 * 30):  # one chunk, then chunks of 3 bags
        monkeypatch.setattr(ridge, "_LOO_CHUNK_ELEMENTS", chunk)
        emb = reg.representation_.embed(new)
        np.testing.assert_array_equal(reg.predict_interval(emb), reg.predict_interval(new))
        np.testing.assert_array_equal(reg.loo_predict(emb), reg.loo_predict(new))
        # The runtime passes its own domain check's scores: the same interval and set
        # as computing them again, and the scores are used (other scores, other answer).
        scores = reg.domain_check(emb).score
        np.testing.assert_array_equal(
            reg.predict_interval(emb, domain_scores=scores), reg.predict_interval(new)
        )
        wider = reg.predict_interval(emb, domain_scores=scores + 10.0)
        assert np.all(np.diff(wider, axis=1) > np.diff(reg.predict_interval(emb), axis=1))
        emb = clf.representation_.embed(new)
        np.testing.assert_array_equal(clf.predict_set(emb), clf.predict_set(new))
        np.testing.assert_array_equal(
            clf.predict_set(emb, domain_scores=clf.domain_check(emb).score), clf.predict_set(new)
        )
        np.testing.assert_array_equal(clf.predict_proba(emb), clf.predict_proba(new))


def test_bad_coverage_old_models_and_interpolation_are_refused(rng):
    train = random_bags(rng, n_bags=12)
    y = _targets(train)
    model = DistributionRidge(_sw(), gamma=0.4, alpha=1e-3).fit(train, y)
    for bad in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="coverage must be in"):
            model.predict_interval(train, coverage=bad)
    del model.loo_smoother_  # a model saved before the leave-one-out state existed
    with pytest.raises(NotFittedError, match="refit it"):
        model.predict_interval(train)
    assert model.predict(train).shape == (12,)  # predict() does not need that state
    # A leverage of 1 (interpolation) leaves a leave-one-out residual undefined.
    model = DistributionRidge(_sw(), gamma=0.4, alpha=1e-3).fit(train, y)
    model.loo_residuals_[3] = np.nan
    with pytest.raises(FloatingPointError, match="interpolates"):
        model.predict_interval(train)


# ---------------------------------------------------------------- coverage by simulation
#
# Jackknife+ guarantees ≥ 1 - 2α and, for a stable algorithm, gives about 1 - α. The
# theorem holds the algorithm fixed, so γ and λ are chosen once by the automatic LOO
# search on an independent pilot draw and then held fixed. Each configuration averages
# R = 20 independent training sets of T = 100 bags, each scored on 200 held-out bags
# (4,000 bags). The training-conditional coverage varies between repeats with a standard
# deviation of about 0.04-0.06 (measured: ≈ sqrt(α(1-α)/T) plus the test noise
# sqrt(α(1-α)/200)), so the average has a standard error of about 0.01: the ±0.05
# tolerance is four standard errors around 1 - α, while a method that ignored the
# leave-one-out residuals' spread (or used the wrong order statistic) misses it.
N_TRAIN, N_TEST, REPEATS = 100, 200, 20
COVERAGE_TOL = 0.05


def _sw_sim(seed: int) -> SlicedWasserstein:
    return SlicedWasserstein(n_directions=20, n_levels=20, random_state=seed)


def _entropy(seed: int) -> tuple[Bags, np.ndarray]:
    return make_entropy_bags(N_TRAIN + N_TEST, 100, random_state=seed)


def _gmm(seed: int) -> tuple[Bags, np.ndarray]:
    return make_gmm_modes(N_TRAIN + N_TEST, 100, max_components=4, dim=2, random_state=seed)


def _split(bags: Bags, y: np.ndarray) -> tuple[Bags, np.ndarray, Bags, np.ndarray]:
    return (
        bags.take(np.arange(N_TRAIN)),
        y[:N_TRAIN],
        bags.take(np.arange(N_TRAIN, N_TRAIN + N_TEST)),
        y[N_TRAIN:],
    )


@pytest.mark.parametrize("n_components", [None, 100])
def test_jackknife_plus_intervals_cover_on_rotated_gaussian_entropy(n_components):
    tr, ytr, _, _ = _split(*_entropy(1000))
    pilot = DistributionRidge(_sw_sim(1000), n_components=n_components, random_state=1000)
    pilot.fit(tr, ytr)
    hits = {0.8: [], 0.9: []}
    for r in range(REPEATS):
        tr, ytr, te, yte = _split(*_entropy(r))
        model = DistributionRidge(
            _sw_sim(r),
            gamma=pilot.gamma_,
            alpha=pilot.alpha_,
            n_components=n_components,
            random_state=r,
        ).fit(tr, ytr)
        for c in hits:
            iv = model.predict_interval(te, coverage=c)
            hits[c].append((iv[:, 0] <= yte) & (yte <= iv[:, 1]))
    for c, h in hits.items():
        assert abs(np.mean(h) - c) < COVERAGE_TOL, (c, np.mean(h))


def test_jackknife_plus_sets_cover_on_gmm_modes():
    tr, ytr, _, _ = _split(*_gmm(1000))
    pilot = DistributionRidgeClassifier(_sw_sim(1000)).fit(tr, ytr)
    hits = {0.8: [], 0.9: []}
    sizes = {0.8: [], 0.9: []}
    for r in range(REPEATS):
        tr, ytr, te, yte = _split(*_gmm(r))
        model = DistributionRidgeClassifier(_sw_sim(r), gamma=pilot.gamma_, alpha=pilot.alpha_).fit(
            tr, ytr
        )
        codes = np.searchsorted(model.classes_, yte)
        for c in hits:
            sets = model.predict_set(te, coverage=c)
            hits[c].append(sets[np.arange(N_TEST), codes])
            sizes[c].append(sets.sum(axis=1))
    for c, h in hits.items():
        assert abs(np.mean(h) - c) < COVERAGE_TOL, (c, np.mean(h))
    # Informative: smaller on average than the data-blind set of the same coverage (all
    # 4 classes with probability 1 - α, mean size 4(1 - α)), and growing with coverage.
    assert np.mean(sizes[0.8]) < np.mean(sizes[0.9])
    for c, size in sizes.items():
        assert np.mean(size) < 4 * c - 0.5, (c, np.mean(size))


def test_prediction_sets_are_the_jackknife_plus_count_rule(rng):
    train = random_bags(rng, n_bags=30)
    new = random_bags(rng, n_bags=8)
    y = _targets(train)
    labels = np.digitize(y, np.quantile(y, [1 / 3, 2 / 3]))
    model = DistributionRidgeClassifier(_sw(), gamma=0.4, alpha=1e-3).fit(train, labels)
    loo = model._loo_decision(new)  # (n, T, C)
    # Oracle from the definitions: E_i = 1 - (LOO score of the true class at bag i),
    # computed here from brute-force refits of the one-hot regression.
    onehot = np.eye(3)[labels]
    reg = DistributionRidge(_sw(), gamma=0.4, alpha=1e-3).fit(train, onehot)
    at_train = _brute_force_loo(reg, train, onehot, train)
    E = 1.0 - at_train[np.arange(30), np.arange(30), labels]
    np.testing.assert_allclose(model.loo_nonconformity_, E, rtol=1e-8, atol=1e-10)
    new_scale = np.maximum(1.0, model.domain_check(new).score)[:, None, None]
    train_scale = np.maximum(1.0, model.domain_scores_)[None, :, None]
    for cov in (0.7, 0.9):
        count = (E[None, :, None] / train_scale < (1.0 - loo) / new_scale).sum(axis=1)
        np.testing.assert_array_equal(model.predict_set(new, cov), count < cov * 31)
    sets = model.predict_set(new, 0.9)
    assert [list(s) for s in model.set_labels(sets)] == [list(np.flatnonzero(r)) for r in sets]


def test_set_rule_at_the_boundary_count():
    # n = 9 models, coverage 0.8: (1-α)(n+1) = 8, so a label beaten by 7 of the
    # leave-one-out scores stays in the set and one beaten by 8 leaves it.
    loo_scores = np.arange(9, dtype=float)  # E_i = 0..8
    new = np.empty((1, 9, 3))
    new[0, :, 0] = 6.5  # strictly above E_0..E_6: beaten count 7
    new[0, :, 1] = 7.5  # count 8
    new[0, :, 2] = 7.0  # ties do not count: E_i < 7 for i = 0..6, count 7
    np.testing.assert_array_equal(jackknife_plus_set(new, loo_scores, 0.8), [[True, False, True]])
    # At coverage 0.9 the bound is 9 = n: only a label beaten by every model leaves.
    new[0, :, 1] = 9.0
    np.testing.assert_array_equal(jackknife_plus_set(new, loo_scores, 0.9), [[True, False, True]])


def test_calibrated_probabilities_beat_raw_softmax_and_keep_the_decision():
    logloss_cal, logloss_raw = [], []
    for r in range(5):
        tr, ytr, te, yte = _split(*_gmm(r))
        model = DistributionRidgeClassifier(_sw_sim(r)).fit(tr, ytr)
        proba = model.predict_proba(te)
        np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=0, atol=1e-12)
        assert np.all(proba >= 0)
        np.testing.assert_array_equal(model.classes_[proba.argmax(axis=1)], model.predict(te))
        codes = np.searchsorted(model.classes_, yte)
        raw = softmax(model._decision(te))
        logloss_cal.append(-np.mean(np.log(proba[np.arange(N_TEST), codes])))
        logloss_raw.append(-np.mean(np.log(raw[np.arange(N_TEST), codes])))
        assert model.proba_scale_ > 1.0  # one-hot scores in [0, 1] need sharpening
    assert np.mean(logloss_cal) < np.mean(logloss_raw) - 0.05, (logloss_cal, logloss_raw)
    # Calibration in the large: the mean top probability matches the accuracy.
    conf, acc = [], []
    for r in range(5, 10):
        tr, ytr, te, yte = _split(*_gmm(r))
        model = DistributionRidgeClassifier(_sw_sim(r)).fit(tr, ytr)
        proba = model.predict_proba(te)
        conf.append(proba.max(axis=1).mean())
        acc.append(np.mean(model.predict(te) == yte))
    assert abs(np.mean(conf) - np.mean(acc)) < 0.06, (np.mean(conf), np.mean(acc))


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("n_components", [None, 24])
def test_saved_models_give_identical_intervals_sets_and_probabilities(
    tmp_path, rng, mmap, n_components
):
    train = random_bags(rng, n_bags=25)
    new = random_bags(rng, n_bags=6, sizes=(1, 40))
    y = _targets(train)
    reg = DistributionRidge(_sw(), n_components=n_components, random_state=0).fit(train, y)
    labels = np.digitize(y, np.quantile(y, [1 / 3, 2 / 3]))
    clf = DistributionRidgeClassifier(_sw(), n_components=n_components, random_state=0)
    clf.fit(train, labels)
    for name, model in (("reg", reg), ("clf", clf)):
        again = load(save(model, tmp_path / f"{name}{mmap}"), mmap=mmap)
        assert model.calibration_ == again.calibration_ == "cv+"  # gamma and alpha searched
        for attr in ("cv_fold_", "cv_gamma_", "cv_alpha_", "cv_coef_", "cv_residuals_"):
            a, b = getattr(model, attr), getattr(again, attr)
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        if name == "reg":
            np.testing.assert_array_equal(
                again.predict_interval(new, 0.8), model.predict_interval(new, 0.8)
            )
        else:
            np.testing.assert_array_equal(again.loo_nonconformity_, model.loo_nonconformity_)
            assert again.proba_scale_ == model.proba_scale_
            np.testing.assert_array_equal(again.predict_set(new, 0.8), model.predict_set(new, 0.8))
            np.testing.assert_array_equal(again.predict_proba(new), model.predict_proba(new))
