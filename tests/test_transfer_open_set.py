"""The open-set outcome (cells no population claims) and the calibration of new
batches to the training reference, for the marginal-transfer classifier."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import Bags, MarginalTransferClassifier
from bagserve.core.alignment import calibrate, landmark_shift, mmd_map
from bagserve.core.artifacts import load
from bagserve.core.bags import BagValidationError, align_quantiles, bag_quantiles
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.errors import ConfigError
from bagserve.core.estimators._transfer_reject import far_from_populations, reject_scores
from bagserve.core.training import train
from scipy.spatial.distance import mahalanobis
from scipy.stats import chi2


def batched(n_cells: int = 150):
    return make_batched_cytometry_tasks(
        2, 4, n_cells, n_markers=4, n_populations=3, random_state=0, strength=2.0
    )


SMALL = {"n_components": 16, "alpha": [1e-3], "random_state": 0}


# ----------------------------------------------------------------- the reject rule
def test_reject_fires_exactly_where_no_population_reaches_the_threshold():
    rng = np.random.default_rng(0)
    scores = rng.uniform(-1.0, 1.0, size=(500, 4))
    rest = 2
    out = reject_scores(scores, rest, 0.1)
    others = np.delete(scores, rest, axis=1).max(axis=1)
    labels = out.argmax(axis=1)
    # Oracle: the rest class where every population scores below θ, else unchanged.
    np.testing.assert_array_equal(labels[others < 0.1], rest)
    np.testing.assert_array_equal(out[others >= 0.1], scores[others >= 0.1])
    assert reject_scores(scores, rest, None) is scores


@pytest.mark.parametrize("rest", [0, 1])
def test_reject_of_two_classes_moves_the_margin_to_the_rest_side(rest):
    s = np.array([[-0.9], [-0.1], [0.05], [0.8]])
    out = reject_scores(s, rest, 0.3)
    per_class = np.hstack([-s, s])
    population = 1 - rest
    fire = per_class[:, population] < 0.3
    decoded = (out[:, 0] > 0).astype(int)
    np.testing.assert_array_equal(decoded[fire], rest)
    np.testing.assert_array_equal(out[~fire], s[~fire])


def test_a_fixed_threshold_is_the_rule_applied_to_the_models_scores():
    tasks, y, _ = batched()
    kw = {**SMALL, "tau": [0.0, 1.0], "normalise": "none", "refine": "none"}
    off = MarginalTransferClassifier(unassigned=0, reject="off", **kw).fit(tasks, y)
    on = MarginalTransferClassifier(unassigned=0, reject=0.2, **kw).fit(tasks, y)
    assert off.reject_threshold_ is None and on.reject_threshold_ == 0.2
    manual = reject_scores(off.decision_function(tasks), 0, 0.2)
    np.testing.assert_array_equal(on.predict(tasks), off.classes_[manual.argmax(axis=1)])
    assert np.mean(on.predict(tasks) == 0) > np.mean(off.predict(tasks) == 0)


def test_the_folds_choose_the_threshold_off_first():
    tasks, y, _ = batched()
    model = MarginalTransferClassifier(
        unassigned=0, tau=[0.0, 1.0], normalise="none", refine="none", cv=2, **SMALL
    ).fit(tasks, y)
    record = model.selection_["reject"]
    assert next(iter(record["cv_error"])) == "off"
    errs = {k: np.asarray(v) for k, v in record["fold_errors"].items()}
    best = min(errs, key=lambda k: errs[k].mean())
    for name, e in errs.items():  # the documented rule, recomputed
        d = e - errs[best]
        if d.mean() <= d.std(ddof=1) / np.sqrt(d.size):
            assert record["chosen"] == name
            break
    assert model.reject_threshold_ == (
        None if record["chosen"] == "off" else float(record["chosen"])
    )


def test_an_unassigned_label_that_names_no_class_is_refused():
    tasks, y, _ = batched()
    with pytest.raises(BagValidationError, match="unassigned='gate 9' names no training label"):
        MarginalTransferClassifier(unassigned="gate 9", **SMALL).fit(tasks, y)
    with pytest.raises(ValueError, match="reject must be"):
        MarginalTransferClassifier(unassigned=0, reject="sometimes", **SMALL).fit(tasks, y)


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
    model = MarginalTransferClassifier(tau=[1.0], normalise="none", refine="none", **SMALL)
    model.fit(tasks, y)
    labels = model.predict(tasks)
    far = model.far_from_populations(tasks, labels, level=0.999)
    assert far.shape == (tasks.n_points,) and far.mean() < 0.05
    outlier = np.asarray(tasks[0]).copy()
    outlier[:5] += 50.0
    labels = model.predict([outlier])
    assert model.far_from_populations([outlier], labels)[:5].all()


# ----------------------------------------------------------------- calibration
def test_the_mmd_map_improves_on_its_quantile_start():
    rng = np.random.default_rng(2)
    ref = np.vstack([rng.normal(0, 1, (600, 2)), rng.normal([3, 2], 0.5, (400, 2))])
    # The same populations after spillover of marker 0 into marker 1 (a mixing no
    # per-marker map undoes) and a monotone gain per marker.
    x = np.vstack([rng.normal(0, 1, (600, 2)), rng.normal([3, 2], 0.5, (400, 2))])
    x = x @ np.array([[1.0, 0.6], [0.0, 1.0]])
    moved = np.column_stack([np.exp(0.3 * x[:, 0]) + 1.0, 2.0 * x[:, 1] - 1.0])

    def mmd(a, b, h=1.0):
        def k(u, v):
            return np.exp(-((u[:, None] - v[None]) ** 2).sum(-1) / (2 * h * h)).mean()

        return k(a, a) + k(b, b) - 2 * k(a, b)

    q = np.asarray(
        align_quantiles(Bags.from_arrays([moved]), bag_quantiles(Bags.from_arrays([ref]))[0]).points
    )
    mapped = mmd_map(moved, ref, random_state=0)
    assert mmd(mapped, ref) < mmd(q, ref) < mmd(moved, ref)
    np.testing.assert_array_equal(mapped, mmd_map(moved, ref, random_state=0))
    with pytest.raises(ValueError, match="calibration must be one of"):
        calibrate(Bags.from_arrays([moved]), "spline", bag_quantiles(Bags.from_arrays([ref]))[0])


def test_the_mmd_gradient_weights_are_the_sum_of_the_gaussians_to_the_last_bit():
    """Computed in place for speed: equal, bit for bit, to the formula written out."""
    from bagserve.core.alignment import _gradient_weights

    rng = np.random.default_rng(0)
    sq = rng.uniform(0.0, 20.0, size=(60, 70))
    h2 = (np.array([0.5, 1.0, 2.0]) * 1.9) ** 2
    naive = sum(np.exp(-sq / (2.0 * h)) / h for h in h2)
    np.testing.assert_array_equal(_gradient_weights(sq, h2), naive)
    np.testing.assert_array_equal(_gradient_weights(sq, h2[:1]), np.exp(-sq / (2 * h2[0])) / h2[0])


def test_tasks_mapped_at_once_are_mapped_as_each_alone():
    """``calibrate(..., "mmd")`` fits the tasks' maps on threads: each task's map is
    the one :func:`mmd_map` fits for it alone, to the last bit, whatever the order the
    threads finish in."""
    from bagserve.core.blas import one_thread

    tasks, _, _ = batched(300)
    reference = np.asarray(tasks[0])
    done = calibrate(tasks[1:], "mmd", bag_quantiles(tasks[:1])[0], reference, 7)
    with one_thread():
        alone = [mmd_map(np.asarray(tasks[t]), reference, 7) for t in range(1, len(tasks))]
    np.testing.assert_array_equal(done.points, np.vstack(alone))
    np.testing.assert_array_equal(done.offsets, tasks[1:].offsets)


def test_calibration_is_chosen_on_held_out_batches_and_none_without_them():
    tasks, y, batches = batched()
    kw = {**SMALL, "tau": [0.0, 1.0], "refine": "none"}
    model = MarginalTransferClassifier(**kw).fit(tasks, y, groups=batches)
    record = model.selection_["calibration"]
    assert list(record["cv_error"]) == ["none", "quantile", "mmd"]
    assert model.calibration_ == record["chosen"]
    landmarks = record["landmarks"]  # measured on refits of held-out batches
    assert list(landmarks["cv_error"]) == ["none", "landmarks"]
    assert len(landmarks["fold_errors"]["none"]) == 2
    if landmarks["chosen"] == "landmarks":
        assert model.calibration_ == "landmarks"
    # Without batches nothing measures it: the stated rule, landmarks for classifiers.
    alone = MarginalTransferClassifier(**kw).fit(tasks, y)
    assert alone.calibration_ == "landmarks"
    assert "stated rule" in alone.selection_["calibration"]["rule"]


def test_landmark_shift_is_the_share_weighted_mean_of_the_centre_differences():
    rng = np.random.default_rng(3)
    centres = np.array([[0.0, 0.0], [4.0, 1.0], [1.0, 5.0], [9.0, 9.0]])
    codes = rng.choice(4, size=400, p=[0.5, 0.3, 0.15, 0.05])
    x = centres[codes] + rng.normal(0, 0.3, (400, 2)) + np.array([2.0, -1.0])
    shift = landmark_shift(x, codes, centres, skip=3)
    # Naive oracle: per population (rest and rare ones left out), its mean's distance
    # to the training centre, weighted by its cell count.
    use = [k for k in range(3) if np.sum(codes == k) >= 20]
    w = np.array([np.sum(codes == k) for k in use], dtype=float)
    diffs = np.array([centres[k] - x[codes == k].mean(axis=0) for k in use])
    np.testing.assert_allclose(shift, (w[:, None] * diffs).sum(0) / w.sum())
    np.testing.assert_allclose(shift, [-2.0, 1.0], atol=0.1)
    assert landmark_shift(x, np.zeros(400, dtype=np.int64), centres) is None
    # With the populations' spreads: per marker, the inverse-variance weighted mean
    # (weights n_k / σ²_kd), so a diffuse population barely moves the shift.
    spread = np.array([[1.0, 4.0], [0.25, 0.25], [9.0, 1.0], [1.0, 1.0]])
    weighted = landmark_shift(x, codes, centres, skip=3, spread=spread)
    wd = w[:, None] / spread[use]
    np.testing.assert_allclose(weighted, (wd * diffs).sum(0) / wd.sum(0))
    # A diffuse population whose centre moved on its own (a mixture's proportions):
    # its pull on the shift shrinks with its spread.
    x2 = x.copy()
    x2[codes == 2] += 3.0
    naive = landmark_shift(x2, codes, centres, skip=3)
    robust = landmark_shift(x2, codes, centres, skip=3, spread=spread)
    assert np.abs(robust - [-2.0, 1.0]).max() < np.abs(naive - [-2.0, 1.0]).max()


def test_a_task_shifted_beyond_the_training_tasks_is_moved_back_by_its_landmarks():
    tasks, y, _ = batched(300)
    train = Bags.from_arrays([np.asarray(tasks[t]) for t in range(4)])
    y_train = y[: train.n_points]
    kw = {**SMALL, "tau": [0.0], "normalise": "none", "refine": "none", "point_bandwidth": 1.0}
    model = MarginalTransferClassifier(calibrate="landmarks", **kw).fit(train, y_train)
    original = np.asarray(tasks[1])
    truth = y[train.offsets[1] : train.offsets[2]]
    moved = original + np.array([3.0, -2.5, 2.0, 1.5])  # an instrument's offsets
    (report,) = model.task_report([moved])
    assert report.calibrated == "landmarks" and report.out_of_range
    here = np.mean(model.predict([original]) == truth)
    calibrated = np.mean(model.predict([moved]) == truth)
    model.calibration_ = "none"
    plain = np.mean(model.predict([moved]) == truth)
    assert calibrated >= here - 0.02 and calibrated > plain + 0.03
    # A training task itself is within the training tasks' landmark range: untouched.
    model.calibration_ = "landmarks"
    assert model.task_report([original])[0].calibrated is None


def test_a_task_out_of_range_is_calibrated_then_answered_by_the_primary_model():
    tasks, y, _ = batched()
    train = Bags.from_arrays([np.asarray(tasks[t]) for t in range(4)])
    y_train = y[: train.n_points]
    new = np.asarray(tasks[6])
    kw = {**SMALL, "tau": [0.0], "normalise": "none", "refine": "none", "point_bandwidth": 1.0}
    plain = MarginalTransferClassifier(calibrate="none", **kw).fit(train, y_train)
    model = MarginalTransferClassifier(calibrate="quantile", **kw).fit(train, y_train)
    (report,) = model.task_report([new])
    assert report.out_of_range and report.calibrated == "quantile" and not report.fallback
    # Oracle: the uncalibrated model on the task mapped onto the training quantiles.
    aligned = align_quantiles(Bags.from_arrays([new]), bag_quantiles(train).mean(axis=0))
    np.testing.assert_array_equal(model.predict([new]), plain.predict(aligned))
    (arrived,) = plain.task_report([new])
    assert report.distance == arrived.distance  # the flag is the task's own


# ----------------------------------------------------------------- configuration
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
        params += "\nn_components = 16\ntau = [0.0, 1.0]\nalpha = [1e-3]"
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
    assert model.unassigned == "unassigned" and model.rest_code_ == 2
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
