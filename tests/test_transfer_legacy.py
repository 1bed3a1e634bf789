"""Marginal-transfer models saved before issue 44's rebuild load and answer the same.

``tests/data/legacy_transfer`` holds six models saved by bagserve at 2db7065 (the
last commit of the old design): a default classifier with its invariant fallback and
landmark calibration; one with a rest label, a reject threshold and a reference
control; the exact solver; a per-task mixture refinement on quantile-normalised
tasks; the MMD calibration of tasks out of range; a regressor. Beside each, the
answers that version gave on the other batch's samples (its ``predict_tasks``; for
the MMD model, on those samples moved out of range, stored with the answers). The
frozen design in ``core.estimators.transfer.legacy`` must give them back bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bagserve.core import Bags, load
from bagserve.core.estimators.transfer import legacy

DATA = Path(__file__).parent / "data" / "legacy_transfer"
NAMES = [
    "classifier-default",
    "classifier-rest-control",
    "classifier-exact",
    "classifier-refine-quantile",
    "classifier-mmd",
    "regressor-default",
]


def _inputs() -> tuple[Bags, np.ndarray]:
    raw = np.load(DATA / "inputs.npz")
    return Bags(raw["points"], raw["offsets"]), raw["control"]


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


def test_a_model_of_the_old_design_says_it_has_no_explanation():
    """Issue 45: the explanation is the rebuilt design's; a saved model of the old one
    is refused by name (the doors answer 422 with this), not explained wrongly."""
    from bagserve.core.runtime import ModelRuntime

    runtime = ModelRuntime.open(DATA / "classifier-default")
    bags, _ = _inputs()
    with pytest.raises(TypeError, match=r"before issue 44.*retrain"):
        runtime.explain(bags, preprocessed=True)
