"""The calibrations of marginal transfer (issue 44, point 1): the landmark map is the
maximum-likelihood per-marker affine map under the training populations, every map
keeps each marker's order of cells, and none depends on the order cells arrive in."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import MarginalTransferClassifier
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.estimators.transfer import calibration as cal


@pytest.fixture(scope="module")
def fitted():
    tasks, y, _batches = make_batched_cytometry_tasks(
        1, 6, 800, n_markers=4, n_populations=3, random_state=2, strength=0.0
    )
    model = MarginalTransferClassifier(calibrate="landmarks", cell_model="linear").fit(tasks, y)
    return model, cal.Reference.from_state(model.reference_), tasks, y


def test_the_landmark_map_undoes_a_known_per_marker_gain_and_offset(fitted):
    """A sample seen through a known instrument ``x ↦ (x - b) / a``: the map found
    for it is the sample's own map composed with the instrument's inverse,
    ``(a₀ a, a₀ b + b₀)``. The likelihood with its Jacobian, the moment start and
    every EM step are equivariant under a per-marker affine change of units, so this
    holds to rounding, not only to sampling noise."""
    _model, reference, tasks, _ = fitted
    x = np.asarray(tasks[0])
    a0, b0 = cal.landmark_affine(x, reference)
    a = np.array([1.6, 0.7, 1.2, 0.9])
    b = np.array([-1.0, 2.0, 0.5, -0.3])
    found_a, found_b = cal.landmark_affine((x - b) / a, reference)
    np.testing.assert_allclose(found_a, a0 * a, rtol=1e-6)
    np.testing.assert_allclose(found_b, a0 * b + b0, rtol=1e-6, atol=1e-8)
    # And the sample's own map is near the identity: it is a training sample.
    np.testing.assert_allclose(a0, 1.0, atol=0.15)


def test_the_landmark_map_is_a_local_maximum_of_its_likelihood(fitted):
    """EM's fixed point: moving any scale or shift a little lowers the likelihood
    (mean log-density under the mixture plus the log-Jacobian)."""
    _, reference, tasks, _ = fitted
    x = np.asarray(tasks[1]) * 1.3 - 0.4
    a, b = cal.landmark_affine(x, reference)
    best = cal._log_likelihood(reference.mixture, x, a, b)
    for j in range(x.shape[1]):
        for step in (-0.02, 0.02):
            da = a.copy()
            da[j] *= 1 + step
            db = b.copy()
            db[j] += step
            assert cal._log_likelihood(reference.mixture, x, da, b) < best
            assert cal._log_likelihood(reference.mixture, x, a, db) < best


@pytest.mark.parametrize("how", ["landmarks", "standardise"])
def test_a_calibration_keeps_every_markers_order_and_ignores_cell_order(fitted, how):
    _, reference, tasks, _ = fitted
    x = np.asarray(tasks[2]) * [1.5, 0.8, 1.0, 2.0] + [0.3, -1.0, 0.0, 2.0]
    z, quality, _ = cal.calibrate(how, x, reference, None)
    assert quality is None
    order = np.argsort(x, axis=0, kind="stable")
    mapped = np.take_along_axis(z, order, axis=0)
    assert np.all(np.diff(mapped, axis=0) >= 0)
    shuffle = np.random.default_rng(0).permutation(x.shape[0])
    again, _, _ = cal.calibrate(how, x[shuffle], reference, None)
    np.testing.assert_array_equal(again, z[shuffle])


def test_standardising_is_each_markers_z_score(fitted):
    _, reference, tasks, _ = fitted
    x = np.asarray(tasks[3]) * 3.0 + 1.0
    z, _, _ = cal.calibrate("standardise", x, reference, None)
    np.testing.assert_allclose(z, (x - x.mean(axis=0)) / x.std(axis=0), atol=1e-12)


def test_an_unknown_calibration_or_a_missing_control_is_refused(fitted):
    _, reference, tasks, _ = fitted
    x = np.asarray(tasks[0])
    with pytest.raises(ValueError, match="calibration must be one of"):
        cal.calibrate("quantile", x, reference, None)
    with pytest.raises(ValueError, match="needs the batch's reference control"):
        cal.calibrate("control", x, reference, None)
    with pytest.raises(ValueError, match="fitted without a reference control"):
        cal.fit_control(x, reference)
