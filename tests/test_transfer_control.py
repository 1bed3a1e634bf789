"""A batch's reference control maps every sample of the batch before any model of a
``MarginalTransferClassifier`` sees it (issue 44, "calibrate, then classify")."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import Bags, MarginalTransferClassifier
from bagserve.core.alignment import CONTROL_LEVELS, control_map
from bagserve.core.artifacts import load, save
from bagserve.core.datasets import emulate_batches

from .test_datasets_emulate import _sources

#: No search: the test is about the control alone. ``PLAIN`` is the same cell model on
#: the cells as measured, the oracle of what the control's map feeds it.
FIXED = {"calibrate": "control", "cell_model": "linear", "random_state": 0}
PLAIN = {"calibrate": "none", "cell_model": "linear", "random_state": 0}


@pytest.fixture(scope="module")
def cohort():
    sources, y = _sources()
    tasks, labels, batches, origin = emulate_batches(
        sources, y, 2, 4, 600, random_state=3, strength=2.5, control_cells=1500
    )

    def part(batch: int, control: bool):
        idx = np.flatnonzero((batches == batch) & ((origin < 0) == control))
        return tasks[idx], np.concatenate(
            [labels[tasks.offsets[t] : tasks.offsets[t + 1]] for t in idx]
        )

    return part


@pytest.fixture(scope="module")
def model(cohort):
    train, y = cohort(0, False)
    control, _ = cohort(0, True)
    return MarginalTransferClassifier(**FIXED).fit(train, y, control=control.points)


def _reference(model):
    return model.reference_["control_quantiles"], model.reference_["control_scale"]


def test_the_control_maps_the_batch_before_the_model_answers(cohort, model):
    train, y_train = cohort(0, False)
    test, y = cohort(1, False)
    control, _ = cohort(1, True)
    answers = model.predict_tasks(test, control=control.points)
    # The oracle: the control's map applied by hand, then the same cell model on the
    # mapped cells as they are.
    plain = MarginalTransferClassifier(**PLAIN).fit(train, y_train)
    mapping, quality = control_map(control.points, *_reference(model))
    by_hand = plain.predict_tasks(Bags(mapping(test.points), test.offsets))
    for a, b in zip(answers, by_hand, strict=True):
        np.testing.assert_array_equal(a.scores, b.scores)
        assert a.report.calibrated == "control"
        np.testing.assert_array_equal(a.report.calibration.after, quality.after)
    # Each task's own displacement, in the training control's sd.
    first = np.asarray(test[0])
    moved = np.median(np.abs(mapping(first) - first) / _reference(model)[1], axis=0)
    np.testing.assert_allclose(answers[0].report.calibration.moved, moved)
    # And it is what the batch needed: the instrument (strength 2.5) costs the
    # uncalibrated model labels that the control gives back.
    with_control = np.mean(np.concatenate([a.predictions for a in answers]) == y)
    without = np.mean(plain.predict(test) == y)
    assert with_control > without + 0.05 and with_control > 0.9


def test_without_its_batch_control_a_sample_is_calibrated_by_its_landmarks(cohort, model):
    """A model fitted with a control, asked without the batch's: each sample is mapped
    by its own landmarks (the model's calibration without a control) and the report
    says so; the quality reported is the landmark map's, none of a control is made up."""
    test, _ = cohort(1, False)
    assert model.calibration_without_control_ == "landmarks"
    answers = model.predict_tasks(test)
    assert all(a.report.calibrated == "landmarks" for a in answers)
    assert all(a.report.calibration.by == "landmarks" for a in answers)
    domain = model.domain_report([a.report for a in answers])
    assert domain.calibrated_of(0) == "landmarks"
    assert domain.calibration_by.tolist() == ["landmarks"] * len(answers)


def test_without_its_control_a_sample_of_the_training_batch_is_left_as_measured(cohort, model):
    """A model fixed to its control falls back to landmarks where a batch's control is
    not given, and that fallback is gated like any landmark calibration: the gate's
    limit is measured at fit, and the training batch's own samples, whose landmark
    gain stays under it, are answered as measured. Before, the limit was measured
    only where landmarks were a candidate, so this fallback mapped every sample."""
    train, _ = cohort(0, False)
    assert model.reference_["landmark_gain_limit"] is not None
    answers = model.predict_tasks(train)
    assert [a.report.calibrated for a in answers] == [None] * len(answers)


def test_a_saved_model_keeps_its_control(cohort, model, tmp_path):
    test, _ = cohort(1, False)
    control, _ = cohort(1, True)
    save(model, tmp_path / "m")
    again = load(tmp_path / "m")
    np.testing.assert_array_equal(_reference(again)[0], _reference(model)[0])
    np.testing.assert_array_equal(
        again.decision_function(test, control=control.points),
        model.decision_function(test, control=control.points),
    )


def test_a_control_the_model_cannot_use_is_refused(cohort, model):
    train, y = cohort(0, False)
    test, _ = cohort(1, False)
    control, _ = cohort(1, True)
    plain = MarginalTransferClassifier(**PLAIN).fit(train, y)
    with pytest.raises(ValueError, match="fitted without a reference control"):
        plain.predict_tasks(test, control=control.points)
    with pytest.raises(ValueError, match="the samples have 3 markers"):
        model.predict_tasks(test, control=control.points[:, :2])
    with pytest.raises(ValueError, match="at least 202 cells"):
        MarginalTransferClassifier(**FIXED).fit(train, y, control=control.points[:100])
    groups = np.repeat([0, 1], len(train) // 2)
    with pytest.raises(ValueError, match="belongs to one batch"):
        MarginalTransferClassifier(**FIXED).fit(train, y, groups=groups, control=control.points)


def test_the_command_maps_by_the_control_file_and_names_it(cohort, model, tmp_path, capsys):
    """``bagserve predict MODEL FILES --control FILE``: the runtime's answer is the
    estimator's with that control, each bag's report says how the control moved each
    marker, and the control file is named with its sha256; a model without a
    control, or ``--url``, refuses it."""
    import hashlib
    import json

    from bagserve.core.io.panel import Panel
    from bagserve.core.io.preprocessing import Preprocessing

    from bagserve.cli import main

    from .test_batch import write_csv

    markers = ["CD3", "CD4", "CD8"]
    path = save(
        model,
        tmp_path / "m",
        name="controlled",
        version="1",
        panel=Panel(tuple(markers)).to_json(),
        preprocessing=Preprocessing().to_json(),
    )
    test, _ = cohort(1, False)
    control, _ = cohort(1, True)
    files = [write_csv(tmp_path / f"s{t}.csv", np.asarray(test[t]), markers) for t in range(2)]
    tube = write_csv(tmp_path / "control.csv", control.points, markers)
    assert main(["predict", str(path), *map(str, files), "--control", str(tube), "--cells"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["control"] == {
        "file": str(tube),
        "sha256": hashlib.sha256(tube.read_bytes()).hexdigest(),
    }
    expected = model.predict_tasks(test[:2], control=control.points)
    for got, want in zip(answer["results"], expected, strict=True):
        assert got["labels"] == want.predictions.tolist()
        calibration = got["report"]["calibration"]
        assert calibration["by"] == "control" and list(calibration["moved"]) == markers
        assert "refused" not in calibration
        moved = [calibration["moved"][m] for m in markers]
        np.testing.assert_allclose(moved, want.report.calibration.moved, atol=1e-4)
    # Without the control, each file is calibrated by its own landmarks, as the
    # estimator does without one, and the quality reported is the landmark map's.
    assert main(["predict", str(path), *map(str, files), "--cells"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "control" not in plain
    assert plain["results"][0]["report"]["calibrated"] == "landmarks"
    assert plain["results"][0]["report"]["calibration"]["by"] == "landmarks"
    assert plain["results"][0]["report"]["calibration"]["refused"] is False
    alone = model.predict_tasks(test[:2])
    assert [r["labels"] for r in plain["results"]] == [a.predictions.tolist() for a in alone]
    url = ["--url", "http://127.0.0.1:9"]
    assert main(["predict", "m", str(files[0]), "--control", str(tube), *url]) == 1
    assert "name it with ?control=ID" in capsys.readouterr().err
    plain_model = MarginalTransferClassifier(**PLAIN).fit(*cohort(0, False))
    other = save(
        plain_model,
        tmp_path / "plain",
        panel=Panel(tuple(markers)).to_json(),
        preprocessing=Preprocessing().to_json(),
    )
    assert main(["predict", str(other), str(files[0]), "--control", str(tube)]) == 1
    assert "trained without a reference control" in capsys.readouterr().err


def _write(path, cells, labels=None):
    cols = [f"M{j}" for j in range(cells.shape[1])] + ([] if labels is None else ["y"])
    rows = cells if labels is None else np.column_stack([cells, labels])
    np.savetxt(path, rows, delimiter=",", header=",".join(cols), comments="", fmt="%.10g")


def test_a_training_configuration_names_the_reference_control(cohort, tmp_path):
    """``[data] control``: the trained model keeps that file's quantiles (after the
    same preprocessing) and its sha256; a bag-level model or a missing file is a
    configuration error naming it."""
    import hashlib
    import textwrap

    from bagserve.core.errors import ConfigError
    from bagserve.core.training import train

    train_bags, y = cohort(0, False)
    control, _ = cohort(0, True)
    (tmp_path / "data").mkdir()
    for t in range(len(train_bags)):
        lo, hi = train_bags.offsets[t], train_bags.offsets[t + 1]
        _write(tmp_path / "data" / f"s{t}.csv", np.asarray(train_bags[t]), y[lo:hi])
    _write(tmp_path / "control.csv", control.points)
    estimator = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in FIXED.items())
    config = (
        textwrap.dedent(
            """
        [model]
        name = "controlled"
        output = "models"
        [data]
        files = "data/*.csv"
        cell_label_column = "y"
        control = "control.csv"
        [panel]
        markers = ["M0", "M1", "M2"]
        [estimator]
        class = "MarginalTransferClassifier"
        """
        )
        + estimator
        + "\n[cv]\nn_splits = 2\n[search]\nwiden_edges = false\n"
    )
    cfg = tmp_path / "controlled.toml"
    cfg.write_text(config)
    result = train(cfg)
    model = load(result.path)
    # The file's cells as written (10 significant digits), no preprocessing configured.
    cells = np.loadtxt(tmp_path / "control.csv", delimiter=",", skiprows=1)
    np.testing.assert_allclose(
        _reference(model)[0], np.quantile(cells, CONTROL_LEVELS, axis=0), rtol=1e-12
    )
    digest = hashlib.sha256((tmp_path / "control.csv").read_bytes()).hexdigest()
    assert result.metrics["reference_control"] == {"file": "control.csv", "sha256": digest}
    card = (result.path / "card.md").read_text()
    assert "reference control" in card and digest[:12] in card
    cfg.write_text(config.replace('control = "control.csv"', 'control = "tube.csv"'))
    with pytest.raises(ConfigError, match=r"tube\.csv"):
        train(cfg, overwrite=True)


def test_a_fold_without_a_class_keeps_its_scores_in_their_columns():
    """Out-of-fold scores of a per-cell classifier where one fold's training samples
    lack a class (a rare population in one sample): the fold model's scores sit in
    its classes' columns and the class it cannot give scores -1, where the search
    used to fail on the shapes."""
    from bagserve.core.training.folds import cv_predictions as _cv_predictions

    rng = np.random.default_rng(5)
    arrays, labels = [], []
    for t in range(4):
        y = rng.choice(3 if t == 0 else 2, size=300)
        arrays.append(rng.normal(size=(300, 2)) + 3.0 * np.eye(3)[y][:, :2])
        labels.append(y)
    bags, y = Bags.from_arrays(arrays), np.concatenate(labels)
    folds = [(np.array([1, 2, 3]), np.array([0])), (np.array([0, 2, 3]), np.array([1]))]
    est = MarginalTransferClassifier(**PLAIN)
    scores: dict[str, np.ndarray] = {}
    _cv_predictions(est, bags, y, folds, True, {}, ["a", "b"], scores_out=scores)
    (got,) = scores.values()
    assert got.shape == (1200, 3)
    lone = MarginalTransferClassifier(**PLAIN).fit(bags[[1, 2, 3]], y[300:])
    margin = lone.decision_function(bags[[0]])  # two classes: one margin
    np.testing.assert_array_equal(got[:300], np.column_stack([-margin, margin, -np.ones(300)]))


def test_the_service_takes_the_control_as_a_named_bag(cohort, model, tmp_path):
    """``?control=ID`` on /v1 (the real app under uvicorn): the named bag maps the
    others, gets no answer, and is named in a note with its sha256; the answers are
    the estimator's with that control; a control the request lacks, a request of the
    control alone, or a model trained without one, is a 422 naming the problem."""
    import httpx
    from bagserve.core.io.panel import Panel
    from bagserve.core.io.preprocessing import Preprocessing

    from .service_harness import running_service

    markers = ["CD3", "CD4", "CD8"]
    meta = {"panel": Panel(tuple(markers)).to_json(), "preprocessing": Preprocessing().to_json()}
    models = tmp_path / "models"
    save(model, models / "controlled" / "1", name="controlled", version="1", **meta)
    train, y = cohort(0, False)
    plain = MarginalTransferClassifier(**PLAIN).fit(train, y)
    save(plain, models / "plain" / "1", name="plain", version="1", **meta)
    test, _ = cohort(1, False)
    control, _ = cohort(1, True)

    def bag(name, cells):
        return {"id": name, "markers": markers, "points": np.round(cells, 6).tolist()}

    samples = [np.round(np.asarray(test[t]), 6) for t in range(2)]
    tube = np.round(control.points, 6)
    body = {"bags": [bag("s0", samples[0]), bag("tube", tube), bag("s1", samples[1])]}
    with running_service(models) as url, httpx.Client(base_url=url, timeout=120) as client:
        r = client.post("/v1/models/controlled/predict?control=tube", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert [p["id"] for p in answer["predictions"]] == ["s0", "s1"]
        assert any("'tube' is this batch's reference control" in n for n in answer["notes"])
        want = model.predict_tasks(Bags.from_arrays(samples), control=tube)
        for got, expected in zip(answer["predictions"], want, strict=True):
            assert got["labels"] == expected.predictions.tolist()
            assert list(got["report"]["calibration"]["moved"]) == markers
        for query, body_, model_name, message in (
            ("control=tub", body, "controlled", "names no bag of the request"),
            ("control=tube", {"bags": [bag("tube", tube)]}, "controlled", "no other bag"),
            ("control=tube", body, "plain", "trained without a reference control"),
        ):
            r = client.post(f"/v1/models/{model_name}/predict?{query}", json=body_)
            assert r.status_code == 422 and message in r.text, r.text


def test_the_explanation_is_of_the_shares_the_control_gives(cohort, model):
    """``explain(control=)`` accounts for the labels the control's map gives, not
    those of the sample as measured (issue 45)."""
    test, _ = cohort(1, False)
    control, _ = cohort(1, True)
    cells = np.asarray(test[0])
    labels = model.predict_tasks([cells], control=control.points)[0].predictions
    shares = [np.mean(labels == c) for c in model.classes_]
    e = model.explain(cells, control=control.points)
    np.testing.assert_allclose(e.prediction, shares, atol=1e-15)
    np.testing.assert_array_equal(e.labels, labels.astype(str))
    assert not np.allclose(model.explain(cells).prediction, shares)
