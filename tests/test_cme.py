"""Conditional mean embeddings (paper 002): oracles from ridge regression and closed forms."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from bagserve.core import ConditionalMeanEmbedding, SlicedWasserstein, load, save
from bagserve.core.datasets import make_pendulum_transitions
from bagserve.core.estimators.cme import incomplete_cholesky
from sklearn.exceptions import ConvergenceWarning
from sklearn.kernel_ridge import KernelRidge
from sklearn.model_selection import GridSearchCV


def test_linear_output_kernel_is_kernel_ridge(rng):
    X = rng.normal(size=(60, 3))
    Y = np.column_stack([np.sin(X[:, 0]), X[:, 1] ** 2]) + 0.1 * rng.normal(size=(60, 2))
    cme = ConditionalMeanEmbedding(gamma=0.5, alpha=1e-2, output_kernel="linear").fit(X, Y)
    krr = KernelRidge(alpha=1e-2 * 60, kernel="rbf", gamma=0.5).fit(X, Y)
    Xq = rng.normal(size=(7, 3))
    np.testing.assert_allclose(cme.predict(Xq), krr.predict(Xq), rtol=1e-9, atol=1e-11)
    # The conditional mean does not depend on the output kernel.
    gauss = ConditionalMeanEmbedding(gamma=0.5, alpha=1e-2).fit(X, Y)
    np.testing.assert_allclose(gauss.predict(Xq), krr.predict(Xq), rtol=1e-9, atol=1e-11)


def test_linear_kernels_on_both_sides_are_ridge_regression(rng):
    X = rng.normal(size=(40, 4))
    Y = X @ rng.normal(size=(4, 2)) + 0.1 * rng.normal(size=(40, 2))
    lam = 0.3
    cme = ConditionalMeanEmbedding(
        kernel="linear", output_kernel="linear", alpha=lam, alpha_scaling="sum"
    ).fit(X, Y)
    Xq = rng.normal(size=(5, 4))
    ridge = Xq @ np.linalg.solve(X.T @ X + lam * np.eye(4), X.T @ Y)
    np.testing.assert_allclose(cme.predict(Xq), ridge, rtol=1e-10, atol=1e-12)


def test_delta_kernel_gives_group_weights_one_over_m_plus_lambda(rng):
    # A Gaussian kernel this narrow on integer inputs is the delta kernel.
    x = np.repeat([0.0, 10.0, 20.0], [3, 5, 2])[:, None]
    y = rng.normal(size=10)
    lam = 0.5
    cme = ConditionalMeanEmbedding(gamma=50.0, alpha=lam, alpha_scaling="sum").fit(x, y)
    beta = cme.weights(np.array([[10.0]]))[0]
    expected = np.where(x[:, 0] == 10.0, 1 / (5 + lam), 0.0)
    np.testing.assert_allclose(beta, expected, atol=1e-12)
    np.testing.assert_allclose(cme.expectation([[10.0]], y), [y[3:8].sum() / (5 + lam)])


def test_the_two_lambda_scalings_agree(rng):
    X, Y = rng.normal(size=(30, 2)), rng.normal(size=30)
    a = ConditionalMeanEmbedding(gamma=1.0, alpha=0.01, alpha_scaling="n").fit(X, Y)
    b = ConditionalMeanEmbedding(gamma=1.0, alpha=0.01 * 30, alpha_scaling="sum").fit(X, Y)
    Xq = rng.normal(size=(4, 2))
    np.testing.assert_allclose(a.weights(Xq), b.weights(Xq), rtol=1e-10)


def test_cv_loss_matrix_form_equals_explicit_features(rng):
    """Polynomial output kernel (y y' + 1)²: explicit features (y², √2 y, 1)."""
    X, y = rng.normal(size=(40, 2)), rng.normal(size=40)
    cme = ConditionalMeanEmbedding(
        gamma=0.7,
        alpha=np.array([1e-3, 1e-1]),
        output_kernel="polynomial",
        output_gamma=1.0,
        output_kernel_params={"degree": 2, "coef0": 1.0},
        n_folds=4,
        random_state=3,
    ).fit(X, y)
    phi = np.column_stack([y**2, np.sqrt(2) * y, np.ones_like(y)])
    folds = np.array_split(np.random.default_rng(3).permutation(40), 4)
    for a, alpha in enumerate([1e-3, 1e-1]):
        total = 0.0
        for val in folds:
            tr = np.setdiff1d(np.arange(40), val)
            fold = ConditionalMeanEmbedding(gamma=0.7, alpha=alpha, output_kernel="linear").fit(
                X[tr], phi[tr]
            )
            total += np.sum((fold.predict(X[val]) - phi[val]) ** 2)
        assert cme.cv_scores_[0, a] == pytest.approx(total / 40, rel=1e-9)
    # score() is the same loss on any held-out set, negated for GridSearchCV.
    explicit = ConditionalMeanEmbedding(gamma=0.7, alpha=1e-3, output_kernel="linear").fit(
        X[:30], phi[:30]
    )
    poly = ConditionalMeanEmbedding(
        gamma=0.7,
        alpha=1e-3,
        output_kernel="polynomial",
        output_gamma=1.0,
        output_kernel_params={"degree": 2, "coef0": 1.0},
    ).fit(X[:30], y[:30])
    direct = np.mean(np.sum((explicit.predict(X[30:]) - phi[30:]) ** 2, axis=1))
    assert -poly.score(X[30:], y[30:]) == pytest.approx(direct, rel=1e-9)


def test_cv_curve_is_u_shaped_and_gridsearch_works(rng):
    X = rng.uniform(-3, 3, size=(150, 1))
    y = np.sin(2 * X[:, 0]) + 0.3 * rng.normal(size=150)
    cme = ConditionalMeanEmbedding(gamma=1.0, random_state=0).fit(X, y)
    curve = cme.cv_scores_[0]
    best = int(np.argmin(curve))
    assert 0 < best < curve.size - 1, curve
    assert curve[0] > curve[best] and curve[-1] > curve[best]
    search = GridSearchCV(
        ConditionalMeanEmbedding(gamma=1.0, output_gamma=cme.output_gamma_),
        {"alpha": [1e-6, 1e-3, 1.0]},
        cv=3,
    ).fit(X, y)
    assert search.best_params_["alpha"] == 1e-3


def test_distributional_answers_and_coverage_on_heteroscedastic_data(rng):
    """Y | x ~ N(sin x, (0.1 + 0.3|x|)²): the 10%-90% interval covers about 80%."""

    def draw(n):
        x = rng.uniform(-2, 2, size=n)
        return x[:, None], np.sin(x) + (0.1 + 0.3 * np.abs(x)) * rng.normal(size=n)

    X, y = draw(1000)
    Xt, yt = draw(2000)
    # An input kernel narrow enough to resolve sin(x): nominal 80% within 3 points
    # (sampling sd ≈ 0.9 points at n = 2000).
    narrow = ConditionalMeanEmbedding(gamma=32.0, alpha=1e-4).fit(X, y)
    q = narrow.quantiles(Xt, [0.1, 0.9])
    assert abs(((yt >= q[:, 0]) & (yt <= q[:, 1])).mean() - 0.8) < 0.03
    # The kernel chosen by the paper's criterion is wider, and the positive part of the
    # weights then spreads mass: intervals are conservative, never too narrow.
    cme = ConditionalMeanEmbedding(gamma=np.array([0.5, 2, 8, 32]), random_state=0)
    cme.fit(X, y)
    q = cme.quantiles(Xt, [0.1, 0.5, 0.9])
    inside = (yt >= q[:, 0]) & (yt <= q[:, 2])
    assert 0.78 < inside.mean() < 0.9, inside.mean()
    # Heteroscedasticity is captured: intervals are wider far from 0.
    width = q[:, 2] - q[:, 0]
    assert width[np.abs(Xt[:, 0]) > 1.5].mean() > 2 * width[np.abs(Xt[:, 0]) < 0.3].mean()
    # CDF: monotone, in [0, 1], consistent with quantiles and exceedance.
    t = np.linspace(-3, 3, 25)
    F = cme.cdf(Xt[:50], t)
    assert np.all(np.diff(F, axis=1) >= -1e-12) and F.min() >= 0 and F.max() <= 1 + 1e-12
    np.testing.assert_allclose(cme.exceedance(Xt[:50], t), 1 - F)
    # summary() shares one weight computation and gives the same numbers.
    mean, qs, ex = cme.summary(Xt[:50], [0.1, 0.5, 0.9], t)
    np.testing.assert_array_equal(mean, cme.predict(Xt[:50]))
    np.testing.assert_array_equal(qs, q[:50])
    np.testing.assert_allclose(ex, 1 - F, rtol=0, atol=1e-15)
    assert np.all(cme.cdf(Xt[:50], q[:50, 1]).diagonal() >= 0.5 - 1e-9)


def test_negative_weights_are_handled_as_stated(rng):
    X, y = rng.normal(size=(40, 1)), rng.normal(size=40)
    cme = ConditionalMeanEmbedding(gamma=3.0, alpha=1e-6).fit(X, y)
    Xq = np.array([[0.3], [50.0]])
    raw = cme.weights(Xq)
    assert (raw[0] < 0).any()  # small ridge: the raw weights are signed
    w = cme.distribution_weights(Xq)
    np.testing.assert_allclose(w[0], np.maximum(raw[0], 0) / np.maximum(raw[0], 0).sum())
    # Far from every input: no positive weight, the marginal of the training outputs.
    np.testing.assert_allclose(w[1], np.full(40, 1 / 40))
    with pytest.raises(ValueError, match="scalar output"):
        ConditionalMeanEmbedding(gamma=1.0, alpha=0.1).fit(X, np.c_[y, y]).cdf(Xq, [0.0])


def test_sparse_solver_objective_monotone_sparsity_and_dense_limit():
    X, Y = make_pendulum_transitions(80, random_state=0)
    cme = ConditionalMeanEmbedding(gamma=0.5, alpha=1e-3, output_gamma=0.5).fit(X, Y)
    dense = cme.sparsify(0.0)
    np.testing.assert_allclose(dense.dual_, cme.dual_, rtol=1e-10, atol=1e-12)
    previous_nnz, previous_dist = np.inf, -np.inf
    for gamma in [1e-4, 1e-3, 1e-2]:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConvergenceWarning)  # converged, KKT-checked
            sp = cme.sparsify(gamma, max_iter=5000, tol=1e-4)
        history = np.array(sp.sparse_info_["objective"])
        assert np.all(np.diff(history) <= 1e-12 * abs(history[0]) + 1e-15)
        nnz = np.count_nonzero(sp.dual_)
        dist = sp.distance_to_dense()
        assert nnz <= previous_nnz and dist >= previous_dist - 1e-12
        previous_nnz, previous_dist = nnz, dist
        # Predictions use only the support's rows, and agree with the full product.
        Xq, _ = make_pendulum_transitions(5, random_state=1)
        np.testing.assert_allclose(
            sp.weights(Xq), cme.kernel_matrix(Xq) @ sp.dual_, rtol=1e-10, atol=1e-12
        )
    assert previous_nnz < cme.dual_.size / 2
    with pytest.warns(ConvergenceWarning, match="KKT residual"):
        cme.sparsify(1e-3, max_iter=3)


