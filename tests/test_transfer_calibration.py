"""The calibrations of marginal transfer (issue 44, point 1): the landmark map is the
maximum-likelihood per-marker affine map under the training populations, every map
keeps each marker's order of cells, and none depends on the order cells arrive in."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import MarginalTransferClassifier
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.estimators.transfer import calibration as cal
from bagserve.core.estimators.transfer import landmarks as lm
from bagserve.core.estimators.transfer.reference import Reference, fit_reference
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis


@pytest.fixture(scope="module")
def fitted():
    tasks, y, _batches = make_batched_cytometry_tasks(
        1, 6, 800, n_markers=4, n_populations=3, random_state=2, strength=0.0
    )
    model = MarginalTransferClassifier(calibrate="landmarks", cell_model="linear").fit(tasks, y)
    return model, Reference.from_state(model.reference_), tasks, y


def test_the_landmark_map_undoes_a_known_per_marker_gain_and_offset(fitted):
    """A sample seen through a known instrument ``x ↦ (x - b) / a``: the map found
    for it is the sample's own map composed with the instrument's inverse,
    ``(a₀ a, a₀ b + b₀)``. The likelihood with its Jacobian, the moment start and
    every EM step are equivariant under a per-marker affine change of units, so this
    holds to rounding, not only to sampling noise."""
    _model, reference, tasks, _ = fitted
    x = np.asarray(tasks[0])
    a0, b0 = lm.landmark_affine(x, reference)
    a = np.array([1.6, 0.7, 1.2, 0.9])
    b = np.array([-1.0, 2.0, 0.5, -0.3])
    found_a, found_b = lm.landmark_affine((x - b) / a, reference)
    np.testing.assert_allclose(found_a, a0 * a, rtol=1e-6)
    np.testing.assert_allclose(found_b, a0 * b + b0, rtol=1e-6, atol=1e-8)
    # And the sample's own map is near the identity: it is a training sample.
    np.testing.assert_allclose(a0, 1.0, atol=0.15)


def test_the_landmark_map_is_a_local_maximum_of_its_likelihood(fitted):
    """EM's fixed point: moving any scale or shift a little lowers the likelihood
    (mean log-density under the mixture plus the log-Jacobian)."""
    _, reference, tasks, _ = fitted
    x = np.asarray(tasks[1]) * 1.3 - 0.4
    a, b = lm.landmark_affine(x, reference)
    best = lm._log_likelihood(reference.mixture, x, a, b)
    for j in range(x.shape[1]):
        for step in (-0.02, 0.02):
            da = a.copy()
            da[j] *= 1 + step
            db = b.copy()
            db[j] += step
            assert lm._log_likelihood(reference.mixture, x, da, b) < best
            assert lm._log_likelihood(reference.mixture, x, a, db) < best


@pytest.mark.parametrize("how", ["landmarks", "standardise"])
def test_a_calibration_keeps_every_markers_order_and_ignores_cell_order(fitted, how):
    _, reference, tasks, _ = fitted
    x = np.asarray(tasks[2]) * [1.5, 0.8, 1.0, 2.0] + [0.3, -1.0, 0.0, 2.0]
    z, quality, ran = cal.calibrate(how, x, reference, None)
    if how == "landmarks":
        # The landmark map reports how far it moved each marker, as it answered.
        assert ran == "landmarks" and quality.by == "landmarks"
        np.testing.assert_allclose(
            quality.moved, np.median(np.abs(z - x), axis=0) / reference.sd, rtol=1e-12
        )
    else:
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


def _two_populations(n, wide, rng):
    """Cells of two populations on three markers (70 % at the origin, 30 % at
    (3, 1, 0), sd 0.5); the first population's spread on marker 0 times ``wide``: a
    detector that spreads the negative cells, as Miami's did on CD8."""
    k = (rng.random(n) > 0.7).astype(np.int64)
    x = np.array([[0.0, 0.0, 0.0], [3.0, 1.0, 0.0]])[k] + 0.5 * rng.standard_normal((n, 3))
    x[k == 0, 0] *= wide
    return x, k


@pytest.fixture(scope="module")
def two_populations():
    rng = np.random.default_rng(0)
    train = [_two_populations(1500, 1.0, rng) for _ in range(6)]
    xs, ks = [x for x, _ in train], [k for _, k in train]
    model = MarginalTransferClassifier(
        calibrate="landmarks", cell_model="linear", random_state=0
    ).fit(xs, ks)
    lda = LinearDiscriminantAnalysis().fit(np.vstack(xs), np.concatenate(ks))
    return model, Reference.from_state(model.reference_), lda, rng


