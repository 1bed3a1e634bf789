"""Density random features (paper 001): measures, samplers, closed forms, estimators."""

from __future__ import annotations

import math

import numpy as np
import pytest
from bagserve.core import (
    Bags,
    BagValidationError,
    DensityFeatures,
    DistributionRidge,
    HistogramEmbedding,
    MeanEmbedding,
    SlicedWasserstein,
    get_kernel,
)
from bagserve.core.representations.density import Z, g_lambda, lambda_measure, sample_lambdas
from scipy import integrate, stats

KAPPA = {
    "hellinger": lambda x, y: 0.5 * (math.sqrt(x) - math.sqrt(y)) ** 2,
    "tv": lambda x, y: 0.5 * abs(x - y),
    "js": lambda x, y: 0.5 * x * math.log(2 * x / (x + y)) + 0.5 * y * math.log(2 * y / (x + y)),
}


def fuglede(divergence: str, x: float, y: float) -> float:
    """∫ |x^{½+iλ} - y^{½+iλ}|² dμ(λ) by quadrature (Hellinger: the point mass at 0).

    ``|x^{½+iλ} - y^{½+iλ}|² = x + y - 2√(xy) cos(λ ln(x/y))``: the oscillating part is a
    Fourier integral, done by QUADPACK's QAWF (``weight="cos"``).
    """
    if divergence == "hellinger":
        return 0.5 * (math.sqrt(x) - math.sqrt(y)) ** 2
    mu = lambda t: float(lambda_measure(divergence, np.array(t)))  # noqa: E731
    mass = integrate.quad(mu, 0, np.inf)[0]
    c = math.log(x / y)
    wave = integrate.quad(mu, 0, np.inf, weight="cos", wvar=c)[0] if c != 0 else mass
    return (x + y) * mass - 2 * math.sqrt(x * y) * wave


@pytest.mark.parametrize("divergence", ["hellinger", "tv", "js"])
@pytest.mark.parametrize(("x", "y"), [(1.0, 2.0), (0.3, 0.05), (4.0, 0.7)])
def test_corrected_measures_reproduce_the_divergences(divergence, x, y):
    assert fuglede(divergence, x, y) == pytest.approx(KAPPA[divergence](x, y), rel=1e-6)
    # 1-homogeneous, and zero on the diagonal.
    assert fuglede(divergence, 3 * x, 3 * y) == pytest.approx(
        3 * fuglede(divergence, x, y), rel=1e-6
    )
    assert fuglede(divergence, x, x) == 0.0


def test_normalisers():
    assert integrate.quad(lambda t: lambda_measure("js", t), 0, np.inf)[0] == pytest.approx(
        math.log(2) / 2
    )
    assert integrate.quad(lambda t: lambda_measure("tv", t), 0, np.inf)[0] == pytest.approx(0.5)
    assert Z["js"] == pytest.approx(math.log(2) / 2) and Z["tv"] == Z["hellinger"] == 0.5


def test_samplers_follow_their_laws():
    rng = np.random.default_rng(0)
    tv = sample_lambdas("tv", 20_000, rng)
    assert stats.kstest(tv, lambda t: (2 / np.pi) * np.arctan(2 * t)).pvalue > 0.01
    js = sample_lambdas("js", 20_000, rng)

    def js_cdf(t):
        t = np.atleast_1d(t)
        return (
            np.array([integrate.quad(lambda s: lambda_measure("js", s), 0, v)[0] for v in t])
            / Z["js"]
        )

    assert stats.kstest(js, js_cdf).pvalue > 0.01
    assert np.mean(js < 0.3) == pytest.approx(0.6918, abs=0.01)
    assert np.mean(js) == pytest.approx(0.2488, abs=0.01)
    assert np.all(sample_lambdas("hellinger", 5, rng) == 0)


