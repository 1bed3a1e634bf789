"""Sliced-Wasserstein embedding against exact transport, POT, scipy and closed forms."""

from __future__ import annotations

import numpy as np
import ot
import pytest
from bagserve.core import Bags, BagValidationError, SlicedWasserstein, sliced_wasserstein_distance
from bagserve.core.representations.sliced import uniform_directions, wasserstein_1d
from scipy.special import gamma as gamma_fn
from scipy.stats import wasserstein_distance


def sw_from_features(F: np.ndarray, i: int, j: int, p: int) -> float:
    return float(np.sum(np.abs(F[i] - F[j]) ** p) ** (1.0 / p))


def test_directions_are_unit_and_seeded():
    a = uniform_directions(500, 4, 0)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0)
    np.testing.assert_array_equal(a, uniform_directions(500, 4, 0))
    # Uniform on the sphere: mean near 0, second moment I/d.
    np.testing.assert_allclose(a.mean(axis=0), 0.0, atol=0.1)
    np.testing.assert_allclose(a.T @ a / 500, np.eye(4) / 4, atol=0.05)


def test_fit_draws_shared_state(bags):
    sw = SlicedWasserstein(n_directions=7, n_levels=5, random_state=3).fit(bags)
    assert sw.directions_.shape == (7, bags.dim)
    assert sw.levels_.shape == (5,)
    assert np.all((sw.levels_ > 0) & (sw.levels_ < 1))
    assert sw.transform(bags).shape == (len(bags), 35)
    again = SlicedWasserstein(n_directions=7, n_levels=5, random_state=3).fit(bags)
    np.testing.assert_array_equal(sw.transform(bags), again.transform(bags))


@pytest.mark.parametrize("p", [1, 2])
def test_identical_permuted_and_duplicated_bags_are_at_distance_zero(rng, p):
    x = rng.normal(size=(37, 3))
    perm = x[rng.permutation(37)]
    dup = np.repeat(x, 3, axis=0)
    sw = SlicedWasserstein(p=p, random_state=0).fit([x])
    F = sw.transform([x, perm, dup])
    np.testing.assert_array_equal(F[0], F[1])
    np.testing.assert_array_equal(F[0], F[2])


def test_weights_equal_to_duplication_and_uniform_weights_equal_unweighted(rng):
    x = rng.normal(size=(20, 2))
    counts = rng.integers(1, 4, size=20)
    dup = np.repeat(x, counts, axis=0)
    sw = SlicedWasserstein(random_state=1).fit([x])
    weighted = sw.transform(Bags.from_arrays([x], weights=[counts]))
    np.testing.assert_allclose(weighted, sw.transform([dup]), atol=1e-12)
    uniform = sw.transform(Bags.from_arrays([x], weights=[np.ones(20)]))
    np.testing.assert_allclose(uniform, sw.transform([x]), atol=1e-12)


def test_weighted_quantiles_by_hand():
    sw = SlicedWasserstein(p=2, n_directions=1, n_levels=4, random_state=0).fit([np.zeros((1, 1))])
    sw.directions_ = np.array([[1.0]])
    sw.levels_ = np.array([0.1, 0.49, 0.6, 0.8])
    bags = Bags.from_arrays([np.array([[2.0], [0.0], [1.0]])], weights=[[0.25, 0.5, 0.25]])
    # F⁻¹(t) = 0 on [0, .5), 1 on [.5, .75), 2 on [.75, 1).
    np.testing.assert_allclose(sw.transform(bags)[0] * np.sqrt(4), [0, 0, 1, 2])
    # Unweighted: 3 points, F⁻¹(t) = x_(floor(3t)).
    np.testing.assert_allclose(sw.transform([np.array([[2.0], [0.0], [1.0]])])[0] * 2, [0, 1, 1, 2])


@pytest.mark.parametrize("p", [1, 2])
def test_equal_sizes_with_midpoint_levels_match_pot_exactly(rng, p):
    n = 50
    X = rng.normal(size=(n, 4))
    Y = rng.normal(loc=0.5, size=(n, 4)) * 1.5
    sw = SlicedWasserstein(p=p, n_directions=30, n_levels=n, levels="midpoint", random_state=2)
    F = sw.fit([X, Y]).transform([X, Y])
    pot = ot.sliced_wasserstein_distance(X, Y, projections=sw.directions_.T, p=p)
    assert sw_from_features(F, 0, 1, p) == pytest.approx(pot, abs=1e-10)


