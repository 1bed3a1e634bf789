"""Marginal-transfer models saved before issue 44's rebuild load and answer the same.

``tests/data/legacy_transfer`` holds six models saved by bagserve at 2db7065 (the
last commit of the old design): a default classifier with its invariant fallback and
landmark calibration; one with a rest label, a reject threshold and a reference
control; the exact solver; a per-task mixture refinement on quantile-normalised
tasks; the MMD calibration of tasks out of range; a regressor. Beside each, the
answers that version gave on the other batch's samples (its ``predict_tasks``; for
the MMD model, on those samples moved out of range, stored with the answers). Three
more were saved by that design's code as frozen at fb71605, with the answers it gave
on the samples stored beside them: the paper's two-layer random features
(``task_map="rff"``), an invariant fallback of boosted trees, and the quantile
calibration of tasks out of range. The frozen design in
``core.estimators.transfer.legacy``, cut to its answer path, must give them back bit
for bit, through every question the runtime and the service ask of a per-cell model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bagserve.core import Bags, load
from bagserve.core.estimators import transfer
from bagserve.core.estimators.transfer import legacy
from bagserve.core.runtime import ModelRuntime
from scipy.stats import chi2

DATA = Path(__file__).parent / "data" / "legacy_transfer"
NAMES = [
    "classifier-default",
    "classifier-rest-control",
    "classifier-exact",
    "classifier-refine-quantile",
    "classifier-mmd",
    "regressor-default",
    "classifier-rff",
    "classifier-trees",
    "classifier-quantile",
]


def _inputs() -> tuple[Bags, np.ndarray]:
    raw = np.load(DATA / "inputs.npz")
    return Bags(raw["points"], raw["offsets"]), raw["control"]


def _case(name: str) -> tuple[Bags, np.ndarray | None, dict[str, np.ndarray]]:
    """The samples a fixture answered, its batch's control (or None) and its answers."""
    tasks, control = _inputs()
    expected = dict(np.load(DATA / f"{name}.npz"))
    if "points" in expected:
        tasks = Bags(expected["points"], expected["offsets"])
    return tasks, control if "control" in name else None, expected


@pytest.mark.parametrize("name", NAMES)
def test_a_model_saved_by_the_old_design_loads_as_it_and_answers_the_same(name):
    model = load(DATA / name)
    assert isinstance(model, legacy.estimator._MarginalTransfer)
    tasks, control = _inputs()
    expected = np.load(DATA / f"{name}.npz")
    if "points" in expected:
        tasks = Bags(expected["points"], expected["offsets"])
    answers = model.predict_tasks(tasks, control=control if "control" in name else None)
    predictions = np.concatenate([a.predictions for a in answers])
    np.testing.assert_array_equal(predictions, expected["predictions"])
    np.testing.assert_array_equal(np.concatenate([a.scores for a in answers]), expected["scores"])
    np.testing.assert_array_equal([a.report.distance for a in answers], expected["distance"])
    np.testing.assert_array_equal(
        [a.report.out_of_range for a in answers], expected["out_of_range"]
    )


def test_a_model_of_the_current_design_loads_as_the_current_class(tmp_path):
    from bagserve.core import MarginalTransferClassifier, save

    tasks, _ = _inputs()
    labels = (np.asarray(tasks.points)[:, 0] > 0).astype(int)
    model = MarginalTransferClassifier(cell_model="linear", calibrate="none").fit(tasks, labels)
    back = load(save(model, tmp_path / "m"))
    assert type(back) is MarginalTransferClassifier
    np.testing.assert_array_equal(back.predict(tasks), model.predict(tasks))


def _answering_methods(cls: type) -> set[str]:
    """The public methods the current design's class and its bases in the transfer
    package define: what the runtime, the service and callers ask of a per-cell model
    (``fit`` aside: an old model answers, it is not fitted again; ``explain`` aside:
    the doors refuse an old model's explanation by name, tested below)."""
    return {
        name
        for klass in cls.__mro__
        if klass.__module__.startswith(transfer.__name__)
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_")
    } - {"fit", "explain"}


@pytest.mark.parametrize("name", ["MarginalTransferClassifier", "MarginalTransferRegressor"])
def test_an_old_model_offers_every_answer_the_current_design_offers(name):
    asked = _answering_methods(getattr(transfer, name))
    assert {"predict_tasks", "domain_report", "predict"} <= asked  # the check sees them
    assert asked - set(dir(getattr(legacy, name))) == set()


