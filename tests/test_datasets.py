"""Data generators: shapes, seeds, and the formulas of the papers."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core.datasets import (
    GaussianMixtures,
    load_digits_clouds,
    load_flowcap_gvhd,
    make_cytometry_tasks,
    make_ellipse_tasks,
    make_entropy_bags,
    make_gmm_modes,
)

from .conftest import SHARED_DATA


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


def test_ellipse_tasks_follow_algorithm_1():
    tasks, y, angles = make_ellipse_tasks(20, 2000, random_state=0)
    assert len(tasks) == 20 and tasks.dim == 2 and y.shape == (40_000,)
    assert np.all((angles >= np.pi / 4) & (angles <= 3 * np.pi / 4))
    for t in (0, 7):
        x = tasks[t]
        yt = y[tasks.offsets[t] : tasks.offsets[t + 1]]
        a = angles[t]
        u = x @ np.array([np.cos(a), np.sin(a)])  # along the major axis
        v = x @ np.array([-np.sin(a), np.cos(a)])  # along the minor axis
        # Inside the ellipse (semi-axes 1 and 0.2), uniformly: E[u²] = 1/4, E[v²] = 0.04/4.
        assert np.all((u / 1.0) ** 2 + (v / 0.2) ** 2 <= 1 + 1e-12)
        assert np.mean(u**2) == pytest.approx(0.25, rel=0.05)
        assert np.mean(v**2) == pytest.approx(0.01, rel=0.05)
        # +1 on the side of the normal (sin α, -cos α) of the major axis.
        side = x @ np.array([np.sin(a), -np.cos(a)])
        np.testing.assert_array_equal(yt, np.where(side > 0, 1, -1))
    # Every task has mean zero: only the orientation separates them.
    np.testing.assert_allclose([b.mean(axis=0) for b in tasks], 0.0, atol=0.03)


GVHD = SHARED_DATA / "flowcap1_gvhd"


def test_flowcap_gvhd_loader_reads_cells_and_gates():
    tasks, y, samples = load_flowcap_gvhd(GVHD, samples=[1, 7])
    assert samples == [1, 7] and tasks.dim == 6 and len(tasks) == 2
    assert y.shape == (tasks.n_points,)
    assert set(np.unique(y)) <= {0, 1, 3, 4}
    assert tasks.points.min() >= 0.0 and tasks.points.max() <= 1.0
    raw, y_raw, _ = load_flowcap_gvhd(GVHD, samples=[7], labels="raw", transform="none")
    # Sample 7 carries gates 0..5; 2 and 5 are not aligned with the other samples.
    assert set(np.unique(y_raw)) == {0, 1, 2, 3, 4, 5}
    first = tasks[1]
    np.testing.assert_allclose(first, raw[0] / 1023.0)
    binary = load_flowcap_gvhd(GVHD, samples=[7], labels="binary")[1]
    np.testing.assert_array_equal(binary, np.isin(y_raw, (1, 3, 4)).astype(int))


def test_cytometry_tasks_share_populations_under_batch_effects():
    tasks, y = make_cytometry_tasks(6, 3000, n_markers=5, n_populations=3, random_state=0)
    assert len(tasks) == 6 and tasks.dim == 5 and y.shape == (18_000,)
    assert set(np.unique(y)) == {0, 1, 2}
    again, y2 = make_cytometry_tasks(6, 3000, n_markers=5, n_populations=3, random_state=0)
    np.testing.assert_array_equal(again.points, tasks.points)
    np.testing.assert_array_equal(y2, y)
    # The same population sits at different places in different samples (batch effect).
    means = [tasks[t][y[tasks.offsets[t] : tasks.offsets[t + 1]] == 0].mean(0) for t in range(6)]
    assert np.ptp(np.array(means), axis=0).max() > 0.3