@pytest.mark.parametrize("p", [1, 2])
def test_exact_sw_matches_pot_with_unequal_sizes_and_weights(rng, p):
    X = rng.normal(size=(31, 3))
    Y = rng.exponential(size=(57, 3))
    a = rng.uniform(size=31)
    b = rng.uniform(size=57)
    theta = uniform_directions(40, 3, 5)
    ours = sliced_wasserstein_distance(X, Y, p=p, directions=theta, x_weights=a, y_weights=b)
    pot = ot.sliced_wasserstein_distance(X, Y, a / a.sum(), b / b.sum(), projections=theta.T, p=p)
    assert ours == pytest.approx(pot, rel=1e-12)


def test_wasserstein_1d_matches_scipy_with_unequal_sizes_and_weights(rng):
    u, v = rng.normal(size=13), rng.gamma(2.0, size=29)
    uw, vw = rng.uniform(size=13), rng.uniform(size=29)
    assert wasserstein_1d(u, v, uw, vw, p=1) == pytest.approx(
        wasserstein_distance(u, v, uw, vw), rel=1e-12
    )
    assert wasserstein_1d(u, v, p=1) == pytest.approx(wasserstein_distance(u, v), rel=1e-12)
    # p = 2 against POT's independent 1-D solver.
    assert wasserstein_1d(u, v, uw, vw, p=2) == pytest.approx(
        ot.wasserstein_1d(u, v, uw / uw.sum(), vw / vw.sum(), p=2), rel=1e-12
    )


@pytest.mark.parametrize("p", [1, 2])
def test_features_converge_to_exact_sw_for_unequal_weighted_bags(rng, p):
    X, Y = rng.normal(size=(45, 3)), rng.normal(1.0, 2.0, size=(71, 3))
    bags = Bags.from_arrays([X, Y], weights=[rng.uniform(size=45), rng.uniform(size=71)])
    errors = []
    for n_levels in (50, 5000):
        sw = SlicedWasserstein(
            p=p, n_directions=20, n_levels=n_levels, levels="midpoint", random_state=4
        ).fit(bags)
        F = sw.transform(bags)
        exact = sliced_wasserstein_distance(
            X,
            Y,
            p=p,
            directions=sw.directions_,
            x_weights=bags.bag_weights(0),
            y_weights=bags.bag_weights(1),
        )
        errors.append(abs(sw_from_features(F, 0, 1, p) - exact) / exact)
    assert errors[1] < 2e-3
    assert errors[1] < errors[0]


def test_sw_below_w2_for_any_directions(rng):
    X, Y = rng.normal(size=(20, 3)), rng.normal(0.7, 1.3, size=(25, 3))
    w2 = np.sqrt(ot.emd2(np.full(20, 1 / 20), np.full(25, 1 / 25), ot.dist(X, Y)))
    for seed in range(5):
        assert (
            sliced_wasserstein_distance(X, Y, p=2, n_directions=25, random_state=seed) <= w2 + 1e-12
        )


def test_one_dimensional_gaussians_closed_form(rng):
    m1, s1, m2, s2 = 0.3, 1.0, -1.2, 2.5
    X = rng.normal(m1, s1, size=(200_000, 1))
    Y = rng.normal(m2, s2, size=(150_000, 1))
    sw = SlicedWasserstein(p=2, n_directions=1, n_levels=2000, levels="midpoint", random_state=0)
    F = sw.fit([X, Y]).transform([X, Y])
    expected = (m1 - m2) ** 2 + (s1 - s2) ** 2
    # Sampling error of the quantiles is O(1/sqrt(n)); the extreme levels add O(1/N).
    assert sw_from_features(F, 0, 1, 2) ** 2 == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("dim", [2, 5])
def test_translation_gives_directional_projections_exactly(rng, dim):
    X = rng.normal(size=(64, dim))
    v = rng.normal(size=dim)
    sw = SlicedWasserstein(p=2, n_directions=20_000, n_levels=3, random_state=9).fit([X])
    F = sw.transform([X, X + v])
    proj = sw.directions_ @ v
    # Each quantile moves by ⟨θ, v⟩, so the estimate is exact given the directions...
    assert sw_from_features(F, 0, 1, 2) ** 2 == pytest.approx(np.mean(proj**2), rel=1e-9)
    # ...and its expectation over θ is ‖v‖²/d.
    assert np.mean(proj**2) == pytest.approx(v @ v / dim, rel=0.03)
    sw1 = SlicedWasserstein(p=1, n_directions=20_000, n_levels=3, random_state=9).fit([X])
    F1 = sw1.transform([X, X + v])
    e_abs = gamma_fn(dim / 2) / (np.sqrt(np.pi) * gamma_fn((dim + 1) / 2))
    assert sw_from_features(F1, 0, 1, 1) == pytest.approx(np.linalg.norm(v) * e_abs, rel=0.03)


