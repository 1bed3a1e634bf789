"""Marginal transfer learning (paper 004): kernels, solvers, special cases, robustness."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import (
    Bags,
    BagValidationError,
    MarginalTransferClassifier,
    MarginalTransferRegressor,
    MeanEmbedding,
    SlicedWasserstein,
)
from bagserve.core.datasets import make_ellipse_tasks
from bagserve.core.estimators._transfer_solvers import (
    _assemble,
    _kronecker_inverse,
    _kronecker_preconditioner,
    _structured_pcg,
    structured_ridge_path,
    weighted_svm,
    weighted_svr,
)
from bagserve.core.selection import leave_tasks_out_folds
from sklearn.base import clone
from sklearn.kernel_ridge import KernelRidge
from sklearn.linear_model import Ridge

# The paper's model (eq. 8): Gaussian k_X and no normalisation, which these tests
# check against their oracles; the defaults (linear part, normalisation chosen by
# CV) have their own tests below.
PAPER = {"point_kernel": "gaussian", "normalise": "none", "refine": "none"}
# Every hyperparameter fixed, the embedding's bandwidth included: no search.
FIXED = {
    **PAPER,
    "point_bandwidth": 0.3,
    "task_gamma": 2.0,
    "alpha": 1e-4,
    "tau": 0.2,
    "embedding": MeanEmbedding(bandwidth=0.3),
}


@pytest.fixture(scope="module")
def ellipses():
    tasks, y, _ = make_ellipse_tasks(8, 40, random_state=0)
    return tasks, y


def task_labels(tasks: Bags, y: np.ndarray, t: int) -> np.ndarray:
    return y[tasks.offsets[t] : tasks.offsets[t + 1]]


# ----------------------------------------------------------------- kernel algebra
def test_product_gram_is_symmetric_psd_with_unit_task_kernel_diagonal(ellipses):
    tasks, y = ellipses
    model = MarginalTransferClassifier(solver="exact", loss="squared", **FIXED).fit(tasks, y)
    K = model.joint_kernel(tasks)
    np.testing.assert_allclose(K, K.T, atol=1e-12)
    assert np.linalg.eigvalsh(K).min() >= -1e-10 * np.trace(K)
    # Points of one task paired with themselves: k_P(P, P) = 1, so k̄ = k_X there.
    rep = model.joint_kernel(tasks[[0]])
    from bagserve.core.kernels import point_kernel

    np.testing.assert_allclose(rep, point_kernel(tasks[0], tasks[0], "gaussian", 0.3), rtol=1e-12)


def test_task_embedding_ignores_order_and_duplicating_a_whole_sample(ellipses):
    tasks, y = ellipses
    model = MarginalTransferClassifier(**FIXED).fit(tasks, y)
    x = tasks[3]
    perm = np.random.default_rng(0).permutation(x.shape[0])
    r0, r1, r2 = model.task_report([x, x[perm], np.tile(x, (2, 1))])
    assert r0.distance == pytest.approx(0.0, abs=1e-7)
    assert r0.distance == pytest.approx(r1.distance, abs=1e-12)
    assert r2.distance == pytest.approx(r0.distance, abs=1e-7)
    assert r0.nearest_tasks[0] == 3 and r0.similarities[0] == pytest.approx(1.0)


# ----------------------------------------------------------------- solvers vs oracles
def test_weighted_kernel_ridge_equals_sklearn_with_sample_weights(ellipses):
    tasks, _ = ellipses
    model = MarginalTransferRegressor(solver="exact", loss="squared", **FIXED)
    target = tasks.points[:, 0] ** 2 - tasks.points[:, 1]
    model.fit(tasks, target)
    K = model.joint_kernel(tasks)
    c = np.repeat(1.0 / (len(tasks) * tasks.sizes), tasks.sizes)
    ref = KernelRidge(kernel="precomputed", alpha=FIXED["alpha"]).fit(K, target, sample_weight=c)
    np.testing.assert_allclose(model.dual_coef_[:, 0], ref.dual_coef_, rtol=1e-6, atol=1e-8)
    new = make_ellipse_tasks(2, 30, random_state=5)[0]
    np.testing.assert_allclose(
        model.predict(new), ref.predict(model.joint_kernel(new, tasks)), rtol=1e-8, atol=1e-9
    )


def test_svm_dual_solution_satisfies_kkt(rng):
    X = rng.normal(size=(60, 2))
    y = np.where(X[:, 0] + 0.3 * rng.normal(size=60) > 0, 1.0, -1.0)
    K = np.exp(-((X[:, None] - X[None]) ** 2).sum(-1))
    c = rng.uniform(0.5, 1.5, size=60) / 60
    lam = 1e-3
    r = weighted_svm(K, y, c, lam)
    alpha = r * y * 2 * lam
    margin = y * (K @ r)
    tol = 1e-4
    assert np.all(alpha >= -1e-12) and np.all(alpha <= c + 1e-12)
    free = (alpha > 1e-6 * c) & (alpha < c * (1 - 1e-6))
    assert np.all(margin[alpha <= 1e-6 * c] >= 1 - tol)
    assert np.all(np.abs(margin[free] - 1) <= tol)
    assert np.all(margin[alpha >= c * (1 - 1e-6)] <= 1 + tol)
    # Zero duality gap: primal objective equals the dual objective.
    primal = np.sum(c * np.maximum(0, 1 - margin)) + lam * r @ K @ r
    dual = alpha.sum() - (alpha * y) @ K @ (alpha * y) / (4 * lam)
    assert primal == pytest.approx(dual, rel=1e-5)


def test_svr_dual_solution_satisfies_kkt(rng):
    X = rng.normal(size=(50, 1))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=50)
    K = np.exp(-((X - X.T) ** 2))
    c = np.full(50, 1 / 50)
    lam, eps = 1e-3, 0.1
    r = weighted_svr(K, y, c, lam, eps)
    beta = 2 * lam * r
    resid = y - K @ r
    tol = 1e-4
    inside = np.abs(beta) <= 1e-6 * c
    assert np.all(np.abs(resid[inside]) <= eps + tol)
    at_bound = np.abs(beta) >= c * (1 - 1e-6)
    assert np.all(np.abs(resid[at_bound]) >= eps - tol)
    primal = np.sum(c * np.maximum(0, np.abs(resid) - eps)) + lam * r @ K @ r
    dual = y @ beta - eps * np.abs(beta).sum() - beta @ K @ beta / (4 * lam)
    assert primal == pytest.approx(dual, rel=1e-5)


@pytest.mark.parametrize("size_limit", [10**6, 1])
def test_structured_ridge_equals_dense_ridge_on_joint_features(rng, monkeypatch, size_limit):
    # size_limit=1 forces the preconditioned conjugate-gradient path.
    monkeypatch.setattr("bagserve.core.estimators._transfer_solvers._EIGEN_MAX_SIZE", size_limit)
    N, a, D, k = 5, 3, 6, 2
    S = rng.normal(size=(N, a))
    Z = [rng.normal(size=(n, D)) for n in (4, 7, 5, 9, 3)]
    Y = [rng.normal(size=(z.shape[0], k)) for z in Z]
    c = [np.full(z.shape[0], 1 / (N * z.shape[0])) for z in Z]
    A = np.stack([(z * w[:, None]).T @ z for z, w in zip(Z, c, strict=True)])
    B = np.stack([(z * w[:, None]).T @ yy for z, w, yy in zip(Z, c, Y, strict=True)])
    lams = np.array([1e-3, 0.1])
    thetas = structured_ridge_path(S, A, B, lams)
    Phi = np.concatenate([np.kron(S[i][None, :], z) for i, z in enumerate(Z)])
    for lam, theta in zip(lams, thetas, strict=True):
        ref = Ridge(alpha=lam, fit_intercept=False).fit(
            Phi, np.concatenate(Y), sample_weight=np.concatenate(c)
        )
        np.testing.assert_allclose(theta.reshape(a * D, k), ref.coef_.T, rtol=1e-7, atol=1e-9)
    G = _assemble(S, A)
    np.testing.assert_allclose(G, Phi.T @ (Phi * np.concatenate(c)[:, None]), rtol=1e-10)


@pytest.mark.parametrize("tau", [0.0, 0.3])
def test_kronecker_preconditioner_inverts_systems_of_one_covariance(rng, tau):
    """With one feature covariance for every task the preconditioner is the system's
    exact inverse (oracle: the dense matrix of ``_assemble``); with different ones it is
    not, and conjugate gradients still solve the system (oracle: a dense solve)."""
    N, D, k, lam = 5, 6, 2, 0.05
    S = np.hstack([np.full((N, 1), np.sqrt(1 - tau) + 0.1), rng.normal(size=(N, 3))])
    a = S.shape[1]
    Z = rng.normal(size=(40, D))
    same = np.repeat((Z.T @ Z / 40)[None], N, axis=0)
    theta = rng.normal(size=(a, D, k))
    for A, exact in ((same, True), (same + np.abs(rng.normal(size=(N, 1, 1))) * np.eye(D), False)):
        G = _assemble(S, A) + lam * np.eye(a * D)
        inverse = _kronecker_inverse(_kronecker_preconditioner(S, A), lam, k)
        back = inverse((G @ theta.reshape(a * D, k)).reshape(a, D, k))
        assert np.allclose(back, theta, rtol=1e-9, atol=1e-9) == exact
        rhs = G @ theta.reshape(a * D, k)
        solved = _structured_pcg(S, A, rhs.reshape(a, D, k), lam, np.zeros((a, D, k)))
        np.testing.assert_allclose(solved.reshape(a * D, k), theta.reshape(a * D, k), rtol=1e-8)


# ----------------------------------------------------------------- special cases
def test_pooling_with_equal_task_sizes_is_one_pooled_model(ellipses):
    tasks, y = ellipses
    exact = MarginalTransferClassifier(
        **PAPER, solver="exact", loss="squared", pooling=True, point_bandwidth=0.3, alpha=1e-3
    ).fit(tasks, y)
    from bagserve.core.kernels import point_kernel

    K = point_kernel(tasks.points, tasks.points, "gaussian", 0.3)
    M = tasks.n_points
    ref = KernelRidge(kernel="precomputed", alpha=1e-3 * M).fit(K, np.where(y > 0, 1.0, -1.0))
    new = make_ellipse_tasks(3, 25, random_state=9)[0]
    Kn = point_kernel(new.points, tasks.points, "gaussian", 0.3)
    np.testing.assert_allclose(exact.decision_function(new), ref.predict(Kn), rtol=1e-7, atol=1e-9)
    rf = MarginalTransferClassifier(
        **PAPER, pooling=True, point_bandwidth=0.3, alpha=1e-3, random_state=0
    )
    rf.fit(tasks, y)
    Z = rf.joint_features(tasks)
    ridge = Ridge(alpha=1e-3 * M, fit_intercept=False).fit(Z, np.where(y > 0, 1.0, -1.0))
    np.testing.assert_allclose(
        rf.decision_function(new), rf.joint_features(new) @ ridge.coef_, rtol=1e-7, atol=1e-9
    )


@pytest.mark.parametrize("loss", ["squared", "hinge"])
def test_duplicating_a_task_leaves_the_exact_objective_unchanged(ellipses, loss):
    tasks, y = ellipses
    twice = Bags.from_arrays([np.tile(tasks[0], (2, 1)), *list(tasks)[1:]])
    y2 = np.concatenate([np.tile(task_labels(tasks, y, 0), 2), y[tasks.offsets[1] :]])
    new = make_ellipse_tasks(2, 30, random_state=4)[0]
    # FIXED holds the embedding bandwidth: a median heuristic would see the duplicates.
    params = FIXED
    a = MarginalTransferClassifier(solver="exact", loss=loss, **params).fit(tasks, y)
    b = MarginalTransferClassifier(solver="exact", loss=loss, **params).fit(twice, y2)
    tol = 1e-7 if loss == "squared" else 2e-3
    np.testing.assert_allclose(b.decision_function(new), a.decision_function(new), atol=tol)


# ----------------------------------------------------------------- random features
@pytest.mark.parametrize("task_map", ["nystroem", "rff"])
def test_random_feature_gram_converges_to_exact_product_gram(ellipses, task_map):
    tasks, y = ellipses
    sub = tasks[[0, 3, 5]]
    params = {"point_bandwidth": 0.5, "task_gamma": 2.0, "alpha": 1e-3}
    if task_map == "nystroem":
        params["tau"] = 0.3
    errors = []
    for D in (32, 1024):
        emb = (
            MeanEmbedding(bandwidth=0.3)
            if task_map == "nystroem"
            else MeanEmbedding(bandwidth=0.3, method="rff", n_components=D, random_state=1)
        )
        rf = MarginalTransferClassifier(
            **PAPER, task_map=task_map, embedding=emb, n_components=D, random_state=0, **params
        ).fit(tasks, y)
        exact = MarginalTransferClassifier(
            **PAPER,
            solver="exact",
            loss="squared",
            embedding=MeanEmbedding(bandwidth=0.3),
            tau=params.get("tau", 0.0),
            **{k: v for k, v in params.items() if k != "tau"},
        ).fit(tasks, y)
        F = rf.joint_features(sub)
        errors.append(np.abs(F @ F.T - exact.joint_kernel(sub)).mean())
    assert errors[1] < errors[0] / 4
    assert errors[1] < 0.02


# ----------------------------------------------------------------- model selection
def test_leave_tasks_out_folds_partition_tasks():
    folds = leave_tasks_out_folds(11, n_splits=4, n_repeats=3, random_state=0)
    assert len(folds) == 12
    for r in range(3):
        vals = np.concatenate([folds[4 * r + f][1] for f in range(4)])
        np.testing.assert_array_equal(np.sort(vals), np.arange(11))
        for train, val in folds[4 * r : 4 * r + 4]:
            assert np.intersect1d(train, val).size == 0
            assert np.union1d(train, val).size == 11


def test_validation_tasks_never_reach_the_fold_training_side(ellipses, monkeypatch):
    """No fold-side fit sees a held-out task's points or labels; the bandwidths' median
    heuristics, which use no label, are taken on all the tasks' points as the final
    model's are."""
    from bagserve.core.estimators import _transfer_cv

    tasks, y = ellipses
    # Task 7 moved far away: any fold-side fit that saw its points would show them.
    shifted = Bags.from_arrays([*list(tasks)[:-1], tasks[7] + 1000.0])
    # Folds one at a time, so that the embeddings are fitted in fold order (on threads
    # they finish in any order; tests/test_transfer_concurrency.py checks that folds on
    # threads compute what they compute alone).
    monkeypatch.setattr(_transfer_cv, "n_threads_for", lambda n_jobs: 1)
    seen: list[float] = []
    original = MarginalTransferClassifier._fit_embedding

    def spy(self, emb_tasks, factor, base=None):
        seen.append(float(np.abs(emb_tasks.points).max()))
        return original(self, emb_tasks, factor, base)

    monkeypatch.setattr(MarginalTransferClassifier, "_fit_embedding", spy)
    sigma_fits: list[float] = []
    original_sigma = MarginalTransferClassifier._sigma_value

    def spy_sigma(self, spec, points):
        sigma_fits.append(float(np.abs(points).max()))
        return original_sigma(self, spec, points)

    monkeypatch.setattr(MarginalTransferClassifier, "_sigma_value", spy_sigma)
    bases: list[float] = []
    original_base = MarginalTransferClassifier._embedding_bandwidth

    def spy_base(self, emb_tasks):
        bases.append(float(np.abs(emb_tasks.points).max()))
        return original_base(self, emb_tasks)

    monkeypatch.setattr(MarginalTransferClassifier, "_embedding_bandwidth", spy_base)
    model = MarginalTransferClassifier(
        **PAPER, alpha=[1e-4, 1e-2], tau=[0.2], task_gamma=[1.0], cv=4, random_state=0
    ).fit(shifted, y)
    folds = model.selection_["folds"]
    # The search fits one embedding per (fold, bandwidth factor), folds in order; the
    # last fit is the final model's, on every task.
    assert len(seen) > len(folds) and seen[-1] > 500
    for j, value in enumerate(seen[:-1]):
        assert (value > 500) == (7 in folds[j % len(folds)][0])
    # The label-free scale heuristic is the exception, on purpose: the point bandwidth's
    # median is computed once, on all the tasks' points, as the final model's is, so
    # that every fold evaluates the bandwidth the model gets (and shares its features).
    assert sigma_fits == [sigma_fits[-1]] * len(sigma_fits) and sigma_fits[-1] > 500
    assert len(bases) == 1 and bases[0] > 500  # the task embedding's median, likewise