@pytest.mark.parametrize("name", NAMES)
def test_every_answer_of_an_old_model_agrees_with_what_it_gave(name):
    """predict, decision_function, decode_scores, task_report and domain_check give
    what predict_tasks gave when the model was saved."""
    model = load(DATA / name)
    tasks, control, expected = _case(name)
    labels, scores = expected["predictions"], expected["scores"]
    np.testing.assert_array_equal(model.predict(tasks, control=control), labels)
    reports = model.task_report(tasks, control=control)
    np.testing.assert_array_equal([r.distance for r in reports], expected["distance"])
    np.testing.assert_array_equal([r.out_of_range for r in reports], expected["out_of_range"])
    domain = model.domain_check(tasks, control=control)
    np.testing.assert_array_equal(domain.distance, expected["distance"])
    np.testing.assert_array_equal(domain.out_of_range, expected["out_of_range"])
    if name.startswith("classifier"):
        given = model.decision_function(tasks, control=control)
        np.testing.assert_array_equal(given, scores)
        np.testing.assert_array_equal(model.decode_scores(given), labels)


def _far_oracle(model, points: np.ndarray, labels: np.ndarray, level: float) -> np.ndarray:
    """Squared Mahalanobis distance of each cell to its population's training mean under
    its training precision beyond the χ² quantile, cell by cell (rest class: never)."""
    codes = np.searchsorted(model.classes_, labels)
    cut = chi2.ppf(level, points.shape[1])
    far = []
    for x, k in zip(points, codes, strict=True):
        mean = model.population_means_[k]
        far.append(
            bool(
                not np.isnan(mean).any()
                and (x - mean) @ model.population_precisions_[k] @ (x - mean) > cut
            )
        )
    return np.array(far)


@pytest.mark.parametrize("name", NAMES)
def test_the_runtime_answers_an_old_model_as_it_answered(name):
    """The one prediction path of the service and the command line: labels, domain
    report and, for classifiers that kept their populations, the cells far from them."""
    runtime = ModelRuntime.open(DATA / name)
    tasks, control, expected = _case(name)
    batch = None if control is None else Bags.from_arrays([control])
    result = runtime.predict(tasks, control=batch)
    np.testing.assert_array_equal(result.labels, expected["predictions"])
    np.testing.assert_array_equal(result.domain.distance, expected["distance"])
    np.testing.assert_array_equal(result.domain.out_of_range, expected["out_of_range"])
    np.testing.assert_array_equal(result.sizes, tasks.sizes)
    if runtime.info.far_cells_problem() is not None:
        assert name.startswith("regressor")
        return
    answered = runtime.predict(tasks, control=batch, unassigned=0.99)
    model = runtime.model
    if control is None and model.normalise_ == "none":  # the cells as the model sees them
        far = _far_oracle(model, tasks.points, expected["predictions"], 0.99)
        assert far.any()
        np.testing.assert_array_equal(answered.labels == "unassigned", far)
    kept = answered.labels != "unassigned"
    np.testing.assert_array_equal(answered.labels[kept], expected["predictions"][kept].astype(str))


def test_a_blend_partner_saved_before_it_shared_the_task_view_answers_the_same():
    """Models saved before a blend partner recorded ``shares_task_view_`` have it
    normalise and embed the tasks itself: the same answers."""
    model = load(DATA / "classifier-default")
    tasks, _, expected = _case("classifier-default")
    for partner in (model.blend_, model.fallback_.blend_):
        del partner.shares_task_view_
    answers = model.predict_tasks(tasks)
    np.testing.assert_array_equal(np.concatenate([a.scores for a in answers]), expected["scores"])


def test_an_old_model_cannot_be_fitted_again():
    model = load(DATA / "classifier-default")
    tasks, _ = _inputs()
    with pytest.raises(TypeError, match=r"cannot be fitted again.*MarginalTransferClassifier"):
        model.fit(tasks, np.zeros(tasks.n_points))


def test_a_model_of_the_old_design_says_it_has_no_explanation():
    """Issue 45: the explanation is the rebuilt design's; a saved model of the old one
    is refused by name (the doors answer 422 with this), not explained wrongly."""
    from bagserve.core.runtime import ModelRuntime

    runtime = ModelRuntime.open(DATA / "classifier-default")
    bags, _ = _inputs()
    with pytest.raises(TypeError, match=r"before issue 44.*retrain"):
        runtime.explain(bags, preprocessed=True)
