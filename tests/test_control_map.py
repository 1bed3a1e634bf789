"""A batch's reference control calibrates every sample of the batch (issue 44)."""

import numpy as np
import pytest
from bagserve.core.alignment import CONTROL_LEVELS, control_map
from bagserve.core.bags import Bags, align_quantiles, bag_quantiles
from bagserve.core.marker_maps import MarkerMap

CENTRES = np.array([[0.0, 0.0, 0.0], [3.0, 1.0, -2.0], [-2.0, 4.0, 2.0]])


def _material(rng, n, proportions):
    pop = rng.choice(len(CENTRES), size=n, p=proportions)
    return CENTRES[pop] + 0.5 * rng.standard_normal((n, 3)), pop


def _instrument(x):
    """Monotone and non-linear on every marker: gain, offset and a compressed region."""
    return np.column_stack(
        [1.4 * x[:, 0] + 0.8, 0.7 * x[:, 1] - 1.0 + 0.5 * np.tanh(x[:, 1]), np.exp(0.3 * x[:, 2])]
    )


def test_a_marker_map_meets_its_knots_and_keeps_every_markers_order():
    rng = np.random.default_rng(0)
    source = np.sort(rng.normal(size=(7, 3)), axis=0)
    target = np.sort(rng.normal(size=(7, 3)), axis=0)
    mapping = MarkerMap.between(source, target)
    np.testing.assert_allclose(mapping(source), target, atol=1e-7)
    x = rng.normal(scale=3.0, size=(500, 3))
    y = mapping(x)
    for j in range(3):
        assert np.all(np.diff(y[np.argsort(x[:, j]), j]) >= 0)
    # Beyond the outer knots: the outer segment's straight line.
    far = source[-1, 0] + 5.0
    slope = (target[-1, 0] - target[-2, 0]) / (source[-1, 0] - source[-2, 0])
    got = mapping(np.array([[far, 0.0, 0.0]]))[0, 0]
    assert got == pytest.approx(target[-1, 0] + 5.0 * slope)


def test_the_control_undoes_the_batch_and_keeps_each_samples_proportions():
    """The batch's instrument is learnt from its control (the reference's material);
    a sample of very different proportions, mapped by it, has its populations where
    the reference has them, whereas matching the sample's own quantiles to the
    reference's (what a per-sample quantile map does) moves them."""
    rng = np.random.default_rng(1)
    even = [1 / 3, 1 / 3, 1 / 3]
    reference, _ = _material(rng, 6000, even)
    control, _ = _material(rng, 6000, even)
    sample, pop = _material(rng, 6000, [0.8, 0.15, 0.05])
    ref_q = np.quantile(reference, CONTROL_LEVELS, axis=0)
    mapping, quality = control_map(_instrument(control), ref_q, reference.std(axis=0))
    mapped = mapping(_instrument(sample))
    truth = np.array([sample[pop == k].mean(axis=0) for k in range(3)])
    by_control = np.array([mapped[pop == k].mean(axis=0) for k in range(3)])
    assert np.abs(by_control - truth).max() < 0.15
    own = align_quantiles(
        Bags.from_arrays([_instrument(sample)]), bag_quantiles(Bags.from_arrays([reference]))[0]
    ).points
    by_own = np.array([own[pop == k].mean(axis=0) for k in range(3)])
    assert np.abs(by_own - truth).max() > 3 * np.abs(by_control - truth).max()
    # The report: every marker moved, and brought nearer the reference on cells the
    # map was not fitted on.
    assert np.all(quality.moved > 0.1)
    assert np.all(quality.after < 0.5 * quality.before) and not quality.worse.any()


def test_a_control_of_the_wrong_shape_or_too_few_cells_is_refused():
    ref_q = np.zeros((CONTROL_LEVELS.size, 3)) + np.linspace(0, 1, CONTROL_LEVELS.size)[:, None]
    with pytest.raises(ValueError, match="expected cells x 3 markers"):
        control_map(np.zeros((500, 2)), ref_q, np.ones(3))
    with pytest.raises(ValueError, match="at least 202"):
        control_map(np.zeros((100, 3)), ref_q, np.ones(3))