def regression_tasks(n_tasks: int = 10, n_points: int = 30) -> tuple[Bags, np.ndarray]:
    """Tasks whose target depends on the point and on where its task sits."""
    rng = np.random.default_rng(0)
    arrays, targets = [], []
    for _ in range(n_tasks):
        shift = rng.uniform(-1.0, 1.0)
        x = rng.normal(size=(n_points, 2)) * rng.uniform(0.5, 1.5) + shift
        targets.append(
            shift * np.sin(2.0 * x[:, 0]) + 0.5 * x[:, 1] + 0.3 * rng.normal(size=n_points)
        )
        arrays.append(x)
    return Bags.from_arrays(arrays), np.concatenate(targets)


def coordinate_search_visits(
    sigmas: list[float], taus: list[float], gammas: list[float]
) -> set[tuple[float, float, float | None]]:
    """Configurations the coordinate-wise search evaluates *whatever wins each step*.

    The documented order (``coordinate_search``): (1) the pooled model (``τ = 1``) at
    every point bandwidth; (2) at the winner's bandwidth, every ``τ < 1`` with the
    middle ``γ_P``; (3) every ``γ_P`` at the winning ``τ``; (4) the embedding bandwidth
    (fixed here). The intersection over every possible winner of steps 1 and 2 is what
    is surely visited. Pooled configurations have no ``γ_P`` (``None``).
    """
    others = [t for t in taus if t != 1.0]
    middle = gammas[len(gammas) // 2]
    surely: set[tuple[float, float, float | None]] = {(s, 1.0, None) for s in sigmas}
    if others:
        visited = None
        for s1 in sigmas:
            for t2 in others:
                seen = {(s1, t, middle) for t in others} | {(s1, t2, g) for g in gammas}
                visited = seen if visited is None else visited & seen
        assert visited is not None
        surely |= visited
    return surely


# Grids the coordinate-wise search covers whole: several point bandwidths of the pooled
# model; one bandwidth and every share of pooling; one share and every γ_P.
SEARCH_GRIDS = {
    "bandwidths": {"point_bandwidth": [0.15, 0.3, 0.6], "tau": [1.0], "task_gamma": [2.0]},
    "shares": {"point_bandwidth": [0.3], "tau": [0.0, 0.3, 1.0], "task_gamma": [2.0]},
    "task_kernel": {"point_bandwidth": [0.3], "tau": [0.3, 1.0], "task_gamma": [0.5, 4.0]},
}
SEARCH_ALPHAS = [1e-5, 1e-3, 1e-1]
SEARCH_MODELS = {
    "regressor_exact": lambda: MarginalTransferRegressor(**PAPER, solver="exact", loss="squared"),
    "regressor_random_features": lambda: MarginalTransferRegressor(**PAPER, n_components=16),
    "classifier_random_features": lambda: MarginalTransferClassifier(**PAPER, n_components=16),
}


@pytest.mark.parametrize("grid", sorted(SEARCH_GRIDS))
@pytest.mark.parametrize("estimator", sorted(SEARCH_MODELS))
def test_search_picks_the_brute_force_leave_tasks_out_minimum(ellipses, estimator, grid):
    """The chosen configuration minimises the leave-tasks-out error of real refits.

    The oracle uses the public API only: for every configuration of the grid, every
    ``λ`` and every fold (rebuilt from the documented fold maker and the model's
    ``seed_``), a fresh estimator with those fixed hyperparameters is fitted on the
    fold's training tasks (so its embedding is fitted on them alone) and scores each
    held-out task on all its points, as the search does when ``cv_points`` exceeds
    every task: mean squared error (regression) or the share of points whose score
    has the wrong sign (classification), averaged over the fold's held-out tasks and
    then over folds.
    """
    tasks, y = regression_tasks() if estimator.startswith("regressor") else ellipses
    spec = SEARCH_GRIDS[grid]
    model = (
        SEARCH_MODELS[estimator]()
        .set_params(
            # A fixed embedding bandwidth: no embedding-bandwidth search (step 3).
            embedding=MeanEmbedding(bandwidth=0.5),
            alpha=SEARCH_ALPHAS,
            cv=4,
            random_state=0,
            **spec,
        )
        .fit(tasks, y)
    )
    # Held-out tasks are scored on all their points: no validation subsample.
    assert tasks.sizes.max() <= model.cv_points
    sigmas, taus, gammas = spec["point_bandwidth"], spec["tau"], spec["task_gamma"]
    configs = {(s, t, None if t == 1.0 else g) for s in sigmas for t in taus for g in gammas}
    assert coordinate_search_visits(sigmas, taus, gammas) == configs

    folds = leave_tasks_out_folds(len(tasks), model.cv, model.cv_repeats, model.seed_)
    brute = {}
    for sigma, tau, gamma in configs:
        for alpha in SEARCH_ALPHAS:
            fold_errors = []
            for train, val in folds:
                refit = clone(model).set_params(
                    point_bandwidth=sigma,
                    tau=tau,
                    # Pooled configurations ignore the task kernel.
                    task_gamma=gammas[0] if gamma is None else gamma,
                    alpha=alpha,
                )
                refit.fit(tasks[train], np.concatenate([task_labels(tasks, y, t) for t in train]))
                task_errors = []
                for v in val:
                    yv = task_labels(tasks, y, v)
                    if estimator.startswith("regressor"):
                        task_errors.append(np.mean((refit.predict(tasks[[v]]) - yv) ** 2))
                    else:
                        sign = np.where(yv == refit.classes_[1], 1.0, -1.0)
                        wrong = np.sign(refit.decision_function(tasks[[v]])) != sign
                        task_errors.append(np.mean(wrong))
                fold_errors.append(np.mean(task_errors))
            brute[(sigma, tau, gamma, alpha)] = np.mean(fold_errors)

    lowest = min(brute.values())
    assert lowest < max(brute.values()), "the grid must tell configurations apart"
    winners = {k for k, e in brute.items() if e <= lowest * (1 + 1e-9)}
    chosen = (model.point_bandwidth_, model.tau_, model.task_gamma_, model.alpha_)
    assert chosen in winners, (chosen, sorted(winners), lowest)


# ----------------------------------------------------------------- behaviour
def test_marginal_transfer_beats_pooling_on_ellipses():
    tasks, y, _ = make_ellipse_tasks(16, 64, random_state=1)
    test, yt, _ = make_ellipse_tasks(5, 2000, random_state=2)
    mtl = MarginalTransferClassifier(
        **PAPER, point_bandwidth=0.3, task_gamma=None, tau=[0.0], alpha=[1e-5, 1e-3], random_state=0
    ).fit(tasks, y)
    pool = MarginalTransferClassifier(
        **PAPER, pooling=True, alpha=[1e-5, 1e-3], random_state=0
    ).fit(tasks, y)
    err_mtl = np.mean(mtl.predict(test) != yt)
    err_pool = np.mean(pool.predict(test) != yt)
    assert err_mtl < 0.15 < 0.25 < err_pool


def test_same_input_same_labels_and_cell_order_does_not_matter(ellipses):
    tasks, y = ellipses
    model = MarginalTransferClassifier(embedding_points=15, random_state=0, **FIXED).fit(tasks, y)
    new = make_ellipse_tasks(1, 300, random_state=3)[0][0]
    perm = np.random.default_rng(1).permutation(300)
    a = model.predict(new)
    np.testing.assert_array_equal(a, model.predict(new))
    np.testing.assert_array_equal(model.predict(new[perm]), a[perm])
    assert a.shape == (300,) and set(np.unique(a)) <= {-1, 1}


def test_far_task_is_flagged_and_falls_back_to_the_pooled_part(ellipses):
    tasks, y = ellipses
    # γ_P relative to the median heuristic (searched), so k_P decays on the tasks' scale.
    # The embedding bandwidth from the median heuristic too: the MMD is bounded, so a
    # too narrow inner kernel would make every task look alike.
    # The task as it arrives (no calibration): what the pooled part alone answers.
    params = {**FIXED, "task_gamma": None, "alpha": [1e-4], "embedding": MeanEmbedding()}
    model = MarginalTransferClassifier(random_state=0, calibrate="none", **params)
    model.fit(tasks, y)
    near = make_ellipse_tasks(1, 200, random_state=11)[0][0]
    # A new instrument: every marker scaled and offset.
    far = near * 3.0 + np.array([4.0, -2.0])
    r_near, r_far = model.task_report([near, far])
    assert not r_near.out_of_range and r_far.out_of_range
    assert r_far.similarities[0] < 1e-3 < 0.5 < r_near.similarities[0]
    (pred,) = model.predict_tasks([far])
    # k_P ≈ 0, so the scores are the shared part √τ w_0ᵀ z(x) alone.
    Z = model._point_features(far, model.point_bandwidth_)
    shared = np.sqrt(model.tau_) * Z @ model.coef_[0]
    np.testing.assert_allclose(pred.scores, shared[:, 0], atol=1e-3 * np.abs(shared).max())
    assert pred.report.out_of_range


def test_multiclass_and_list_labels(rng):
    arrays = [rng.normal(size=(30, 2)) + t * 0.1 for t in range(5)]
    labels = [np.digitize(a[:, 0], [-0.5, 0.5]) for a in arrays]
    model = MarginalTransferClassifier(random_state=0, **FIXED).fit(arrays, labels)
    np.testing.assert_array_equal(model.classes_, [0, 1, 2])
    scores = model.decision_function(arrays[:2])
    assert scores.shape == (60, 3)
    acc = np.mean(model.predict(arrays) == np.concatenate(labels))
    assert acc > 0.8


def test_regressor_exact_svr_and_random_features(rng):
    arrays = [rng.normal(size=(40, 2)) for _ in range(6)]
    shifts = np.linspace(-1, 1, 6)
    arrays = [a + s for a, s in zip(arrays, shifts, strict=True)]
    # The target depends on the point and on its task's mean.
    targets = [a[:, 0] - a.mean(0)[0] for a in arrays]
    for solver in ("exact", "random_features"):
        model = MarginalTransferRegressor(
            **PAPER,
            solver=solver,
            embedding=MeanEmbedding(bandwidth=1.0),
            point_bandwidth=1.0,
            task_gamma=1.0,
            alpha=1e-4,
            tau=0.0,
            epsilon=0.01,
            random_state=0,
        ).fit(arrays, targets)
        pred = model.predict(arrays)
        rmse = np.sqrt(np.mean((pred - np.concatenate(targets)) ** 2))
        assert rmse < 0.3 * np.std(np.concatenate(targets)), solver


# ----------------------------------------------------------------- errors
def test_clear_errors(ellipses, rng):
    tasks, y = ellipses
    model = MarginalTransferClassifier(**FIXED).fit(tasks, y)
    with pytest.raises(
        BagValidationError, match=r"3 marker column\(s\) but the model was fitted on 2"
    ):
        model.predict(rng.normal(size=(10, 3)))
    with pytest.raises(BagValidationError, match=r"bag 1 is empty"):
        model.predict([rng.normal(size=(5, 2)), np.zeros((0, 2))])
    with pytest.raises(BagValidationError, match="task 1 has a single point"):
        MarginalTransferClassifier(**FIXED).fit([tasks[0], tasks[1][:1]], y[: tasks.sizes[0] + 1])
    with pytest.raises(BagValidationError, match="task 0 has a single point"):
        model.predict([rng.normal(size=(1, 2))])
    with pytest.raises(ValueError, match="Euclidean feature vectors"):
        MarginalTransferClassifier(
            task_map="rff", **{k: v for k, v in FIXED.items() if k != "tau"}
        ).fit(tasks, y)
    with pytest.raises(BagValidationError, match=r"got 5 label\(s\) for 320 point\(s\)"):
        MarginalTransferClassifier(**FIXED).fit(tasks, y[:5])
    with pytest.raises(BagValidationError, match="task 0: 3 label"):
        MarginalTransferClassifier(**FIXED).fit(list(tasks)[:2], [y[:3], y[:40]])
    with pytest.raises(ValueError, match="random-feature solver fits a weighted ridge"):
        MarginalTransferClassifier(**PAPER, loss="hinge").fit(tasks, y)
    with pytest.raises(BagValidationError, match="max_exact_points"):
        MarginalTransferClassifier(solver="exact", max_exact_points=100, **FIXED).fit(tasks, y)
    # The paper's two-layer map has no pooling share, whether as tau or as pooling=True.
    for pooled in ({"tau": 0.5}, {"pooling": True}):
        with pytest.raises(ValueError, match="task_map='rff' has no pooling share"):
            MarginalTransferClassifier(**PAPER, task_map="rff", **pooled).fit(tasks, y)


def test_any_representation_embeds_tasks(ellipses):
    tasks, y = ellipses
    params = {**FIXED, "embedding": SlicedWasserstein(n_directions=20, n_levels=20)}
    model = MarginalTransferClassifier(random_state=0, **params).fit(tasks, y)
    assert np.mean(model.predict(tasks) == y) > 0.8


@pytest.mark.parametrize("dual_eigen_min_lambdas", [10**6, 0])
def test_dual_and_primal_task_ridge_agree(rng, monkeypatch, dual_eigen_min_lambdas):
    from bagserve.core.estimators._transfer_solvers import TaskStatistics, task_ridge_path

    N, a, D, k = 6, 4, 20, 2
    S = rng.normal(size=(N, a))
    Z = [rng.normal(size=(n, D)) for n in (3, 5, 2, 4, 6, 3)]
    Y = [rng.normal(size=(z.shape[0], k)) for z in Z]
    A = np.stack([z.T @ z / z.shape[0] for z in Z])
    B = np.stack([z.T @ y / z.shape[0] for z, y in zip(Z, Y, strict=True)])
    tasks = np.array([0, 2, 3, 5])
    lams = np.array([1e-4, 1e-1])
    monkeypatch.setattr("bagserve.core.estimators._transfer_solvers._EIGEN_MAX_SIZE", 1)
    # 10**6 forces the per-λ Cholesky branch of the dual, 0 the eigendecomposition.
    monkeypatch.setattr(
        "bagserve.core.estimators._transfer_solvers._DUAL_EIGEN_MIN_LAMBDAS",
        dual_eigen_min_lambdas,
    )
    dual = task_ridge_path(S[tasks], TaskStatistics(A, B, Z, Y), tasks, lams)
    primal = task_ridge_path(S[tasks], TaskStatistics(A, B), tasks, lams)
    # The primal here runs conjugate gradients to a relative residual of 1e-12; with
    # λ = 1e-4 the conditioning leaves up to ~1e-6 relative error in θ.
    for d, p in zip(dual, primal, strict=True):
        np.testing.assert_allclose(d, p, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("solver", ["random_features", "exact"])
@pytest.mark.parametrize("refine", ["none", "mixture"])
def test_scores_do_not_depend_on_batch_or_cell_order_bit_for_bit(ellipses, solver, refine):
    tasks, y = ellipses
    params = {**FIXED, "loss": "squared"} if solver == "exact" else FIXED
    params = {**params, "refine": refine}
    model = MarginalTransferClassifier(solver=solver, random_state=0, **params).fit(tasks, y)
    new = make_ellipse_tasks(3, 200, random_state=8)[0]
    alone = model.decision_function(new[[1]])
    np.testing.assert_array_equal(model.decision_function(new)[200:400], alone)
    perm = np.random.default_rng(0).permutation(200)
    np.testing.assert_array_equal(model.decision_function(new[1][perm]), alone[perm])


def test_per_task_standardisation_is_part_of_the_model(tmp_path):
    """normalise="standard" equals the same model on tasks standardised beforehand
    (the oracle: numpy's mean and std per task), is blind to a per-task affine change
    of the markers, and survives saving."""
    from bagserve.core import load, save
    from bagserve.core.bags import standardise_each_bag

    rng = np.random.default_rng(0)
    tasks, y, _ = make_ellipse_tasks(8, 60, random_state=1)
    new, _, _ = make_ellipse_tasks(2, 80, random_state=2)
    arrays = [np.asarray(t) for t in new]
    manual = [(a - a.mean(axis=0)) / a.std(axis=0) for a in arrays]
    np.testing.assert_allclose(
        np.asarray(standardise_each_bag(new).points), np.vstack(manual), rtol=1e-12
    )
    params = {
        "point_bandwidth": 1.0,
        "tau": 0.3,
        "alpha": 1e-3,
        "task_gamma": 1.0,
        "random_state": 0,
    }
    model = MarginalTransferClassifier(normalise="standard", **params).fit(tasks, y)
    plain = MarginalTransferClassifier(normalise="none", **params).fit(
        standardise_each_bag(tasks), y
    )
    np.testing.assert_allclose(
        model.decision_function(new), plain.decision_function(manual), rtol=1e-9, atol=1e-12
    )
    # A batch effect x -> a * x + b per marker (a > 0) on a new task changes nothing.
    a, b = rng.uniform(0.5, 2.0, size=2), rng.normal(0, 3, size=2)
    moved = [a * x + b for x in arrays]
    np.testing.assert_allclose(
        model.decision_function(moved), model.decision_function(arrays), rtol=1e-8, atol=1e-10
    )
    again = load(save(model, tmp_path / "m"))
    assert again.normalise == "standard"
    np.testing.assert_array_equal(again.predict(new), model.predict(new))
    with pytest.raises(ValueError, match="normalise must be"):
        MarginalTransferClassifier(normalise="median", **params).fit(tasks, y)