def test_population_places_are_the_populations_distances_before_and_after_the_map(fitted):
    """:func:`population_places` against a naive computation: each cell's posterior
    from scipy's Gaussian densities at the LDA's means and shared covariance, each
    population's mean by an explicit weighted average, and the two averages of the
    distances (by the populations' shares, and over populations alike)."""
    from scipy.stats import multivariate_normal

    _, reference, tasks, _ = fitted
    x = np.asarray(tasks[4]) * [1.2, 0.9, 1.0, 1.1] + [0.2, -0.1, 0.0, 0.3]
    a, b = lm.landmark_affine(x, reference)
    before, after, worse = lm.population_places(x, a, b, reference)
    mixture = reference.mixture
    cov = np.linalg.inv(mixture["whitening"] @ mixture["whitening"].T)
    dens = np.column_stack(
        [
            np.exp(lp) * multivariate_normal(mu, cov).pdf(x)
            for mu, lp in zip(mixture["means"], mixture["log_priors"], strict=True)
        ]
    )
    post = dens / dens.sum(axis=1, keepdims=True)
    rows_before, rows_after, shares = [], [], []
    for k, mu in enumerate(mixture["means"]):
        m = (post[:, k, None] * x).sum(axis=0) / post[:, k].sum()
        rows_before.append(np.abs(m - mu) / reference.sd)
        rows_after.append(np.abs(m * a + b - mu) / reference.sd)
        shares.append(post[:, k].sum() / x.shape[0])
    shares = np.array(shares)
    rows_before, rows_after = np.array(rows_before), np.array(rows_after)
    np.testing.assert_allclose(before, shares @ rows_before, rtol=1e-9)
    np.testing.assert_allclose(after, shares @ rows_after, rtol=1e-9)
    present = shares >= lm.PLACE_SHARE
    alike = rows_after[present].mean(axis=0) > rows_before[present].mean(axis=0)
    np.testing.assert_array_equal(worse, (shares @ rows_after > shares @ rows_before) | alike)
    # This sample went through an affine instrument: the map puts its populations
    # back, so it is not refused.
    assert not lm.landmark_map(x, reference).refused


def test_a_sample_the_gate_leaves_as_measured_names_no_marker_worse(fitted):
    """The training batch's own samples show no instrument: the gate leaves them as
    measured, their maps neither applied nor refused. The report then says what the
    answer is, the cells as measured: moved 0, the populations where they were, and
    no marker made worse (the service lists ``worse`` as the markers that refused a
    map), though some of these maps, had they run, would have moved a population
    away on a marker."""
    model, reference, tasks, _ = fitted
    fits = [lm.landmark_map(np.asarray(x), reference) for x in tasks]
    assert all(f.gain <= reference.landmark_gain_limit and not f.refused for f in fits)
    assert any(f.worse.any() for f in fits)
    for x, fit in zip(tasks, fits, strict=True):
        z, quality, ran = cal.calibrate("landmarks", np.asarray(x), reference, None)
        assert ran == "none"
        np.testing.assert_array_equal(z, x)
        np.testing.assert_array_equal(quality.moved, 0.0)
        np.testing.assert_array_equal(quality.before, fit.before)
        np.testing.assert_array_equal(quality.after, fit.before)
        assert quality.by == "landmarks" and not quality.worse.any()
    for answer in model.predict_tasks(tasks):
        assert answer.report.calibrated is None and not answer.report.calibration.worse.any()


def test_a_map_that_squeezes_a_spread_population_is_refused(two_populations):
    """A new detector spreads the large population three times wider on marker 0.
    The likelihood's best map squeezes that marker (scale about 0.75) and drags the
    small population off its place, so an LDA of the training cells labels fewer of
    the mapped cells right than of the cells as measured. The populations' places
    name marker 0, the map keeps almost none of its gain without it, so it is
    refused: the sample is answered as measured, and its report says which marker
    refused it. (The model before the refusal answered with the map.)"""
    model, reference, lda, rng = two_populations
    x, k = _two_populations(4000, 3.0, rng)
    fit = lm.landmark_map(x, reference)
    assert fit.scale[0] < 0.85 and fit.gain > reference.landmark_gain_limit
    assert fit.worse[0] and fit.kept < lm.REFUSAL_SHARE * fit.gain and fit.refused
    as_measured = np.mean(lda.predict(x) == k)
    assert as_measured > np.mean(lda.predict(x * fit.scale + fit.shift) == k) + 0.01
    answer = model.predict_tasks([x])[0]
    assert answer.report.calibrated is None and answer.report.shift == 0.0
    quality = answer.report.calibration
    assert quality.by == "landmarks" and quality.refused and quality.worse[0]
    assert answer.report.out_of_range
    np.testing.assert_array_equal(quality.moved, 0.0)
    domain = model.domain_report([answer.report])
    assert domain.calibration_refused.tolist() == [True]
    # A sample through a plain instrument on every marker is mapped, not refused.
    plain = model.predict_tasks([_two_populations(2000, 1.0, rng)[0] * 1.3 + 0.5])[0]
    assert plain.report.calibrated == "landmarks" and not plain.report.calibration.refused
    assert np.mean(answer.predictions == k) > as_measured - 0.005