def test_g_lambda_distances_do_not_depend_on_c_lambda():
    lam = np.array([0.0, 0.7, 3.0])
    x, y = np.array([0.2, 1.5, 0.0]), np.array([0.9, 0.1, 2.0])
    g = g_lambda(np.stack([x, y]), lam, "tv")
    direct = math.sqrt(Z["tv"]) * (np.stack([x, y])[:, None, :] ** (0.5 + 1j * lam[:, None]))
    np.testing.assert_allclose(np.abs(g[0] - g[1]), np.abs(direct[0] - direct[1]), atol=1e-12)


def _exact(divergence: str, n_lambda: int = 1000) -> DensityFeatures:
    one_d = Bags.from_arrays([np.linspace(0, 1, 11)[:, None]])
    return DensityFeatures(
        divergence=divergence, n_lambda=n_lambda, n_basis=30, n_integration=10_000, random_state=0
    ).fit(one_d)


@pytest.mark.parametrize(
    ("divergence", "target", "rtol"),
    [
        # Hellinger: basis truncation and Monte Carlo integration (10^4 points).
        ("hellinger", 1 - 2 * math.sqrt(2) / 3, 0.03),
        # TV and JS also average over M = 1000 draws of λ (a few percent).
        ("tv", 0.25, 0.08),
        ("js", 0.053782, 0.08),
    ],
)
def test_closed_forms_with_exact_densities(divergence, target, rtol):
    df = _exact(divergence)
    u = df.points_[0][:, 0]
    A = df.features_from_densities(np.stack([np.ones_like(u), 2 * u]))
    assert np.sum((A[0] - A[1]) ** 2) == pytest.approx(target, rel=rtol)
    disjoint = df.features_from_densities(np.stack([2.0 * (u < 0.5), 2.0 * (u >= 0.5)]))
    full = {"hellinger": 1.0, "tv": 1.0, "js": math.log(2)}[divergence]
    # 30 cosines of a step function keep all but about 1.5% of its energy.
    assert np.sum((disjoint[0] - disjoint[1]) ** 2) == pytest.approx(full, rel=0.03)


def _samples(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.uniform(size=(n, 1)), np.sqrt(rng.uniform(size=(n, 1))), rng.uniform(size=(n, 1))]


@pytest.mark.parametrize(
    ("divergence", "target"),
    [("hellinger", 0.057191), ("js", 0.053782), ("l2", 1 / 3)],
)
def test_estimates_from_samples(divergence, target):
    bags = _samples(np.random.default_rng(1), 4000)
    df = DensityFeatures(
        divergence=divergence, n_lambda=200, n_basis=20, bandwidth=0.03, random_state=0
    )
    F = df.fit_transform(bags)
    assert np.sum((F[0] - F[1]) ** 2) == pytest.approx(target, rel=0.15)
    assert np.sum((F[0] - F[2]) ** 2) < target / 10


def test_order_seed_and_fit_transform(rng):
    bags = _samples(rng, 500)
    df = DensityFeatures(divergence="js", random_state=3)
    F = df.fit_transform(bags)
    np.testing.assert_array_equal(
        F, DensityFeatures(divergence="js", random_state=3).fit(bags).transform(bags)
    )
    perm = [b[np.random.default_rng(2).permutation(len(b))] for b in bags]
    np.testing.assert_allclose(df.transform(perm), F, rtol=1e-10, atol=1e-12)
    # Hellinger: λ ≡ 0, so the features ignore n_lambda.
    h1 = DensityFeatures(n_lambda=1, random_state=0).fit_transform(bags)
    h9 = DensityFeatures(n_lambda=9, random_state=0).fit_transform(bags)
    np.testing.assert_array_equal(h1, h9)


def test_ten_marker_panel_uses_pairs_and_clear_memory_error(rng):
    bags = [rng.normal(size=(300, 10)) + i * 0.1 for i in range(4)]
    df = DensityFeatures(n_basis=5, n_integration=500, random_state=0).fit(bags)
    assert len(df.groups_) == 45 and all(len(g) == 2 for g in df.groups_)
    F = df.transform(bags)
    assert F.shape == (4, 45 * 25)
    D = ((F[:, None] - F[None]) ** 2).sum(-1)
    assert D[0, 3] > D[0, 1] > 0
    with pytest.raises(ValueError, match=r"MiB for 4 bags.*subspaces"):
        DensityFeatures(subspaces="full", n_basis=10, max_memory=2**20).fit(bags)
    with pytest.raises(ValueError, match="do not index"):
        DensityFeatures(subspaces=[(0, 12)]).fit(bags)
    with pytest.raises(BagValidationError, match="fitted on 10"):
        df.transform([rng.normal(size=(5, 3))])


