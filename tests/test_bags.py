"""Bags container: construction, indexing, weights, and errors that name the bag."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import Bags, BagValidationError, as_bags
from bagserve.core.bags import lexicographic_order
from sklearn.utils import _safe_indexing

from .conftest import random_bags


def test_from_arrays_stacks_points_and_offsets(rng):
    arrays = [rng.normal(size=(n, 4)) for n in (3, 1, 7)]
    bags = Bags.from_arrays(arrays)
    assert len(bags) == 3
    assert bags.dim == 4
    np.testing.assert_array_equal(bags.sizes, [3, 1, 7])
    np.testing.assert_array_equal(bags.offsets, [0, 3, 4, 11])
    assert bags.n_points == 11
    for a, b in zip(arrays, bags, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(bags[-1], arrays[2])
    np.testing.assert_array_equal(bags.bag_index(), [0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2])
    assert not bags.is_weighted
    np.testing.assert_allclose(bags.point_weights()[:3], 1 / 3)


def test_three_d_array_and_as_bags(rng):
    cube = rng.normal(size=(5, 10, 2))
    bags = as_bags(cube)
    assert len(bags) == 5 and bags.dim == 2
    assert as_bags(bags) is bags
    np.testing.assert_array_equal(bags[4], cube[4])


def test_weights_are_normalised_per_bag(rng):
    arrays = [rng.normal(size=(n, 2)) for n in (3, 4)]
    bags = Bags.from_arrays(arrays, weights=[[1, 1, 2], None])
    np.testing.assert_allclose(bags.bag_weights(0), [0.25, 0.25, 0.5])
    np.testing.assert_allclose(bags.bag_weights(1), [0.25] * 4)
    np.testing.assert_allclose(np.add.reduceat(bags.weights, bags.offsets[:-1]), 1.0)


def test_arrays_are_read_only(bags):
    with pytest.raises(ValueError, match="read-only"):
        bags.points[0, 0] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        bags[0][0, 0] = 1.0


def test_subset_by_slice_array_and_mask_keeps_weights(weighted_bags):
    sub = weighted_bags[[4, 1]]
    assert isinstance(sub, Bags)
    np.testing.assert_array_equal(sub[0], weighted_bags[4])
    np.testing.assert_array_equal(sub[1], weighted_bags[1])
    np.testing.assert_allclose(sub.bag_weights(0), weighted_bags.bag_weights(4))
    mask = np.zeros(len(weighted_bags), dtype=bool)
    mask[[2, 3]] = True
    np.testing.assert_array_equal(weighted_bags[mask][1], weighted_bags[3])
    assert len(weighted_bags[1:5]) == 4
    with pytest.raises(IndexError):
        weighted_bags[len(weighted_bags)]


def test_selecting_bags_keeps_their_weights_bit_for_bit():
    # Normalising weights is not idempotent in floating point (a bag's sum is 1 only to
    # within an ulp), so a selection that renormalised them would move a bag's weights,
    # and its embedding and prediction, by the last bits each time it is selected.
    bags = random_bags(np.random.default_rng(0), n_bags=40, sizes=(1, 60), weighted=True)
    for t in range(len(bags)):
        w = bags.bag_weights(t)
        np.testing.assert_array_equal(bags[[t]].weights, w)
        np.testing.assert_array_equal(bags[[t, 0]][[0]].weights, w)
        np.testing.assert_array_equal(bags[t : t + 1].weights, w)
    assert not bags[[3, 1]].weights.flags.writeable


def test_sklearn_safe_indexing_returns_weighted_bags(weighted_bags):
    # GridSearchCV / GroupKFold subset X through this private helper.
    sub = _safe_indexing(weighted_bags, np.array([3, 0]))
    assert isinstance(sub, Bags)
    np.testing.assert_allclose(sub.bag_weights(1), weighted_bags.bag_weights(0))


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (
            lambda r: [r.normal(size=(4, 3)), r.normal(size=(5, 2))],
            r"bag 1 has 2 feature column\(s\), expected 3",
        ),
        (lambda r: [r.normal(size=(4, 3)), np.zeros((0, 3))], r"bag 1 is empty"),
        (lambda r: [r.normal(size=(4,))], r"bag 0: expected a 2-D array"),
        (lambda r: [], r"no bags"),
    ],
)
def test_malformed_bags_are_named(rng, arrays, message):
    with pytest.raises(BagValidationError, match=message):
        Bags.from_arrays(arrays(rng))


def test_non_finite_values_report_bag_row_and_column(rng):
    a = rng.normal(size=(6, 3))
    b = rng.normal(size=(5, 3))
    b[2, 1] = np.nan
    b[4, 0] = np.inf
    with pytest.raises(BagValidationError) as info:
        Bags.from_arrays([a, b])
    msg = str(info.value)
    assert "bag 1" in msg and "2 non-finite" in msg and "row 2, column 1" in msg
    assert "NaN/Inf" in msg


def test_all_problems_are_reported_at_once(rng):
    bad = [
        rng.normal(size=(3, 2)),
        np.zeros((0, 2)),
        np.full((2, 2), np.nan),
        rng.normal(size=(2, 5)),
    ]
    with pytest.raises(BagValidationError) as info:
        Bags.from_arrays(bad)
    problems = info.value.problems
    assert len(problems) == 3
    assert any("bag 1 is empty" in p for p in problems)
    assert any("bag 2" in p and "non-finite" in p for p in problems)
    assert any("bag 3 has 5" in p for p in problems)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([[1, -1, 1], None], r"bag 0: 1 negative weight"),
        ([[0, 0, 0], None], r"bag 0: weights sum to zero"),
        ([[1, 1], None], r"bag 0: weights have shape \(2,\), expected \(3,\)"),
        ([None, [1, np.nan]], r"bag 1: weights contain NaN"),
        ([None], r"got weights for 1 bag\(s\) but 2"),
    ],
)
def test_bad_weights_are_named(rng, weights, message):
    arrays = [rng.normal(size=(3, 2)), rng.normal(size=(2, 2))]
    with pytest.raises(BagValidationError, match=message):
        Bags.from_arrays(arrays, weights=weights)


def test_zero_weight_points_are_allowed(rng):
    bags = Bags.from_arrays([rng.normal(size=(3, 2))], weights=[[0.0, 1.0, 0.0]])
    np.testing.assert_allclose(bags.bag_weights(0), [0, 1, 0])


def test_raw_constructor_validates_offsets_and_values(rng):
    pts = rng.normal(size=(5, 2))
    with pytest.raises(BagValidationError, match="bag 1 is empty"):
        Bags(pts, [0, 2, 2, 5])
    with pytest.raises(BagValidationError, match="end at 5"):
        Bags(pts, [0, 2, 4])
    pts[3, 1] = np.nan
    with pytest.raises(BagValidationError, match="bag 1: 1 non-finite"):
        Bags(pts, [0, 2, 5])


def test_bags_error_is_a_value_error():
    assert issubclass(BagValidationError, ValueError)


@pytest.mark.parametrize("n", [0, 1, 2, 3000])
@pytest.mark.parametrize("d", [1, 6])
def test_lexicographic_order_is_lexsorts(n, d):
    """The canonical order of a bag's cells against ``np.lexsort`` (the oracle): values on
    a continuous scale (no ties in the first column), channel values with ties,
    signed zeros, and a first column all equal."""
    rng = np.random.default_rng(n + d)
    continuous = rng.standard_normal((n, d))
    channels = rng.integers(0, 4, size=(n, d)).astype(np.float64)
    zeros = continuous.copy()
    zeros[: n // 2, 0] = -0.0
    zeros[n // 2 :, 0] = 0.0
    constant = continuous.copy()
    constant[:, 0] = 1.5
    for points in (continuous, channels, zeros, constant):
        assert np.array_equal(lexicographic_order(points), np.lexsort(points.T[::-1]))