def test_a_refused_map_of_a_real_instrument_is_no_silent_answer():
    """The refusal can be wrong: a sample of the training batch seen through a plain
    per-marker gain and offset (of the size the search's drawn instruments have),
    whose landmark map undoes it, shows a gain nine times the gate's limit, yet the
    populations identified as measured are the wrong ones, and the map is refused.
    As measured, about a third of its cells are labelled right. A refused map past
    the gate means an instrument the model did not undo: whatever the sample is
    answered with, it is not answered as one like the training samples (the model
    before the refusal mapped it, and labelled 0.999 of its cells right)."""
    tasks, y, _ = make_batched_cytometry_tasks(
        1, 8, 1500, n_markers=8, n_populations=6, random_state=4, strength=0.0
    )
    labels = np.split(y, 8)
    model = MarginalTransferClassifier(calibrate="landmarks", cell_model="linear").fit(
        list(tasks[:6]), np.concatenate(labels[:6])
    )
    gain = np.array([0.6, 0.7, 0.97, 1.09, 1.2, 0.9, 1.3, 0.92])
    offset = np.array([-0.53, 0.62, -0.29, -2.63, -1.24, 0.07, -1.85, -0.21])
    x = np.asarray(tasks[7]) * gain + offset
    answer = model.predict_tasks([x])[0]
    right = np.mean(answer.predictions == labels[7])
    assert right > 0.95 or answer.report.out_of_range
    # Refused here, past the gate: flagged, its report naming the markers.
    fit = lm.landmark_map(x, Reference.from_state(model.reference_))
    assert fit.refused and fit.gain > model.reference_["landmark_gain_limit"]
    assert answer.report.calibrated is None and answer.report.calibration.refused
    assert answer.report.calibration.worse.any()


def _second_batch(rng):
    """Three samples of two populations through a second instrument: a gain and an
    offset per marker."""
    return [
        (x * [1.5, 0.8, 1.0] + [1.0, -0.5, 0.2], k)
        for x, k in (_two_populations(800, 1.0, rng) for _ in range(3))
    ]


def _gains_within_batches(tasks, labels, groups):
    """Each sample's landmark gain under the mixture of the other samples of its
    batch, recomputed sample by sample (the oracle of the gate's limit)."""
    gains = []
    for t in range(len(tasks)):
        others = [o for o in range(len(tasks)) if groups[o] == groups[t] and o != t]
        reference = fit_reference(
            [tasks[o] for o in others], np.concatenate([labels[o] for o in others]), None
        )
        gains.append(lm.landmark_gain(tasks[t], reference)[2])
    return gains


def test_with_batches_named_the_gate_holds_samples_out_within_their_batch():
    """The gate's limit with ``groups``: each sample's landmark gain under the mixture
    of the other samples of its own batch (three folds of a three-sample batch leave
    one out: recomputed here sample by sample), never across batches, whose gain is
    the second instrument's; a batch of one sample shows nothing."""
    rng = np.random.default_rng(3)
    samples = [_two_populations(800, 1.0, rng) for _ in range(3)] + _second_batch(rng)
    tasks = [x for x, _ in samples]
    labels = [k for _, k in samples]
    groups = np.array([0, 0, 0, 1, 1, 1])
    limit = cal.landmark_gain_limit(tasks, np.concatenate(labels), 3, 0, 1.0, groups)
    gains = _gains_within_batches(tasks, labels, groups)
    assert limit == pytest.approx(max(gains), rel=1e-12)
    pooled = cal.landmark_gain_limit(tasks, np.concatenate(labels), 3, 0, 1.0)
    assert pooled > 3 * limit
    alone = cal.landmark_gain_limit(tasks, np.concatenate(labels), 3, 0, 1.0, np.arange(6))
    assert alone == 0.0