@pytest.mark.parametrize("p", [1, 2])
def test_homogeneity(rng, p):
    X, Y = rng.normal(size=(30, 3)), rng.normal(1, 1, size=(40, 3))
    sw = SlicedWasserstein(p=p, random_state=0).fit([X, Y])
    F = sw.transform([X, Y])
    Fs = sw.transform([2.5 * X, 2.5 * Y])
    assert sw_from_features(Fs, 0, 1, p) == pytest.approx(2.5 * sw_from_features(F, 0, 1, p))
    theta = sw.directions_
    exact = sliced_wasserstein_distance(X, Y, p=p, directions=theta)
    assert sliced_wasserstein_distance(-3 * X, -3 * Y, p=p, directions=theta) == pytest.approx(
        3 * exact
    )


def test_rotating_directions_with_the_bags_leaves_features_unchanged(rng):
    X = rng.normal(size=(30, 3))
    Q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    sw = SlicedWasserstein(random_state=0).fit([X])
    F = sw.transform([X])
    sw.directions_ = sw.directions_ @ Q.T
    np.testing.assert_allclose(sw.transform([X @ Q.T]), F, atol=1e-12)


def test_metric_properties_of_feature_distances(bags):
    F = SlicedWasserstein(random_state=0).fit(bags).transform(bags)
    D = np.sqrt(((F[:, None, :] - F[None, :, :]) ** 2).sum(-1))
    np.testing.assert_allclose(D, D.T)
    assert np.all(D[~np.eye(len(bags), dtype=bool)] > 0)
    assert np.all(D[:, :, None] <= D[:, None, :] + D.T[None, :, :] + 1e-12)


def test_paired_mode_uses_one_level_per_direction(rng):
    X = rng.normal(size=(40, 2))
    sw = SlicedWasserstein(paired=True, n_directions=6, random_state=0).fit([X])
    F = sw.transform([X])
    assert F.shape == (1, 6)
    proj = np.sort(X @ sw.directions_.T, axis=0)
    idx = np.floor(sw.levels_ * 40).astype(int)
    np.testing.assert_allclose(F[0] * np.sqrt(6), proj[idx, np.arange(6)])
    w = Bags.from_arrays([X], weights=[np.ones(40)])
    np.testing.assert_allclose(sw.transform(w), F, atol=1e-12)


def test_bags_of_any_size_including_single_points(rng):
    arrays = [rng.normal(size=(n, 2)) for n in (1, 2, 5, 1000)]
    sw = SlicedWasserstein(n_directions=10, n_levels=10, random_state=0).fit(arrays)
    F = sw.transform(arrays)
    # A one-point bag maps every quantile to the projection of that point.
    np.testing.assert_allclose(
        F[0].reshape(10, 10) * 10, np.repeat((sw.directions_ @ arrays[0][0])[:, None], 10, 1)
    )


def test_features_of_a_bag_do_not_depend_on_batch_or_threads(rng):
    arrays = [rng.normal(size=(n, 3)) for n in (5, 300_000, 40)]
    sw = SlicedWasserstein(random_state=0).fit(arrays)
    ref = sw.transform(arrays)
    # Bit for bit: the big bag is split in direction blocks that depend on its size only.
    np.testing.assert_array_equal(sw.set_params(n_jobs=2).transform(arrays), ref)
    np.testing.assert_array_equal(sw.transform([arrays[1]]), ref[1:2])
    np.testing.assert_array_equal(sw.set_params(n_jobs=None).transform(arrays[::-1]), ref[::-1])


def test_direction_blocks_only_round_off(rng, monkeypatch):
    arrays = [rng.normal(size=(n, 3)) for n in (5, 3000)]
    sw = SlicedWasserstein(random_state=0).fit(arrays)
    ref = sw.transform(arrays)
    monkeypatch.setattr("bagserve.core.representations.sliced._PROJECTION_BLOCK_ENTRIES", 10_000)
    np.testing.assert_allclose(sw.transform(arrays), ref, rtol=1e-13, atol=1e-15)


def test_dimension_mismatch_is_reported(rng):
    sw = SlicedWasserstein(random_state=0).fit([rng.normal(size=(5, 3))])
    with pytest.raises(
        BagValidationError, match=r"2 feature column\(s\) but SlicedWasserstein was fitted on 3"
    ):
        sw.transform([rng.normal(size=(5, 2))])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"p": 3}, "p must be"),
        ({"n_directions": 0}, "n_directions"),
        ({"n_levels": 2.5}, "n_levels"),
        ({"levels": "sobol"}, "levels"),
    ],
)
def test_invalid_parameters(rng, params, message):
    with pytest.raises(ValueError, match=message):
        SlicedWasserstein(**params).fit([rng.normal(size=(5, 2))])