def gaussian_hellinger2(m1, s1, m2, s2) -> float:
    """Closed-form H² = 1 - BC between two Gaussians with diagonal covariances."""
    S = (s1 + s2) / 2
    bc = (np.prod(s1) * np.prod(s2)) ** 0.25 / np.sqrt(np.prod(S))
    return float(1 - bc * np.exp(-np.sum((m1 - m2) ** 2 / S) / 8))


def test_ten_marker_pairs_estimate_the_mean_pairwise_hellinger(rng):
    """Marker pairs: D² ≈ the mean over the 45 pairs of the 2-D marginals' H².

    The oracle is the closed form for Gaussians, with the KDE's smoothing (h² added to
    each variance, in the scaled units) included. What it cannot include is the KDE's
    variance, which adds to any plug-in divergence: hence a one-sided margin.
    """
    d, n = 10, 4000
    mus = [np.zeros(d), np.r_[0.8, 0.8, 0.8, np.zeros(7)], np.zeros(d)]
    sds = [np.ones(d), np.ones(d), np.r_[np.ones(5), 2.0, np.ones(4)]]
    bags = [m + s * rng.standard_normal((n, d)) for m, s in zip(mus, sds, strict=True)]
    df = DensityFeatures(divergence="hellinger", max_points=None, random_state=0).fit(bags)
    A = df.transform(bags)
    D = ((A[:, None] - A[None]) ** 2).sum(-1)
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        truth = np.mean(
            [
                gaussian_hellinger2(
                    mus[i][list(g)],
                    sds[i][list(g)] ** 2 + (df.bandwidth_ * df.span_[list(g)]) ** 2,
                    mus[j][list(g)],
                    sds[j][list(g)] ** 2 + (df.bandwidth_ * df.span_[list(g)]) ** 2,
                )
                for g in df.groups_
            ]
        )
        assert 0.95 < D[i, j] / truth < 1.35, (i, j, D[i, j], truth)


@pytest.mark.parametrize("dim", [1, 2])
def test_binned_kde_matches_the_exact_kde(rng, dim):
    bags = [rng.normal(rng.uniform(-1, 1), rng.uniform(0.3, 1), size=(800, dim)) for _ in range(6)]
    exact = DensityFeatures(divergence="js", kde="exact", random_state=0).fit(bags)
    binned = DensityFeatures(divergence="js", kde="binned", random_state=0).fit(bags)
    assert binned._grid_nodes(dim) is not None
    Ae, Ab = exact.transform(bags), binned.transform(bags)
    De = ((Ae[:, None] - Ae[None]) ** 2).sum(-1)
    Db = ((Ab[:, None] - Ab[None]) ** 2).sum(-1)
    # Linear binning and interpolation at spacing ≤ h/4: errors O((Δ/h)²), about 1%.
    assert np.abs(Db - De).max() < 0.02 * De.max()
    with pytest.raises(ValueError, match="at most 3 markers"):
        DensityFeatures(kde="binned", subspaces="full").fit([rng.normal(size=(50, 4))])


def test_out_of_range_points_are_clipped_and_counted(rng):
    df = DensityFeatures(random_state=0).fit([rng.uniform(size=(200, 2))])
    # Well inside the training range, except 7 points moved far away.
    shifted = 0.05 + 0.9 * rng.uniform(size=(100, 2))
    shifted[:7] += 5.0
    inside = 0.05 + 0.9 * rng.uniform(size=(50, 2))
    np.testing.assert_array_equal(df.clipped_counts([shifted, inside]), [7, 0])


