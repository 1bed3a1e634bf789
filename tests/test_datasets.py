"""Data generators: shapes, seeds, and the formulas of the papers."""

from __future__ import annotations

import numpy as np
import pytest

from core.datasets import GaussianMixtures, load_digits_clouds, make_entropy_bags, make_gmm_modes


def test_gmm_modes_shapes_labels_and_seed():
    bags, y = make_gmm_modes(40, 25, max_components=4, dim=3, random_state=0)
    assert len(bags) == 40 and bags.dim == 3 and set(bags.sizes) == {25}
    assert set(np.unique(y)) <= {1, 2, 3, 4} and y.min() == 1
    again, y2 = make_gmm_modes(40, 25, max_components=4, dim=3, random_state=0)
    np.testing.assert_array_equal(bags.points, again.points)
    np.testing.assert_array_equal(y, y2)


def test_gmm_components_follow_the_recipe():
    mix = GaussianMixtures.draw(200, 3, 2, random_state=1)
    means = np.concatenate(mix.means)
    assert means.min() >= -5 and means.max() <= 5
    covs = np.concatenate([L @ L.transpose(0, 2, 1) for L in mix.cholesky])
    # Σ = a A Aᵀ + B with a in [1, 4], |A_ij| <= 1 and B_ii in [0, 1]: bounded diagonals.
    diag = covs[:, [0, 1], [0, 1]]
    assert diag.min() > 0 and diag.max() <= 4 * 2 + 1
    # Redrawing points keeps the mixtures: the sample mean of a one-component bag
    # approaches its mean.
    one = int(np.flatnonzero(mix.n_components == 1)[0])
    big = mix.sample(20_000, random_state=2)
    np.testing.assert_allclose(big[one].mean(axis=0), mix.means[one][0], atol=0.1)


def test_entropy_targets_use_the_papers_formula():
    bags, y = make_entropy_bags(n_bags=6, n_points=40_000, random_state=0)
    for b, h in zip(bags, y, strict=True):
        sigma2 = np.var(b[:, 0])
        assert h == pytest.approx(0.5 * np.log(2 * np.pi * np.e * sigma2), abs=0.03)


def test_digit_clouds_are_weighted_and_rotation_is_rigid():
    bags, y = load_digits_clouds()
    assert len(bags) == 1797 and bags.dim == 2 and bags.is_weighted
    assert np.abs(bags.points).max() <= 1.0 + 1e-12
    np.testing.assert_allclose(np.add.reduceat(bags.weights, bags.offsets[:-1]), 1.0)
    assert set(np.unique(y)) == set(range(10))
    rot, _ = load_digits_clouds(max_rotation=np.pi / 6, random_state=0)
    for t in (0, 100, 1000):
        a, b = bags[t], rot[t]
        np.testing.assert_allclose(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))
        assert not np.allclose(a, b)
    moved, _ = load_digits_clouds(max_translation=0.3, random_state=0)
    shift = moved[5] - bags[5]
    np.testing.assert_allclose(shift, shift[:1].repeat(len(shift), 0))
    assert np.abs(shift[0]).max() <= 0.3
