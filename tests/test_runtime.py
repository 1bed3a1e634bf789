"""The model runtime: one object per artifact that knows its kind and answers typed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bagserve.core import (
    ConditionalMeanEmbedding,
    DistributionRidge,
    DistributionRidgeClassifier,
    MarginalTransferClassifier,
    MarginalTransferRegressor,
    SlicedWasserstein,
    save,
)
from bagserve.core.artifact_info import ArtifactInfo
from bagserve.core.datasets import make_ellipse_tasks
from bagserve.core.io import Panel, Preprocessing, Sample
from bagserve.core.results import (
    CellPrediction,
    ClassificationPrediction,
    ConditionalPrediction,
    ModelKind,
    RegressionPrediction,
    prediction_from_arrays,
)
from bagserve.core.runtime import ModelRuntime

from .conftest import random_bags

MARKERS = ["CD3", "CD4"]


def _save(model, path: Path, preprocessing: Preprocessing | None = None) -> Path:
    meta = {"panel": Panel(MARKERS).to_json()}
    if preprocessing is not None:
        meta["preprocessing"] = preprocessing.to_json()
    return save(model, path, **meta)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("runtime")
    train = random_bags(rng, n_bags=16, dim=2)
    y = np.array([b.mean() for b in train])
    labels = np.array(["low", "high"])[(y > np.median(y)).astype(int)]
    sw = SlicedWasserstein(n_directions=10, n_levels=12, random_state=0)
    tasks, yt, _ = make_ellipse_tasks(5, 40, random_state=0)
    fixed = {"calibrate": "none", "cell_model": "kernel", "n_components": 32}
    models = {
        "regression": DistributionRidge(sw).fit(train, y),
        "classification": DistributionRidgeClassifier(sw).fit(train, labels),
        "conditional": ConditionalMeanEmbedding(representation=sw, alpha=1e-2).fit(train, y),
        "cell": MarginalTransferClassifier(random_state=0, **fixed).fit(tasks, yt),
        "cell-regression": MarginalTransferRegressor(random_state=0, **fixed).fit(
            tasks, tasks.points[:, 0]
        ),
    }
    return {name: (model, _save(model, root / name)) for name, model in models.items()}


def test_each_artifact_knows_its_kind_from_the_manifest_alone(artifacts):
    expected = {
        "regression": (ModelKind.REGRESSION, False),
        "classification": (ModelKind.CLASSIFICATION, True),
        "conditional": (ModelKind.CONDITIONAL, False),
        "cell": (ModelKind.CELL, True),
        "cell-regression": (ModelKind.CELL, False),
    }
    for name, (kind, classifies) in expected.items():
        info = ArtifactInfo.read(artifacts[name][1])
        assert (info.kind, info.classifies) == (kind, classifies), name
        assert info.markers == MARKERS and info.n_features == 2
        assert ModelRuntime.open(artifacts[name][1]).kind is kind


def test_typed_answers_equal_the_estimators_own(artifacts):
    rng = np.random.default_rng(4)
    new = random_bags(rng, n_bags=5, dim=2, sizes=(2, 40))
    model, path = artifacts["regression"]
    result = ModelRuntime.open(path).predict(new)
    assert isinstance(result, RegressionPrediction)
    np.testing.assert_array_equal(result.values, model.predict(new))
    np.testing.assert_array_equal(result.sizes, new.sizes)

    model, path = artifacts["classification"]
    result = ModelRuntime.open(path).predict(new)
    assert isinstance(result, ClassificationPrediction)
    np.testing.assert_array_equal(result.labels, model.predict(new))
    margin = model.decision_function(new)
    np.testing.assert_array_equal(result.scores, np.column_stack([-margin, margin]))
    # The class of the larger score is the predicted one.
    np.testing.assert_array_equal(result.classes[result.scores.argmax(1)], result.labels)

    model, path = artifacts["conditional"]
    result = ModelRuntime.open(path).predict(new, quantiles=[0.1, 0.9], exceed=[0.0])
    assert isinstance(result, ConditionalPrediction)
    _, q, e = model.summary(new, np.array([0.1, 0.9]), np.array([0.0]))
    np.testing.assert_array_equal(result.mean, model.predict(new))
    np.testing.assert_array_equal(result.quantiles, q)
    np.testing.assert_array_equal(result.exceedance, e)

    model, path = artifacts["cell"]
    tasks = make_ellipse_tasks(3, 50, random_state=9)[0]
    result = ModelRuntime.open(path).predict(tasks)
    assert isinstance(result, CellPrediction)
    expected = model.predict_tasks(tasks)
    for i, task in enumerate(expected):
        np.testing.assert_array_equal(result.labels_of(i), task.predictions)
        assert result.domain.out_of_range[i] == task.report.out_of_range
        assert result.domain.distance[i] == task.report.distance
        assert result.domain.nearest_of(i) == task.report.nearest_tasks.tolist()
        assert result.domain.similarities_of(i) == task.report.similarities.tolist()


def test_preprocessing_and_panel_are_applied_as_stored(artifacts, tmp_path):
    rng = np.random.default_rng(5)
    train = random_bags(rng, n_bags=12, dim=2)
    raw = [np.abs(b) * 50 for b in train]
    pre = Preprocessing(transform="arcsinh", cofactor=5.0, scale="standard")
    from bagserve.core import Bags

    bags = Bags.from_arrays(raw)
    pre = pre.fit(bags, MARKERS)
    y = np.arange(len(raw), dtype=float)
    model = DistributionRidge(SlicedWasserstein(n_directions=8, random_state=0)).fit(
        pre.apply(bags, MARKERS), y
    )
    path = _save(model, tmp_path / "m", pre)
    runtime = ModelRuntime.open(path)
    # Columns are matched by name, in any order, extra columns ignored.
    samples = [
        Sample(
            np.column_stack([r[:, 1], r[:, 0], r[:, 0]]),
            ["cd4", "CD3", "x"],
            ["b", "a", "c"],
            f"s{i}",
        )
        for i, r in enumerate(raw[:3])
    ]
    got = runtime.predict(runtime.align(samples)).values
    want = model.predict(pre.apply(Bags.from_arrays(raw[:3]), MARKERS))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["regression", "classification", "conditional", "cell"])
def test_results_cross_a_process_boundary_as_named_arrays(artifacts, name):
    rng = np.random.default_rng(6)
    runtime = ModelRuntime.open(artifacts[name][1])
    bags = (
        make_ellipse_tasks(2, 30, random_state=2)[0]
        if name == "cell"
        else random_bags(rng, n_bags=3, dim=2)
    )
    options = {"quantiles": [0.5], "exceed": [0.1]} if name == "conditional" else {}
    result = runtime.predict(bags, **options)
    arrays = result.to_arrays()
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    back = prediction_from_arrays(str(result.kind), arrays)
    assert type(back) is type(result)
    for key, value in back.to_arrays().items():
        np.testing.assert_array_equal(value, arrays[key])


def test_quantiles_are_refused_by_a_model_without_a_distribution(artifacts):
    runtime = ModelRuntime.open(artifacts["regression"][1])
    with pytest.raises(ValueError, match="need a conditional model"):
        runtime.predict(random_bags(np.random.default_rng(0), n_bags=2, dim=2), quantiles=[0.5])
