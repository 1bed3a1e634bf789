"""Mean embeddings: exact blocked sums against naive double sums; RFF / Nyström convergence."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from bagserve.core import Bags, MeanEmbedding
from bagserve.core.representations.mean import _median_distance, set_kernel_gram
from scipy.spatial.distance import cdist, pdist

from .conftest import random_bags


def naive_set_kernel(bags: Bags, kernel: str, sigma: float) -> np.ndarray:
    """Σ_i Σ_j c_i c'_j k(x_i, x'_j), one pair of bags at a time."""
    T = len(bags)
    G = np.empty((T, T))
    for a in range(T):
        for b in range(T):
            if kernel == "gaussian":
                K = np.exp(-cdist(bags[a], bags[b], "sqeuclidean") / (2 * sigma**2))
            else:
                K = np.exp(-cdist(bags[a], bags[b], "cityblock") / sigma)
            G[a, b] = bags.bag_weights(a) @ K @ bags.bag_weights(b)
    return G


@pytest.mark.parametrize("kernel", ["gaussian", "laplace"])
@pytest.mark.parametrize("weighted", [False, True])
def test_exact_gram_equals_naive_double_sum(rng, kernel, weighted):
    bags = random_bags(rng, n_bags=7, sizes=(3, 30), weighted=weighted)
    me = MeanEmbedding(kernel=kernel, bandwidth=1.7).fit(bags)
    emb = me.embed(bags)
    naive = naive_set_kernel(bags, kernel, 1.7)
    np.testing.assert_allclose(emb.inner(), naive, rtol=1e-12)
    mmd2 = np.diag(naive)[:, None] + np.diag(naive)[None, :] - 2 * naive
    np.testing.assert_allclose(emb.sq_distances(), np.maximum(mmd2, 0), atol=1e-12)
    assert np.all(np.diag(emb.sq_distances()) == 0)


def test_tiny_blocks_cut_across_bags_give_the_same_gram(rng):
    A = random_bags(rng, n_bags=6, sizes=(2, 25), weighted=True)
    B = random_bags(rng, n_bags=4, sizes=(5, 9))
    full = set_kernel_gram(A, B, "gaussian", 1.3)
    # 7 x 7 blocks: chunk edges fall inside bags on both sides.
    np.testing.assert_allclose(
        set_kernel_gram(A, B, "gaussian", 1.3, block_entries=49), full, rtol=1e-12
    )
    sym = set_kernel_gram(A, None, "gaussian", 1.3, block_entries=49)
    np.testing.assert_allclose(sym, set_kernel_gram(A, A, "gaussian", 1.3), rtol=1e-12)


def test_cross_embedding_distances_match_naive(rng):
    train = random_bags(rng, n_bags=5, sizes=(10, 20))
    test = random_bags(rng, n_bags=3, sizes=(1, 40), weighted=True)
    me = MeanEmbedding(bandwidth=0.9).fit(train)
    D = me.embed(test).sq_distances(me.embed(train))
    both = Bags(
        np.concatenate([test.points, train.points]),
        np.concatenate([test.offsets, train.offsets[1:] + test.n_points]),
        np.concatenate([test.point_weights(), train.point_weights()]),
    )
    G = naive_set_kernel(both, "gaussian", 0.9)
    s = np.diag(G)
    expected = s[:3, None] + s[None, 3:] - 2 * G[:3, 3:]
    np.testing.assert_allclose(D, expected, atol=1e-12)


def test_exact_embedding_invariant_to_order_and_duplication(rng):
    x = rng.normal(size=(30, 2))
    y = rng.normal(size=(20, 2))
    me = MeanEmbedding(bandwidth=1.0).fit([x])
    D = me.embed([x, x[rng.permutation(30)], np.tile(x, (3, 1)), y]).sq_distances()
    assert D[0, 1] == pytest.approx(0, abs=1e-13)
    assert D[0, 2] == pytest.approx(0, abs=1e-13)
    assert D[0, 3] > 0.01


def test_gaussian_bags_analytic_mmd(rng):
    # E k(X, Y) for X ~ N(m1, s1² I), Y ~ N(m2, s2² I) and a Gaussian kernel of width σ
    # (paper 003 digest §9): (σ²/(σ² + s1² + s2²))^{d/2} exp(-‖Δ‖² / (2(σ² + s1² + s2²))).
    d, sigma, n = 2, 1.0, 400
    m1, m2, s1, s2 = np.zeros(d), np.array([0.8, -0.3]), 0.7, 1.1

    def ek(sa, sb, delta):
        v = sigma**2 + sa**2 + sb**2
        return (sigma**2 / v) ** (d / 2) * np.exp(-delta @ delta / (2 * v))

    kpp, kqq, kpq = ek(s1, s1, np.zeros(d)), ek(s2, s2, np.zeros(d)), ek(s1, s2, m1 - m2)
    mmd2 = kpp + kqq - 2 * kpq
    # The V-statistic is biased upwards by (1 - E k_PP)/n + (1 - E k_QQ)/n.
    expected = mmd2 + (1 - kpp) / n + (1 - kqq) / n
    est = []
    for _ in range(30):
        X = m1 + s1 * rng.standard_normal((n, d))
        Y = m2 + s2 * rng.standard_normal((n, d))
        est.append(MeanEmbedding(bandwidth=sigma).fit([X]).embed([X, Y]).sq_distances()[0, 1])
    est = np.array(est)
    assert abs(est.mean() - expected) < 4 * est.std(ddof=1) / np.sqrt(est.size)


@pytest.mark.parametrize("kernel", ["gaussian", "laplace"])
def test_random_fourier_features_converge_to_exact(rng, kernel):
    bags = random_bags(rng, n_bags=8, sizes=(20, 40))
    exact = MeanEmbedding(kernel=kernel, bandwidth=2.0).fit(bags).embed(bags).inner()
    errors = []
    for D in (100, 1000, 20000):
        F = MeanEmbedding(
            kernel=kernel, bandwidth=2.0, method="rff", n_components=D, random_state=0
        ).fit_transform(bags)
        assert F.shape == (8, D)
        errors.append(np.abs(F @ F.T - exact).max())
    assert errors[2] < errors[0] / 4
    assert errors[2] < 0.02


def test_nystroem_is_exact_with_all_points_and_converges(rng):
    bags = random_bags(rng, n_bags=6, sizes=(10, 20), weighted=True)
    exact = MeanEmbedding(bandwidth=1.5).fit(bags).embed(bags).inner()
    full = MeanEmbedding(bandwidth=1.5, method="nystroem", n_components=10_000, random_state=0).fit(
        bags
    )
    F = full.transform(bags)
    np.testing.assert_allclose(F @ F.T, exact, atol=1e-6)
    errors = []
    for m in (5, 20, 60):
        F = MeanEmbedding(
            bandwidth=1.5, method="nystroem", n_components=m, random_state=0
        ).fit_transform(bags)
        errors.append(np.abs(F @ F.T - exact).max())
    assert errors[2] < errors[0]


def test_median_heuristic_bandwidth(rng):
    bags = random_bags(rng, n_bags=4, sizes=(10, 20))
    me = MeanEmbedding().fit(bags)
    d = cdist(bags.points, bags.points)
    assert me.bandwidth_ == pytest.approx(np.median(d[np.triu_indices_from(d, 1)]))


@pytest.mark.parametrize("kernel", ["gaussian", "laplace"])
@pytest.mark.parametrize("n", [2, 3, 4, 7, 40, 2500])
def test_median_distance_is_the_median_of_positive_distances(kernel, n):
    """The median heuristic's selection of ranks, against ``np.median`` of the positive
    distances (``scipy``'s ``pdist``, subsampled as above 2,000 points), to the last
    bit: odd and even counts, duplicated points (zero distances first), all points
    the same (no positive distance: 1)."""
    metric = "cityblock" if kernel == "laplace" else "euclidean"
    data = np.random.default_rng(n)
    for duplicates in (0, n // 2, n):
        points = data.standard_normal((n, 3))
        points[:duplicates] = points[0]
        value = _median_distance(points, kernel, np.random.default_rng(5))
        sub = points
        if n > 2000:
            sub = points[np.random.default_rng(5).choice(n, 2000, replace=False)]
        d = pdist(sub, metric=metric)
        expected = float(np.median(d[d > 0])) if np.any(d > 0) else 1.0
        assert value == expected


def test_exact_gram_memory_stays_bounded(rng):
    # 10,000 points: the full point Gram would take 800 MB.
    bags = random_bags(rng, n_bags=20, sizes=(500, 501))
    tracemalloc.start()
    set_kernel_gram(bags, None, "gaussian", 1.0, block_entries=1 << 16)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 20 * 2**20


def test_exact_method_has_no_feature_vector(bags):
    with pytest.raises(TypeError, match="no finite feature vector"):
        MeanEmbedding().fit(bags).transform(bags)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"kernel": "cosine"}, "kernel"),
        ({"method": "fastfood"}, "method"),
        ({"bandwidth": -1.0}, "bandwidth"),
        ({"method": "rff", "n_components": 1}, "n_components"),
    ],
)
def test_invalid_parameters(bags, params, message):
    with pytest.raises(ValueError, match=message):
        MeanEmbedding(**params).fit(bags)


@pytest.mark.parametrize("kernel", ["gaussian", "laplace"])
@pytest.mark.parametrize("weighted", [False, True])
def test_several_bandwidths_in_one_pass(rng, kernel, weighted):
    bags = random_bags(rng, n_bags=6, sizes=(5, 30), weighted=weighted)
    # A geometric part (powers of the widest kernel) and an irregular value.
    sigmas = [0.5, 4.0, 2.0, 2.0 / np.sqrt(2), 1.7]
    stacked = set_kernel_gram(bags, None, kernel, sigmas, block_entries=400)
    assert stacked.shape == (5, 6, 6)
    for s, G in zip(sigmas, stacked, strict=True):
        np.testing.assert_allclose(G, naive_set_kernel(bags, kernel, s), rtol=1e-11)
    other = random_bags(rng, n_bags=3, sizes=(1, 9))
    cross = set_kernel_gram(other, bags, kernel, sigmas)
    single = set_kernel_gram(other, bags, kernel, sigmas[3])
    np.testing.assert_allclose(cross[3], single, rtol=1e-11)


@pytest.mark.parametrize("block_entries", [1, 2, 10, 49, 400, 4000])
@pytest.mark.parametrize("kernel", ["gaussian", "laplace"])
def test_every_block_grid_counts_each_point_pair_once(rng, block_entries, kernel):
    """Row chunks are shorter than column chunks: the symmetric Gram skips the blocks
    below the diagonal and mirrors those above it, which is exact only if every point
    pair is counted once (directly or mirrored), whatever the grid."""
    bags = random_bags(rng, n_bags=9, sizes=(1, 40), weighted=True)
    naive = naive_set_kernel(bags, kernel, 1.1)
    sym = set_kernel_gram(bags, None, kernel, 1.1, block_entries=block_entries)
    np.testing.assert_allclose(sym, naive, rtol=1e-12)
    np.testing.assert_allclose(
        set_kernel_gram(bags, None, kernel, 1.1, block_entries=block_entries, n_jobs=2),
        naive,
        rtol=1e-12,
    )


def test_the_gram_holds_blas_to_one_thread(monkeypatch):
    """A block's GEMM is thin (inner dimension d + 2): BLAS threads only spin."""
    from bagserve.core.representations import mean
    from threadpoolctl import threadpool_info

    seen = []
    real = np.matmul

    def spy(*args, **kwargs):
        seen.append({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
        return real(*args, **kwargs)

    bags = random_bags(np.random.default_rng(0), n_bags=4, sizes=(5, 9))
    monkeypatch.setattr(mean.np, "matmul", spy)
    set_kernel_gram(bags, None, "gaussian", 1.0)
    assert seen and all(threads == {1} for threads in seen)
