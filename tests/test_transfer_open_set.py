"""The open-set outcome of the marginal-transfer classifier: cells no population
claims, decided on the calibrated sample (issue 44, point 5)."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import MarginalTransferClassifier
from bagserve.core.artifacts import load
from bagserve.core.bags import BagValidationError
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.errors import ConfigError
from bagserve.core.estimators.transfer.open_set import (
    REJECT_THRESHOLDS,
    apply_reject,
    choose_reject,
    far_from_populations,
)
from bagserve.core.training import train
from scipy.spatial.distance import mahalanobis
from scipy.stats import chi2


def batched(n_cells: int = 150):
    return make_batched_cytometry_tasks(
        2, 4, n_cells, n_markers=4, n_populations=3, random_state=0, strength=2.0
    )


SMALL = {"n_components": 16, "cv": 2, "perturbations": 2, "random_state": 0}


# ----------------------------------------------------------------- the reject rule
def test_reject_fires_exactly_where_no_population_reaches_the_threshold():
    rng = np.random.default_rng(0)
    scores = rng.uniform(-1.0, 1.0, size=(500, 4))
    rest = 2
    codes = apply_reject(scores, rest, 0.1)
    others = np.delete(scores, rest, axis=1).max(axis=1)
    # Oracle: the rest class where every population scores below θ, else the best.
    np.testing.assert_array_equal(codes[others < 0.1], rest)
    np.testing.assert_array_equal(codes[others >= 0.1], scores[others >= 0.1].argmax(axis=1))
    np.testing.assert_array_equal(apply_reject(scores, rest, None), scores.argmax(axis=1))


def test_the_threshold_is_off_unless_it_beats_off_by_more_than_its_noise():
    """choose_reject's documented rule, recomputed: the best threshold's mean gain in
    accuracy over "off" must exceed the standard error of that gain."""
    rng = np.random.default_rng(3)
    held = []
    for _ in range(6):
        y = rng.integers(0, 3, 400)
        s = -np.ones((400, 3)) + 0.2 * rng.normal(size=(400, 3))
        s[np.arange(400), y] += 1.2
        # Rest cells (class 0) whose best population is weak: a threshold helps.
        s[y == 0, 0] = -0.9
        held.append((s, y))
    chosen, accuracy = choose_reject(held, 0)
    gains = np.array(
        [[np.mean(apply_reject(s, 0, t) == y) - np.mean(apply_reject(s, 0, None) == y)
          for s, y in held] for t in REJECT_THRESHOLDS]
    )  # fmt: skip
    best = int(np.argmax(gains.mean(axis=1)))
    se = gains[best].std(ddof=1) / np.sqrt(gains.shape[1])
    assert chosen == (REJECT_THRESHOLDS[best] if gains[best].mean() > se else None)
    assert chosen is not None and next(iter(accuracy)) == "None"
    # Pure noise: no threshold helps, the rule stays off.
    flat = [(np.zeros((50, 3)) + rng.normal(0, 1e-3, (50, 3)), rng.integers(0, 3, 50))] * 2
    assert choose_reject(flat, 0)[0] is None


def test_a_model_with_a_rest_label_applies_its_chosen_threshold(tmp_path):
    tasks, y, _ = batched()
    model = MarginalTransferClassifier(unassigned=0, **SMALL).fit(tasks, y)
    assert model.reject_threshold_ in (None, *REJECT_THRESHOLDS)
    scores = model.decision_function(tasks)
    np.testing.assert_array_equal(
        model.predict(tasks), model.classes_[apply_reject(scores, 0, model.reject_threshold_)]
    )


def test_an_unassigned_label_that_names_no_class_is_refused():
    tasks, y, _ = batched()
    with pytest.raises(BagValidationError, match="unassigned='gate 9' names no training label"):
        MarginalTransferClassifier(unassigned="gate 9", **SMALL).fit(tasks, y)


def test_far_from_populations_is_the_chi_square_cut_of_the_mahalanobis_distance():
    rng = np.random.default_rng(1)
    means = np.array([[0.0, 0.0], [5.0, 5.0]])
    covs = np.array([[[1.0, 0.3], [0.3, 0.5]], [[0.4, 0.0], [0.0, 2.0]]])
    precisions = np.linalg.inv(covs)
    points = rng.normal(0.0, 3.0, size=(300, 2))
    codes = rng.integers(0, 2, 300)
    far = far_from_populations(points, codes, means, precisions, 0.99)
    cut = chi2.ppf(0.99, 2)
    naive = np.array(
        [
            mahalanobis(p, means[c], precisions[c]) ** 2 > cut
            for p, c in zip(points, codes, strict=True)
        ]
    )
    np.testing.assert_array_equal(far, naive)
    # A population without statistics (the rest class) is never far.
    means[1] = np.nan
    assert not far_from_populations(points, codes, means, precisions, 0.99)[codes == 1].any()


def test_the_model_reports_cells_far_from_every_population_on_request():
    tasks, y, _ = batched()
    model = MarginalTransferClassifier(calibrate="none", cell_model="linear", **SMALL)
    model.fit(tasks, y)
    labels = model.predict(tasks)
    far = model.far_from_populations(tasks, labels, level=0.999)
    assert far.shape == (tasks.n_points,) and far.mean() < 0.05
    outlier = np.asarray(tasks[0]).copy()
    outlier[:5] += 50.0
    labels = model.predict([outlier])
    assert model.far_from_populations([outlier], labels)[:5].all()


def _config(tmp_path, labels: str, estimator: str = "MarginalTransferClassifier") -> str:
    tasks, y, _ = batched(60)
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for t in range(len(tasks)):
        x = np.asarray(tasks[t])
        lab = y[tasks.offsets[t] : tasks.offsets[t + 1]]
        rows = "\n".join(
            ",".join(f"{v:.6f}" for v in r) + f",{c}" for r, c in zip(x, lab, strict=True)
        )
        (data / f"s{t}.csv").write_text("M0,M1,M2,M3,y\n" + rows + "\n")
    params = "random_state = 0"
    if estimator == "MarginalTransferClassifier":
        params += "\nn_components = 16\ncv = 2\nperturbations = 2"
    cfg = tmp_path / "open.toml"
    cfg.write_text(
        f"""
[model]
name = "open"
output = "models"
[data]
files = "data/*.csv"
cell_label_column = "y"
{labels}
[panel]
markers = ["M0", "M1", "M2", "M3"]
[estimator]
class = "{estimator}"
{params}
[search]
widen_edges = false
"""
    )
    return str(cfg)


def test_the_configuration_names_the_rest_label_and_answers_call_it_unassigned(tmp_path):
    result = train(_config(tmp_path, '[labels]\nunassigned = "0"'))
    model = load(result.path)
    assert model.classes_.tolist() == ["1", "2", "unassigned"]
    assert model.unassigned == "unassigned"
    assert "unassigned" in result.metrics["cv"]["labels"]


@pytest.mark.parametrize(
    ("labels", "estimator", "message"),
    [
        ('[labels]\nunassigned = "7"', "MarginalTransferClassifier", "names no label of the data"),
        ('[labels]\nrest = "0"', "MarginalTransferClassifier", r"\[labels\] unknown key"),
        ('[labels]\nunassigned = "0"', "DistributionRidgeClassifier", "labels no cells"),
    ],
)
def test_a_rest_label_the_data_or_model_cannot_take_is_refused(
    tmp_path, labels, estimator, message
):
    with pytest.raises(ConfigError, match=message):
        train(_config(tmp_path, labels, estimator))