def test_incomplete_cholesky_pivots_and_restriction(rng):
    X = rng.normal(size=(50, 2))
    cme = ConditionalMeanEmbedding(gamma=0.5, alpha=1e-3).fit(X, rng.normal(size=50))
    K = cme.kernel_matrix(X)
    piv = incomplete_cholesky(K, 50)
    assert len(set(piv.tolist())) == piv.size
    # The residual of the Nyström approximation on the pivots shrinks with the rank.
    errs = []
    for r in (5, 15, 30):
        S = piv[:r]
        approx = K[:, S] @ np.linalg.solve(K[np.ix_(S, S)], K[S])
        errs.append(np.trace(K - approx))
    assert errs[0] > errs[1] > errs[2] >= -1e-8
    restricted = cme.restrict(piv[:15])
    assert set(restricted.support_.tolist()) == set(piv[:15].tolist())
    all_rows = cme.restrict(np.arange(50))
    assert all_rows.distance_to_dense() < 1e-8 * np.abs(cme.dual_).max()


def test_bags_as_inputs_and_artifact_round_trip(rng, tmp_path):
    bags = [rng.normal(loc=m, size=(200, 2)) for m in np.linspace(-1, 1, 30)]
    y = np.linspace(-1, 1, 30) + 0.05 * rng.normal(size=30)
    cme = ConditionalMeanEmbedding(
        SlicedWasserstein(n_directions=20, n_levels=20), random_state=0
    ).fit(bags, y)
    q = cme.quantiles(bags[:3], [0.1, 0.9])
    assert np.all(q[:, 0] <= q[:, 1])
    back = load(save(cme, tmp_path / "cme"))
    np.testing.assert_array_equal(back.predict(bags[:5]), cme.predict(bags[:5]))
    np.testing.assert_array_equal(back.quantiles(bags[:3], [0.1, 0.9]), q)
    with pytest.warns(ConvergenceWarning):  # a round trip needs no converged solution
        sp = cme.sparsify(1e-3, max_iter=200)
    back = load(save(sp, tmp_path / "sparse"))
    np.testing.assert_array_equal(back.predict(bags[:5]), sp.predict(bags[:5]))
