"""Applicability domain: calibrated scores, out-of-range flags, stored with the model."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import (
    ConditionalMeanEmbedding,
    DistributionRidge,
    DistributionRidgeClassifier,
    MarginalTransferClassifier,
    MeanEmbedding,
    SlicedWasserstein,
    load,
    save,
)
from bagserve.core.datasets import make_ellipse_tasks
from bagserve.core.domain import DomainCalibration, knn_mean_distances
from scipy.spatial.distance import cdist

from .conftest import SHARED_DATA


def _bags(rng: np.random.Generator, n: int, shift: float = 0.0, size: int = 60) -> list:
    """Bags of a two-component mixture whose weight varies from bag to bag."""
    out = []
    for _ in range(n):
        w = rng.uniform(0.2, 0.8)
        k = rng.binomial(size, w)
        a = rng.normal([0.0, 0.0], 1.0, size=(k, 2))
        b = rng.normal([3.0, 1.0], 0.7, size=(size - k, 2))
        out.append(np.vstack([a, b]) + shift)
    return out


def _targets(bags: list) -> np.ndarray:
    return np.array([b[:, 0].mean() for b in bags])


def test_scores_equal_a_naive_nearest_neighbour_computation():
    rng = np.random.default_rng(0)
    train, new = _bags(rng, 15), _bags(rng, 4)
    model = DistributionRidge(SlicedWasserstein(n_directions=20, random_state=0)).fit(
        train, _targets(train)
    )
    F = model.representation_.embed(train).features
    G = model.representation_.embed(new).features
    k = 3
    # Naive: every training bag against every other, explicit loops.
    loo = []
    for i in range(len(F)):
        d = sorted(np.linalg.norm(F[i] - F[j]) for j in range(len(F)) if j != i)
        loo.append(np.mean(d[:k]))
    scale = np.median(loo)
    np.testing.assert_allclose(model.domain_scores_, np.array(loo) / scale, rtol=1e-10)
    # Conformal threshold: the ceil(0.95 * 16) = 16th smallest, i.e. the largest score.
    assert model.domain_threshold_ == pytest.approx(max(loo) / scale, rel=1e-12)
    report = model.domain_check(new)
    D = cdist(G, F)
    expected = np.sort(D, axis=1)[:, :k].mean(axis=1) / scale
    np.testing.assert_allclose(report.score, expected, rtol=1e-10)
    np.testing.assert_array_equal(report.nearest, np.argsort(D, axis=1, kind="stable")[:, :3])
    np.testing.assert_allclose(report.distance, D.min(axis=1), rtol=1e-10)
    np.testing.assert_array_equal(report.out_of_range, expected > model.domain_threshold_)
    # The model's own kernel gives the similarities.
    np.testing.assert_allclose(
        report.similarities, np.exp(-model.gamma_ * np.sort(D, axis=1)[:, :3] ** 2), rtol=1e-10
    )


def test_in_domain_bags_are_rarely_flagged_and_shifted_ones_always():
    """Exchangeable new bags are flagged with probability at most 1 - 0.95 (conformal);
    over 20 refits x 10 held-out bags the rate stays under 0.05 + 3 standard errors."""
    flagged, total = 0, 0
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        train, held = _bags(rng, 40), _bags(rng, 10)
        model = DistributionRidge(SlicedWasserstein(n_directions=20, random_state=seed)).fit(
            train, _targets(train)
        )
        flagged += int(model.domain_check(held).out_of_range.sum())
        total += len(held)
        shifted = model.domain_check(_bags(rng, 5, shift=4.0))
        assert shifted.out_of_range.all() and (shifted.score > 3).all()
    rate = flagged / total
    assert rate <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / total), rate


@pytest.mark.parametrize(
    "make",
    [
        lambda: DistributionRidge(
            MeanEmbedding(method="rff", n_components=40, random_state=0),
            n_components=30,
            random_state=0,
        ),
        lambda: DistributionRidgeClassifier(SlicedWasserstein(n_directions=10, random_state=0)),
        lambda: ConditionalMeanEmbedding(SlicedWasserstein(n_directions=10, random_state=0)),
    ],
    ids=["primal", "classifier", "conditional"],
)
def test_every_bag_model_checks_its_domain_and_stores_it_exactly(make, tmp_path):
    rng = np.random.default_rng(3)
    train = _bags(rng, 20)
    y = _targets(train)
    model = make()
    labels = np.where(y > np.median(y), "high", "low")
    model.fit(train, labels if isinstance(model, DistributionRidgeClassifier) else y)
    new = _bags(rng, 3) + _bags(rng, 2, shift=5.0)
    report = model.domain_check(new)
    np.testing.assert_array_equal(report.out_of_range, [False, False, False, True, True])
    back = load(save(model, tmp_path / "m"))
    again = back.domain_check(new)
    for field in ("score", "out_of_range", "nearest", "similarities", "distance"):
        np.testing.assert_array_equal(getattr(again, field), getattr(report, field))
    assert back.domain_threshold_ == model.domain_threshold_


def test_marginal_transfer_reports_the_same_shape_from_its_task_reports():
    tasks, y, _ = make_ellipse_tasks(6, 40, random_state=0)
    fixed = {"calibrate": "none", "cell_model": "kernel"}
    model = MarginalTransferClassifier(random_state=0, **fixed).fit(tasks, y)
    new = make_ellipse_tasks(2, 40, random_state=5)[0]
    far = [t + 10.0 for t in new]
    report = model.domain_check(list(new) + far)
    tasks_report = model.task_report(list(new) + far)
    np.testing.assert_array_equal(report.out_of_range, [r.out_of_range for r in tasks_report])
    assert report.out_of_range[2:].all()
    mu = model.task_map_["train_embeddings"]
    sq = ((mu[:, None] - mu[None]) ** 2).sum(axis=2)
    nn = np.sqrt(sq + np.diag(np.full(len(sq), np.inf))).min(axis=1)
    np.testing.assert_allclose(
        report.score, [r.distance / np.median(nn) for r in tasks_report], rtol=1e-12
    )


def test_calibration_thresholds_follow_the_finite_sample_quantile():
    scores = np.arange(1.0, 101.0)  # median 50.5
    cal = DomainCalibration.fit(scores, k=1, quantile=0.9)
    # ceil(0.9 * 101) = 91st smallest.
    assert cal.threshold == pytest.approx(91 / 50.5)
    small = DomainCalibration.fit(np.array([1.0, 2.0, 3.0]), k=1, quantile=0.95)
    assert small.threshold == pytest.approx(3 / 2)  # rank capped at T
    mean, order = knn_mean_distances(np.array([[0.0, 4.0, 1.0]]), 2)
    assert mean[0] == pytest.approx(0.5) and order[0].tolist() == [0, 2, 1]


def test_a_foreign_sample_is_flagged_by_the_yeast_model(tmp_path):
    """The issue's example: a mouse immune sample sent to the yeast dose model."""
    from bagserve.core.io import read_sample
    from bagserve.core.runtime import ModelRuntime
    from bagserve.core.training import GridEdgeWarning, train

    with pytest.warns(GridEdgeWarning):  # gamma and alpha at their grids' edges, reported
        result = train("examples/yeast_dose/train.toml", output=tmp_path, progress=False)
    runtime = ModelRuntime.open(result.path)
    yeast = sorted((SHARED_DATA / "cytoflow_yeast" / "dose_response").glob("*.fcs"))[:4]
    foreign = SHARED_DATA / "flowsom_example" / "not_preprocessed.fcs"
    samples = [read_sample(f) for f in [*yeast, foreign]]  # ../shared/data, as CI has it
    domain = runtime.predict(runtime.align(samples)).domain
    assert domain.out_of_range.tolist() == [False, False, False, False, True]
    assert domain.score[-1] > 10 * domain.score[:-1].max()