def test_histogram_baselines(rng):
    a, b = rng.uniform(size=(400, 2)), rng.uniform(size=(300, 2)) ** 2
    for div in ("hellinger", "tv"):
        emb = HistogramEmbedding(div, bins=4).fit([a, b])
        D2 = emb.embed([a, b]).sq_distances()[0, 1]
        ha = np.histogramdd(
            a, bins=4, range=[(a.min(0)[j], max(a.max(0)[j], b.max(0)[j])) for j in range(2)]
        )[0]
        lo = np.minimum(a.min(0), b.min(0))
        hi = np.maximum(a.max(0), b.max(0))
        edges = [np.linspace(lo[j], hi[j], 5) for j in range(2)]
        ha = np.histogramdd(a, bins=edges)[0] / 400
        hb = np.histogramdd(b, bins=edges)[0] / 300
        expected = (
            0.5 * np.sum((np.sqrt(ha) - np.sqrt(hb)) ** 2)
            if div == "hellinger"
            else 0.5 * np.abs(ha - hb).sum()
        )
        assert pytest.approx(expected, rel=1e-12) == D2


@pytest.mark.parametrize(
    "rep",
    [
        lambda: DensityFeatures(divergence="js", n_basis=6, n_integration=400, random_state=0),
        lambda: SlicedWasserstein(n_directions=10, n_levels=10, random_state=0),
        lambda: SlicedWasserstein(p=1, n_directions=10, n_levels=10, random_state=0),
    ],
)
def test_random_feature_path_converges_to_the_exact_gram(rng, rep):
    bags = [rng.normal(loc=0.2 * i, size=(200, 2)) for i in range(12)]
    y = np.arange(12.0)
    exact = rep().fit(bags).embed(bags).sq_distances()
    gamma = 1.0 / np.median(exact[exact > 0])
    K = get_kernel("gaussian")(exact, gamma)
    errors = []
    for n in (50, 5000):
        model = DistributionRidge(
            rep(), gamma=gamma, alpha=1e-3, n_components=n, random_state=0
        ).fit(bags, y)
        Z_ = model.feature_map(bags)
        errors.append(np.abs(Z_ @ Z_.T - K).max())
    # Monte Carlo error ~ 1/sqrt(n): a factor 10 from 50 to 5000 features.
    assert errors[1] < errors[0] / 4 and errors[1] < 0.1


def test_random_feature_model_fits_in_the_primal(rng):
    bags = [
        rng.normal(loc=rng.uniform(-1, 1), scale=rng.uniform(0.5, 2), size=(300, 2))
        for _ in range(60)
    ]
    y = np.array([b.std() for b in bags])
    model = DistributionRidge(
        DensityFeatures(divergence="hellinger", random_state=0), n_components=500, random_state=0
    )
    model.fit(bags[:45], y[:45])
    assert model.primal_ and model.coef_.shape == (500, 1)
    rmse = np.sqrt(np.mean((model.predict(bags[45:]) - y[45:]) ** 2))
    assert rmse < 0.5 * np.std(y[45:])
    exact_mmd = DistributionRidge(MeanEmbedding(), n_components=100)
    with pytest.raises(ValueError, match="explicit features"):
        exact_mmd.fit(bags[:5], y[:5])


def test_likelihood_cv_bandwidth_adapts_to_multimodal_samples(rng):
    """Scott's rule suits one Gaussian; for narrow separated modes it oversmooths.

    On Gaussian bags the cross-validated bandwidth lands near Scott's; on bags of two
    narrow modes far apart it is several times smaller.
    """
    gauss = [rng.normal(size=(2000, 2)) for _ in range(5)]
    two_modes = [
        np.concatenate([rng.normal(-3, 0.2, size=(1000, 2)), rng.normal(3, 0.2, size=(1000, 2))])
        for _ in range(5)
    ]
    for bags, low, high in [(gauss, 0.5, 2.0), (two_modes, 0.05, 0.4)]:
        scott = DensityFeatures(bandwidth="scott", random_state=0).fit(bags).bandwidth_
        cv = DensityFeatures(random_state=0).fit(bags).bandwidth_
        assert low < cv / scott < high, (cv, scott)
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        DensityFeatures(bandwidth=-1.0).fit(gauss)
