"""Models saved by the first round of issue 44's design load and answer the same.

``tests/data/transfer_first_round`` holds a landmark classifier saved by bagserve at
91cbc15 (the first commit of the rebuilt design on main), with the answers that
version gave on three samples of one patient seen through instruments of growing
size: one under the landmark gain limit (left as measured), one past it by a quarter
of the limit, one three limits past it. The gate's decision is part of the answer:
a change to the gate or the map for new models (tried: a share of the map past the
limit) must leave these as they were.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from bagserve.core import Bags, MarginalTransferClassifier, load

DATA = Path(__file__).parent / "data" / "transfer_first_round"


def test_a_landmark_model_of_the_first_round_answers_as_it_did():
    model = load(DATA / "classifier-landmarks")
    assert type(model) is MarginalTransferClassifier
    expected = np.load(DATA / "classifier-landmarks.npz")
    tasks = Bags(expected["points"], expected["offsets"])
    answers = model.predict_tasks(tasks)
    np.testing.assert_array_equal(
        np.concatenate([a.predictions for a in answers]), expected["predictions"]
    )
    np.testing.assert_array_equal(np.concatenate([a.scores for a in answers]), expected["scores"])
    np.testing.assert_array_equal(
        [str(a.report.calibrated) for a in answers], expected["calibrated"]
    )
    np.testing.assert_array_equal([a.report.shift for a in answers], expected["shift"])
    # The middle sample is just past the limit, where a change of gate would show.
    assert expected["calibrated"].tolist() == ["None", "landmarks", "landmarks"]
