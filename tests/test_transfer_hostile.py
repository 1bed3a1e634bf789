"""Marginal transfer fed what a hostile or unlucky lab sends: values no instrument
gives, samples without spread, degenerate training data. Each gets a finite answer
with an honest report, or an error naming the sample, the column and what was
expected; never a numpy or scikit-learn exception, nor a NaN or Inf in an answer."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import BagValidationError, MarginalTransferClassifier, MarginalTransferRegressor
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.estimators.transfer.calibration import calibrate
from bagserve.core.estimators.transfer.reference import Reference

FAST = {"cv": 2, "cv_points": 100, "perturbations": 2, "n_components": 32, "random_state": 0}


@pytest.fixture(scope="module")
def cohort():
    tasks, y, _ = make_batched_cytometry_tasks(
        1, 5, 400, n_markers=3, n_populations=3, random_state=3, strength=0.0
    )
    cells = [np.asarray(tasks[t]) for t in range(len(tasks))]
    labels = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    control = np.random.default_rng(4).normal(size=(400, 3)) * [1.0, 2.0, 0.5]
    return cells, labels, control


@pytest.fixture(scope="module")
def models(cohort):
    cells, labels, control = cohort
    train, y = cells[:4], labels[:4]
    return {
        "landmarks": MarginalTransferClassifier(
            calibrate="landmarks", cell_model="linear", **FAST
        ).fit(train, y),
        "control": MarginalTransferClassifier(calibrate="control", cell_model="linear", **FAST).fit(
            train, y, control=control
        ),
        "regressor": MarginalTransferRegressor(calibrate="none", cell_model="linear", **FAST).fit(
            train, [x[:, 0] - x[:, 1] for x in train]
        ),
    }


def test_values_beyond_float32_are_refused_naming_task_and_column(cohort, models):
    """No FCS file holds a value beyond float32's range. Past about 1e154 a square
    overflows: the landmark map turned such a sample into NaN and refused it for a
    NaN it did not hold, the regressor answered a cell at the largest double with an
    infinite value, a control at 1e200 mapped the batch onto one point and was
    answered as in range, and a fit crashed with an IndexError. Each is refused now,
    naming the task (or the control) and the column."""
    cells, labels, control = cohort
    x = cells[4]
    huge = x * 1e200
    with pytest.raises(BagValidationError, match=r"task 0, column 0: 400 value\(s\) beyond"):
        models["landmarks"].predict_tasks([huge])
    lone = x.copy()
    lone[7, 2] = np.finfo(np.float64).max
    with pytest.raises(BagValidationError, match=r"task 1, column 2: 1 value\(s\) beyond") as err:
        models["regressor"].predict_tasks([x, lone])
    assert "the largest 1.8e+308" in str(err.value) and "NaN" not in str(err.value)
    with pytest.raises(BagValidationError, match=r"the reference control, column 1: 400 value"):
        models["control"].predict_tasks([x], control=control * 1e200)
    train = [c.copy() for c in cells[:4]]
    train[2] = train[2] * 1e200
    with pytest.raises(BagValidationError, match=r"task 2, column 0: 400 value\(s\) beyond"):
        MarginalTransferClassifier(**FAST).fit(train, labels[:4])
    # Outliers within float32's range are answered, finite.
    wild = x.copy()
    wild[:3, 1] = 1e30
    for model in models.values():
        extra = {"control": control} if model is models["control"] else {}
        (answer,) = model.predict_tasks([wild], **extra)
        assert np.all(np.isfinite(answer.scores))


def test_a_marker_that_never_varies_in_training_is_refused_naming_it(cohort):
    """A marker at one value in every training cell tells no cell from another. It
    was fitted silently (and every new sample at that value would then be unlike the
    training batch); where no marker varied (values of order 1e-310), scikit-learn's
    LDA failed with an IndexError. The fit names the column instead. One training
    sample flat on a marker, the others spread, is a sample like any other."""
    cells, labels, _ = cohort
    train = [c.copy() for c in cells[:4]]
    for x in train:
        x[:, 1] = 2.0
    with pytest.raises(BagValidationError, match="column 1: every training cell reads 2 ") as err:
        MarginalTransferClassifier(**FAST).fit(train, labels[:4])
    assert "column 0" not in str(err.value) and "leave it out of the panel" in str(err.value)
    with pytest.raises(BagValidationError, match="column 1"):
        MarginalTransferRegressor(**FAST).fit(train, [x[:, 0] for x in train])
    tiny = [c * 1e-310 for c in cells[:4]]
    with pytest.raises(BagValidationError) as err:
        MarginalTransferClassifier(**FAST).fit(tiny, labels[:4])
    assert all(f"column {j}: every training cell reads" in str(err.value) for j in range(3))
    one = [c.copy() for c in cells[:4]]
    one[0][:, 1] = 2.0
    model = MarginalTransferClassifier(**FAST).fit(one, labels[:4])
    assert np.all(np.isfinite(model.decision_function([cells[4]])))


def test_a_sample_that_reads_one_value_on_a_marker_is_out_of_range(cohort, models):
    """A detector at its bound, a file of one cell repeated, values of order 1e-310:
    the sample's cells read one value on a marker. No calibration can recover that
    marker's scale (the landmark map puts it at the training mean, the control's map
    at wherever the value falls), and near that mean the sample was answered as in
    range (about half its cells right, 4 markers). It is answered, finite, and out of range,
    by every calibration; its spread samples, however small, are not."""
    cells, _, control = cohort
    x = cells[4]
    landmarks = models["landmarks"]
    near = x.copy()
    near[:, 1] = np.median(np.vstack(cells[:4])[:, 1])
    (answer,) = landmarks.predict_tasks([near])
    assert answer.report.out_of_range and np.all(np.isfinite(answer.scores))
    # The report names the marker: the channel a lab should look at.
    assert answer.report.suspect.tolist() == [False, True, False]
    (measured,) = landmarks.predict_tasks([x])
    assert not measured.report.out_of_range and not measured.report.suspect.any()
    flat_samples = [near, np.repeat(x[:1], 50, axis=0), x * 1e-310, x[:2][[0, 0]]]
    for name, model in models.items():
        extra = {"control": control} if name == "control" else {}
        answers = model.predict_tasks([*flat_samples, x, x[:2], x[:3]], **extra)
        assert [a.report.out_of_range for a in answers[:4]] == [True] * 4, name
        assert all(np.all(np.isfinite(a.scores)) for a in answers), name
        domain = model.domain_report([a.report for a in answers])
        assert domain.out_of_range[:4].all() and not domain.out_of_range[4], name
        assert domain.suspect_markers[0].tolist() == [False, True, False], name
        assert not domain.suspect_markers[4].any(), name


def test_the_service_refuses_a_huge_value_and_flags_a_flat_sample(cohort, models, tmp_path):
    """Through the real app under uvicorn: a value beyond float32's range is a 422
    naming the task and the column (it was a 422 blaming a NaN the request did not
    hold); a sample at one value on a marker is answered, out of range, and its
    status says the answer is preliminary."""
    import httpx
    from bagserve.core import save
    from bagserve.core.io.panel import Panel
    from bagserve.core.io.preprocessing import Preprocessing

    from .service_harness import running_service

    markers = ["CD3", "CD4", "CD8"]
    meta = {"panel": Panel(tuple(markers)).to_json(), "preprocessing": Preprocessing().to_json()}
    save(
        models["landmarks"], tmp_path / "models" / "gates" / "1", name="gates", version="1", **meta
    )
    x = np.round(cohort[0][4], 6)
    flat = x.copy()
    flat[:, 1] = np.median(np.vstack(cohort[0][:4])[:, 1])
    huge = x.copy()
    huge[3, 2] = 1e200

    def body(*cells):
        return {
            "bags": [
                {"id": f"s{i}", "markers": markers, "points": c.tolist()}
                for i, c in enumerate(cells)
            ]
        }

    with running_service(tmp_path / "models") as url, httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/models/gates/predict", json=body(x, huge))
        assert r.status_code == 422, r.text
        assert "task 1, column 2: 1 value(s) beyond" in r.text and "NaN" not in r.text
        r = c.post("/v1/models/gates/predict", json=body(x, flat))
        assert r.status_code == 200, r.text
        got = r.json()["predictions"]
        assert [p["report"]["out_of_range"] for p in got] == [False, True]
        assert [p["report"]["suspect_markers"] for p in got] == [[], ["CD4"]]
        assert got[1]["status"] != got[0]["status"]


def test_a_marker_copied_from_another_is_out_of_range(cohort, models):
    """The same channel read into two markers (a panel mix-up), as is or rescaled:
    the sample's cells span one marker fewer than the model reads. It was answered as
    in range. Now out of range by every calibration, answered finite; the markers'
    ordinary correlation in a sample is no tie."""
    cells, _, control = cohort
    x = cells[4]
    copied, rescaled = x.copy(), x.copy()
    copied[:, 2] = x[:, 0]
    rescaled[:, 1] = 3.0 * x[:, 2] - 1.0
    assert np.max(np.abs(np.corrcoef(x, rowvar=False) - np.eye(3))) > 0.3
    for name, model in models.items():
        extra = {"control": control} if name == "control" else {}
        answers = model.predict_tasks([copied, rescaled, x], **extra)
        assert [a.report.out_of_range for a in answers] == [True, True, False], name
        # Both markers of a tied pair are named: which one is the copy, no cell says.
        assert [a.report.suspect.tolist() for a in answers] == [
            [True, False, True],
            [False, True, True],
            [False, False, False],
        ], name
        assert all(np.all(np.isfinite(a.scores)) for a in answers), name


def test_a_control_piled_on_one_value_is_refused_naming_the_column(cohort, models):
    """A batch's control whose cells read one value on a marker cannot map that
    marker: its quantile map sent the batch's samples 6e8 training standard
    deviations away. It is refused, at fit and at prediction, naming the column; so
    is a control collapsed to 1e-310, and one too small (as before)."""
    cells, labels, control = cohort
    model = models["control"]
    piled = control.copy()
    piled[:, 1] = 5.0
    with pytest.raises(BagValidationError, match=r"the reference control, column 1: .* read 5;"):
        model.predict_tasks([cells[4]], control=piled)
    with pytest.raises(BagValidationError) as err:
        model.predict_tasks([cells[4]], control=control * 1e-310)
    assert all(f"the reference control, column {j}:" in str(err.value) for j in range(3))
    with pytest.raises(BagValidationError, match="at least 202 cells"):
        model.predict_tasks([cells[4]], control=control[:150])
    with pytest.raises(BagValidationError, match="the reference control, column 1:"):
        MarginalTransferClassifier(calibrate="control", **FAST).fit(
            cells[:4], labels[:4], control=piled
        )
    # Half the control on one value still spreads between its outer levels: mapped.
    half = control.copy()
    half[::2, 0] = 0.0
    (answer,) = model.predict_tasks([cells[4]], control=half)
    assert np.all(np.isfinite(answer.scores))


def test_cells_a_thousand_training_sds_away_put_a_sample_out_of_range(cohort, models):
    """Three cells at 1e30 on a marker: no instrument's shift puts a measured cell
    there. They inflated a standardised sample's moments until its other cells,
    crushed together, changed label, and a linear regressor answered them with
    values of order 1e30; both in range. Out of range now, answered finite; a sample
    as measured is not."""
    cells, labels, _ = cohort
    x = cells[4]
    wild = x.copy()
    wild[:3, 1] = 1e30
    standard = MarginalTransferClassifier(calibrate="standardise", cell_model="linear", **FAST).fit(
        cells[:4], labels[:4]
    )
    (clean,), (crushed,) = standard.predict_tasks([x]), standard.predict_tasks([wild])
    # The other cells, as the model sees them: one value on the marker.
    z, _, _ = calibrate("standardise", wild, Reference.from_state(standard.reference_), None)
    assert np.ptp(z[3:, 1]) < 1e-20 < np.ptp(x[3:, 1])
    assert np.any(clean.predictions[3:] != crushed.predictions[3:])
    assert crushed.report.out_of_range and not clean.report.out_of_range
    regressor = models["regressor"]
    (answer,) = regressor.predict_tasks([wild])
    assert np.abs(answer.predictions[:3]).min() > 1e20 and answer.report.out_of_range
    for name, model in models.items():
        if name != "control":
            (answer,) = model.predict_tasks([wild])
            assert answer.report.out_of_range and np.all(np.isfinite(answer.scores)), name


def test_a_marker_far_from_zero_next_to_its_spread(cohort):
    """Moving a marker by a constant in every training and new sample moves the
    landmark map's shift and nothing else (the map is affine-equivariant), as far as
    float32 (an FCS file) can carry the marker's spread at that level: 1e6 times it.
    At 1e8, which no FCS file stores, the map's Newton system was singular (a
    ``LinAlgError``, a 500 at the service); the fit is refused naming the column."""
    from bagserve.core.estimators.transfer.landmarks import landmark_map

    cells, labels, _ = cohort
    # An instrument the gate lets through: every marker scaled and shifted.
    new = cells[4] * [1.6, 0.7, 1.3] + [0.8, -0.5, 0.4]
    answers, scales = [], []
    for moved in ([0.0, 0.0, 0.0], [0.0, 1e6, 0.0]):
        model = MarginalTransferClassifier(calibrate="landmarks", cell_model="linear", **FAST)
        model.fit([c + moved for c in cells[:4]], labels[:4])
        (answer,) = model.predict_tasks([new + moved])
        answers.append(answer)
        scales.append(landmark_map(new + moved, Reference.from_state(model.reference_)).scale)
    assert [a.report.calibrated for a in answers] == ["landmarks", "landmarks"]
    np.testing.assert_allclose(scales[1], scales[0], rtol=1e-5)
    assert np.mean(answers[1].predictions == answers[0].predictions) > 0.99
    far = [c + np.array([0, 1e8, 0]) for c in cells[:4]]
    with pytest.raises(BagValidationError, match=r"column 1: every training cell reads 1e\+08"):
        MarginalTransferClassifier(**FAST).fit(far, labels[:4])


def test_a_sample_spread_thinly_far_from_zero_gets_its_landmark_map(cohort):
    """The landmark map's Newton system, on the cells as measured, has a condition
    that grows with the square of a marker's distance from zero over its spread. The
    training cells read about 1e5 from zero on a marker (1e5 times their spread,
    which float32 carries) and a new sample read there with a thousandth of their
    spread: the map scaled that marker by 163 where the same cells near zero get 418,
    with a smaller likelihood gain, a map that does not bring the populations home.
    Centred, the map is the same wherever the marker is read."""
    from bagserve.core.estimators.transfer.landmarks import landmark_map

    cells, labels, _ = cohort
    fits = []
    for level in (0.0, 1e5):
        moved = np.array([0.0, level, 0.0])
        model = MarginalTransferClassifier(calibrate="landmarks", cell_model="linear", **FAST)
        model.fit([c + moved for c in cells[:4]], labels[:4])
        x = cells[4] + moved
        x[:, 1] = level + (x[:, 1] - x[:, 1].mean()) * 3e-3
        fits.append(landmark_map(x, Reference.from_state(model.reference_)))
        (answer,) = model.predict_tasks([x])
        assert np.all(np.isfinite(answer.scores))
    np.testing.assert_allclose(fits[1].scale, fits[0].scale, rtol=1e-5)
    assert abs(fits[1].gain - fits[0].gain) < 1e-4