def test_a_marker_at_one_value_is_shifted_to_the_training_mean(two_populations):
    """A detector at its bound: every cell of marker 2 reads 5.0. Its scale and shift
    are not separately identified (the EM's Newton system was singular there, and
    the sample was refused with a LinAlgError); the moment map puts it at the
    training mean, the EM fits the other markers, and the sample is answered."""
    model, reference, _lda, rng = two_populations
    x, _k = _two_populations(2000, 1.0, rng)
    x[:, 2] = 5.0
    fit = lm.landmark_map(x, reference)
    np.testing.assert_allclose(5.0 * fit.scale[2] + fit.shift[2], reference.mean[2], atol=1e-9)
    # The other markers are still fitted: the map is as likely as the moment map it
    # started from, or likelier.
    judged = np.asarray(x)
    m, s = judged.mean(axis=0), np.maximum(judged.std(axis=0), 1e-3 * reference.sd)
    start = reference.sd / s
    assert lm._log_likelihood(reference.mixture, judged, fit.scale, fit.shift) >= (
        lm._log_likelihood(reference.mixture, judged, start, reference.mean - start * m) - 1e-9
    )
    answer = model.predict_tasks([x])[0]
    assert np.all(np.isfinite(answer.scores)) and answer.report.out_of_range


def test_a_training_sample_flat_on_a_marker_leaves_the_gate_open():
    """One training sample reads one value on marker 1 (a dead channel in one file).
    Its scale there is the moment map's floor, not a fit, and its log-Jacobian
    (log 1000) counted as gain raised the gate's limit a thousandfold: every new
    sample was left as measured, a plainly shifted one too. Left out of the gain, the
    limit stays near the clean training set's, and the shifted sample is mapped."""
    rng = np.random.default_rng(5)
    train = [_two_populations(800, 1.0, rng) for _ in range(6)]
    xs, ks = [x.copy() for x, _ in train], [k for _, k in train]
    codes = np.concatenate(ks)
    clean = cal.landmark_gain_limit(xs, codes, 3, 0, 1.0)
    xs[2][:, 1] = 0.3
    assert cal.landmark_gain_limit(xs, codes, 3, 0, 1.0) < 10 * clean
    model = MarginalTransferClassifier(
        calibrate="landmarks", cell_model="linear", random_state=0
    ).fit(xs, ks)
    x, k = _two_populations(2000, 1.0, rng)
    answer = model.predict_tasks([x * [1.6, 0.7, 1.2] + [1.0, -0.5, 0.3]])[0]
    assert answer.report.calibrated == "landmarks"
    assert np.mean(answer.predictions == k) > 0.95


def test_a_sample_holding_a_population_its_fold_lacks_sets_no_limit():
    """With batches named, a batch of two samples, one of which holds a single
    population: the other, held out, is scored under a mixture that lacks its second
    population, and its gain is that population's, not an instrument's. It set the
    gate's limit (300 times the other held-out samples' gains), and a plainly shifted new
    sample was left as measured. Such a held-out sample now sets nothing; the rest
    of the limit is the other held-out samples' largest gain."""
    rng = np.random.default_rng(7)
    lone, k = _two_populations(800, 1.0, rng)
    samples = [(lone[k == 0], k[k == 0]), _two_populations(800, 1.0, rng), *_second_batch(rng)]
    tasks = [x for x, _ in samples]
    labels = [k for _, k in samples]
    groups = np.array([0, 0, 1, 1, 1])
    limit = cal.landmark_gain_limit(tasks, np.concatenate(labels), 3, 0, 1.0, groups)
    gains = _gains_within_batches(tasks, labels, groups)
    # Held out of the single-population sample, the second sample's gain is the
    # population it lacks.
    assert gains[1] > 5 * max(gains[:1] + gains[2:])
    assert limit == pytest.approx(max(gains[:1] + gains[2:]), rel=1e-12)
    model = MarginalTransferClassifier(
        calibrate="landmarks", cell_model="linear", random_state=0
    ).fit(tasks, labels, groups=groups)
    x, k = _two_populations(2000, 1.0, rng)
    answer = model.predict_tasks([x * [1.6, 0.7, 1.2] + [1.0, -0.5, 0.3]])[0]
    assert answer.report.calibrated == "landmarks"
    assert np.mean(answer.predictions == k) > 0.95
