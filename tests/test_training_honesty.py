"""Honest training and evaluation: grid edges are found, widened and recorded; evaluation
never reports training bags as unseen.

The oracles are independent of the code under test: cross-validation errors are
recomputed here with scikit-learn's ``KFold`` and direct fits of the estimator on the
bags read with numpy; evaluation metrics are recomputed from the loaded model's
predictions; which bags overlap is known from how the test built the files.
"""

from __future__ import annotations

import json
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from bagserve.core import (
    ConditionalMeanEmbedding,
    DistributionRidge,
    MarginalTransferRegressor,
    SlicedWasserstein,
    load,
    read_manifest,
    save,
)
from bagserve.core.selection import grid_edge, widen_grid
from bagserve.core.training import (
    EvaluationOverlapError,
    GridEdgeWarning,
    estimator_grid_choices,
    evaluate,
    train,
)
from sklearn.metrics import mean_absolute_error, r2_score
from sklearn.model_selection import KFold

from bagserve.cli import main

from .conftest import SHARED_DATA
from .test_cli import example

YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"

# ----------------------------------------------------------------- synthetic data
# Three clusters of bags 50 apart along the first marker: most pairs of bags are in
# different clusters, so the median heuristic sees distances of ~35 and centres the
# automatic gamma grid near 1/35². Inside a cluster the target, sin(4 mu), changes over
# a shift of the bags of ~0.4, a distance of ~0.3: the gamma that resolves it (~30)
# lies 1.5 decades beyond the grid's largest value (1000 times the heuristic).
N_CLUSTERS, PER_CLUSTER, SEPARATION, N_CELLS = 3, 16, 50.0, 200
N_FOLDS, CV_SEED = 4, 0
REP = {"class": "SlicedWasserstein", "n_directions": 10, "n_levels": 20, "random_state": 0}


def _write_bags(root: Path, seed: int = 1, prefix: str = "b") -> tuple[list[str], np.ndarray]:
    """CSV bags (exact float text) and a labels table; returns file names and targets."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    names, y = [], []
    for k in range(N_CLUSTERS):
        for _ in range(PER_CLUSTER):
            mu = rng.uniform(0.0, 3.0)
            x = rng.normal(size=(N_CELLS, 2))
            x[:, 0] += SEPARATION * k + mu
            name = f"{prefix}{len(names):02d}.csv"
            body = "\n".join(f"{float(a)!r},{float(b)!r}" for a, b in x)
            (root / name).write_text(f"A,B\n{body}\n")
            names.append(name)
            y.append(np.sin(4.0 * mu))
    _write_labels(root, names, np.array(y))
    return names, np.array(y)


def _write_labels(root: Path, names: list[str], y: np.ndarray) -> None:
    rows = ["file,label"] + [f"{n},{float(v)!r}" for n, v in zip(names, y, strict=True)]
    (root / "labels.csv").write_text("\n".join(rows) + "\n")


def _read_bags(root: Path, names: list[str]) -> list[np.ndarray]:
    """The bags as numpy reads them: the library's readers are not the oracle."""
    return [np.loadtxt(root / n, delimiter=",", skiprows=1) for n in names]


def _config(
    root: Path,
    *,
    files: str = "data/*.csv",
    estimator: str = "alpha = 1e-3\n",
    search: str = "",
    name: str = "edge",
) -> Path:
    text = textwrap.dedent(
        """
        [model]
        name = "{name}"
        version = "1"
        output = "models"
        [data]
        files = "{files}"
        labels = "data/labels.csv"
        [panel]
        markers = ["A", "B"]
        [preprocessing]
        transform = "none"
        scale = "none"
        [estimator]
        class = "DistributionRidge"
        random_state = 0
        {estimator}
        [estimator.representation]
        {rep}
        [cv]
        n_splits = {folds}
        seed = {seed}
        {search}
        """
    ).format(
        name=name,
        files=files,
        estimator=estimator,
        rep="\n".join(f"{k} = {json.dumps(v)}" for k, v in REP.items()),
        folds=N_FOLDS,
        seed=CV_SEED,
        search=search,
    )
    path = root / f"{name}.toml"
    path.write_text(text)
    return path


def _rep() -> SlicedWasserstein:
    return SlicedWasserstein(n_directions=10, n_levels=20, random_state=0)


def _cv_rmse(bags: list[np.ndarray], y: np.ndarray, **params) -> float:
    """Out-of-fold RMSE of DistributionRidge(**params) on the folds the config names
    (KFold, shuffled, seeded by [cv] seed), by direct fits."""
    pred = np.empty_like(y)
    for train_idx, val in KFold(N_FOLDS, shuffle=True, random_state=CV_SEED).split(y):
        model = DistributionRidge(_rep(), random_state=0, **params)
        model.fit([bags[i] for i in train_idx], y[train_idx])
        pred[val] = model.predict([bags[i] for i in val])
    return float(np.sqrt(np.mean((pred - y) ** 2)))


def _train(cfg: Path, **kwargs) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(cfg, **kwargs)
    return result, [w for w in caught if issubclass(w.category, GridEdgeWarning)]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("edges")
    names, y = _write_bags(root / "data")
    return root, names, y, _read_bags(root / "data", names)


@pytest.fixture(scope="module")
def widened(synthetic):
    """The synthetic configuration trained with the default (widening) settings."""
    root, *_ = synthetic
    return _train(_config(root))


# ----------------------------------------------------------------- grid helpers
def test_grid_edge_needs_an_ordered_numeric_grid_of_three_values():
    grid = [1e-3, 1e-2, 1e-1, 1.0]
    assert grid_edge(grid, 1e-3) == "low" and grid_edge(grid, 1.0) == "high"
    assert grid_edge(grid[::-1], 1.0) == "high"  # the order given does not matter
    assert grid_edge(grid, 1e-2) is None
    assert grid_edge([1.0, 2.0], 2.0) is None  # two values: every choice is an edge
    assert grid_edge(["a", "b", "c"], "a") is None
    assert grid_edge([True, False, True], True) is None
    assert grid_edge(np.logspace(-3, 3, 13), 1e3 * (1 + 1e-12)) == "high"


def test_widen_grid_moves_the_old_edge_to_the_middle_with_the_same_steps():
    grid = np.logspace(-3, 3, 13)
    low, high = widen_grid(grid, "low"), widen_grid(grid, "high")
    assert len(low) == len(high) == 13
    np.testing.assert_allclose(np.log10(low), np.arange(-6, 0.5, 0.5), atol=1e-12)
    np.testing.assert_allclose(np.log10(high), np.arange(0, 6.5, 0.5), atol=1e-12)
    assert low[6] == grid[0] and high[6] == grid[-1]  # the old edge kept exactly
    # Even sizes, linear grids (zero or negative values), integers, bounds.
    assert widen_grid([1.0, 2.0, 4.0, 8.0], "high") == [4.0, 8.0, 16.0, 32.0]
    assert widen_grid([-1.0, 0.0, 1.0], "low") == [-2.0, -1.0, 0.0]
    assert widen_grid([50, 100, 200], "high") == [100, 200, 400]
    assert widen_grid([1, 2, 4], "low") is None  # no count below 1
    assert widen_grid([0.2, 0.5, 0.8], "high", lower=0.0, upper=1.0) == [0.5, 0.8, 1.0]
    assert widen_grid([0.0, 0.2, 1.0], "high", lower=0.0, upper=1.0) is None


# ----------------------------------------------------------------- grid edges
def test_gamma_far_beyond_the_default_grid_is_widened_and_recorded(synthetic, widened):
    _root, _names, y, bags = synthetic
    result, caught = widened
    # The plain estimator (what training did before) chooses the grid's largest gamma.
    edge_model = DistributionRidge(_rep(), alpha=1e-3, random_state=0).fit(bags, y)
    grid = list(edge_model.selection_["gamma"])
    assert edge_model.gamma_ == grid[-1]

    [edge] = result.metrics["grid_edges"]
    assert edge["parameter"] == "gamma" and edge["source"] == "estimator"
    assert edge["side"] == "high" and edge["chosen"] == pytest.approx(grid[-1], rel=1e-12)
    np.testing.assert_allclose(edge["grid"], grid, rtol=1e-12)
    assert edge["widened"] and not edge["still_on_edge"]
    np.testing.assert_allclose(edge["widened_grid"], widen_grid(grid, "high"), rtol=1e-12)
    inside = edge["chosen_after_widening"]
    assert grid[-1] < inside < edge["widened_grid"][-1]
    # The warning names the parameter, the grid and the value.
    [warning] = caught
    text = str(warning.message)
    assert "gamma" in text and f"{grid[-1]:.4g}" in text and "widened" in text
    # The saved model is the widened one; the manifest and the report record the edge.
    model = load(result.path)
    assert model.gamma_ == pytest.approx(inside, rel=1e-12)
    meta = read_manifest(result.path)["metadata"]
    assert meta["grid_edges"] == json.loads(json.dumps(result.metrics["grid_edges"]))
    report = json.loads((result.path / "report" / "metrics.json").read_text())
    assert report["grid_edges"][0]["widened"] is True

    # Cross-validation recomputed here: the widened grid beats the edge grid, and the
    # training recorded both numbers.
    at_edge = _cv_rmse(bags, y, alpha=1e-3)
    after = _cv_rmse(bags, y, alpha=1e-3, gamma=edge["widened_grid"])
    assert after < 0.75 * at_edge
    assert result.metrics["widening"]["cv_at_edge"]["rmse"] == pytest.approx(at_edge, rel=1e-9)
    assert result.metrics["cv"]["rmse"] == pytest.approx(after, rel=1e-9)


def test_widening_off_warns_and_records_without_refitting(synthetic, tmp_path):
    root, _names, y, bags = synthetic
    cfg = _config(root, search="[search]\nwiden_edges = false", name="off")
    result, caught = _train(cfg, output=tmp_path)
    [edge] = result.metrics["grid_edges"]
    assert edge["parameter"] == "gamma" and edge["side"] == "high"
    assert not edge["widened"] and edge["still_on_edge"] and edge["widened_grid"] is None
    assert "widen_edges = false" in edge["note"]
    assert len(caught) == 1 and "widen_edges = false" in str(caught[0].message)
    assert read_manifest(result.path)["metadata"]["grid_edges"][0]["widened"] is False
    # No refit: one candidate, and the saved model is the plain estimator's.
    assert len(result.metrics["search"]) == 1 and result.metrics["widening"]["refits"] == 0
    direct = DistributionRidge(_rep(), alpha=1e-3, random_state=0).fit(bags, y)
    model = load(result.path)
    assert model.gamma_ == direct.gamma_
    np.testing.assert_array_equal(model.predict(bags[:5]), direct.predict(bags[:5]))
    assert result.metrics["cv"]["rmse"] == pytest.approx(_cv_rmse(bags, y, alpha=1e-3))


def test_a_model_without_edges_is_the_plain_fit(synthetic, tmp_path):
    root, _names, y, bags = synthetic
    # A gamma grid around the value the widened search found: nothing on an edge.
    grid = [1.0, 3.0, 10.0, 30.0, 100.0]
    cfg = _config(root, estimator=f"alpha = 1e-3\ngamma = {grid}", name="inside")
    result, caught = _train(cfg, output=tmp_path)
    assert result.metrics["grid_edges"] == [] and caught == []
    assert len(result.metrics["search"]) == 1 and result.metrics["widening"]["refits"] == 0
    direct = DistributionRidge(_rep(), alpha=1e-3, gamma=grid, random_state=0).fit(bags, y)
    assert grid_edge(grid, direct.gamma_) is None
    np.testing.assert_array_equal(load(result.path).predict(bags), direct.predict(bags))


def test_an_edge_of_the_search_grid_is_widened_within_the_same_cv(synthetic, tmp_path):
    root, _names, y, bags = synthetic
    search = '[search]\n"gamma" = [0.1, 0.3, 1.0]'
    result, caught = _train(_config(root, search=search, name="search"), output=tmp_path)
    [edge] = result.metrics["grid_edges"]  # a fixed gamma per candidate: no own grid
    assert edge["source"] == "search" and edge["parameter"] == "gamma"
    assert edge["chosen"] == 1.0 and edge["side"] == "high" and edge["widened"]
    np.testing.assert_allclose(edge["widened_grid"], [0.3, 1.0, 10 / 3], rtol=1e-12)
    # Only the new value needed a cross-validation, on the same folds; it wins, and is
    # on the edge of the widened grid: kept, with a warning.
    gammas = [s["params"]["gamma"] for s in result.metrics["search"]]
    np.testing.assert_allclose(gammas, [0.1, 0.3, 1.0, 10 / 3], rtol=1e-12)
    assert edge["chosen_after_widening"] == pytest.approx(10 / 3) and edge["still_on_edge"]
    assert result.metrics["best_params"]["gamma"] == pytest.approx(10 / 3)
    assert len(caught) == 1 and "still on its edge" in str(caught[0].message)
    for entry in result.metrics["search"][2:]:
        direct = _cv_rmse(bags, y, alpha=1e-3, gamma=entry["params"]["gamma"])
        assert entry["rmse"] == pytest.approx(direct, rel=1e-9)
    assert load(result.path).gamma_ == pytest.approx(10 / 3)


def test_streaming_training_widens_and_records_the_same(synthetic, widened, tmp_path):
    root, _names, _y, bags = synthetic
    memory, _ = widened
    streamed, caught = _train(_config(root), output=tmp_path, streaming=True)
    assert streamed.metrics["compute"]["mode"] == "streaming" and len(caught) == 1
    assert streamed.metrics["grid_edges"] == memory.metrics["grid_edges"]
    assert streamed.metrics["cv"] == memory.metrics["cv"]
    a, b = read_manifest(memory.path)["metadata"], read_manifest(streamed.path)["metadata"]
    assert a["training_bags"] == b["training_bags"]
    np.testing.assert_array_equal(
        load(memory.path).predict(bags), load(streamed.path).predict(bags)
    )


def test_streaming_widens_a_search_grid_that_needs_new_features(synthetic, tmp_path):
    """A widened number of directions is a new representation: streaming reads the
    files once more for it and gives what training in memory gives."""
    root, _, _, bags = synthetic
    search = '[search]\n"representation__n_directions" = [2, 4, 8]'
    cfg = _config(root, search=search, name="directions")
    memory, _ = _train(cfg, output=tmp_path / "memory")
    streamed, _ = _train(cfg, output=tmp_path / "streamed", streaming=True)
    edge = memory.metrics["grid_edges"][0]
    assert edge["source"] == "search" and edge["chosen"] == 8 and edge["widened"]
    assert edge["widened_grid"] == [4, 8, 16]
    directions = [s["params"]["representation__n_directions"] for s in memory.metrics["search"]]
    assert directions[:4] == [2, 4, 8, 16]  # then the refit widening the ridge's own gamma
    for key in ("grid_edges", "search", "cv", "best_params"):
        assert streamed.metrics[key] == memory.metrics[key], key
    np.testing.assert_array_equal(
        load(memory.path).predict(bags), load(streamed.path).predict(bags)
    )


def test_conditional_mean_embedding_choices_are_its_searched_grids():
    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, size=(60, 1))
    y = np.sin(2 * x[:, 0]) + 0.1 * rng.normal(size=60)
    gammas = [0.1, 1.0, 10.0]
    model = ConditionalMeanEmbedding(gamma=gammas, random_state=0).fit(x, y)
    choices = {c.parameter: c for c in estimator_grid_choices(model)}
    # alpha=None searches the documented default, logspace(-7, 1, 17).
    np.testing.assert_allclose(choices["alpha"].grid, np.logspace(-7, 1, 17), rtol=1e-12)
    np.testing.assert_allclose(choices["gamma"].grid, gammas, rtol=1e-12)
    assert choices["alpha"].chosen == model.alpha_ and choices["gamma"].chosen == model.gamma_
    # Nothing searched (both fixed): no choices.
    fixed = ConditionalMeanEmbedding(gamma=1.0, alpha=1e-3).fit(x, y)
    assert estimator_grid_choices(fixed) == []


def _transfer_tasks(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    tasks, labels = [], []
    for t in range(6):
        x = rng.normal(size=(40, 2)) + 0.3 * t
        tasks.append(x)
        labels.append(np.sin(x[:, 0]) + 0.1 * t)
    return tasks, labels


def test_marginal_transfer_searches_no_numeric_grid_and_says_what_it_chose(tmp_path):
    """The rebuilt marginal transfer (issue 44) chooses among named calibrations and
    cell models, not along numeric grids: it reports no grid choice, so training has
    no edge to widen, and its card says which calibration and cell model the folds
    chose, as the fitted model records them."""
    tasks, labels = _transfer_tasks()
    model = MarginalTransferRegressor(n_components=16, cv=3, random_state=0)
    model.fit(tasks, np.concatenate(labels))
    assert estimator_grid_choices(model) == []
    (tmp_path / "data").mkdir()
    for t, (x, lab) in enumerate(zip(tasks, labels, strict=True)):
        rows = "\n".join(",".join(repr(float(v)) for v in row) for row in np.column_stack([x, lab]))
        (tmp_path / "data" / f"t{t}.csv").write_text(f"A,B,y\n{rows}\n")
    cfg = tmp_path / "transfer.toml"
    cfg.write_text(
        textwrap.dedent(
            """
            [model]
            name = "transfer"
            output = "models"
            [data]
            files = "data/*.csv"
            cell_label_column = "y"
            [panel]
            markers = ["A", "B"]
            [estimator]
            class = "MarginalTransferRegressor"
            n_components = 16
            cv = 3
            random_state = 0
            [cv]
            n_splits = 3
            seed = 0
            """
        )
    )
    result, _ = _train(cfg)
    assert result.metrics["grid_edges"] == []
    # Where the model looks: its cells' cross-validated values, by marker region.
    regions = result.metrics["explained_regions"]
    assert regions["method"] == "assignment" and regions["outputs"] == ["prediction"]
    assert regions["markers"] == ["A", "B"] and regions["n_samples"] == len(tasks)
    trained = load(result.path)
    card = (result.path / "card.md").read_text()
    line = next(x for x in card.splitlines() if x.startswith("- Every sample: calibrated"))
    model_text = {"linear": "a pooled linear model", "kernel": "the marginal-transfer kernel"}
    assert model_text[trained.selection_["cell_model"]] in line


def _metrics(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    return {
        "rmse": float(np.sqrt(np.mean((pred - y) ** 2))),
        "mae": float(mean_absolute_error(y, pred)),
        "r2": float(r2_score(y, pred)),
    }


def _assert_metrics(result: dict, expected: dict[str, float]) -> None:
    for k, v in expected.items():
        assert result[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


@pytest.fixture(scope="module")
def evaluation_data(synthetic, widened):
    """New bags (same process, other seed) beside the training bags, and configs over
    unseen bags only, a mix, and a renamed copy of training cells in another layout."""
    root, names, y, bags = synthetic
    new_names, new_y = _write_bags(root / "new", seed=2, prefix="n")
    new_bags = _read_bags(root / "new", new_names)
    disjoint = _config(root, files="new/*.csv", name="disjoint")
    disjoint.write_text(disjoint.read_text().replace("data/labels.csv", "new/labels.csv"))
    # A mix: 4 training bags (one of them re-written with its columns swapped and
    # another name, so its file differs but its cells do not) and 6 new bags.
    mixed = root / "mixed"
    mixed.mkdir()
    chosen = names[:3]
    for n in chosen:
        (mixed / n).write_bytes((root / "data" / n).read_bytes())
    swapped = bags[3][:, ::-1]
    body = "\n".join(f"{float(a)!r},{float(b)!r}" for a, b in swapped)
    (mixed / "copy_of_b03.csv").write_text(f"B,A\n{body}\n")
    for n in new_names[:6]:
        (mixed / n).write_bytes((root / "new" / n).read_bytes())
    mixed_names = [*chosen, "copy_of_b03.csv", *new_names[:6]]
    _write_labels(mixed, mixed_names, np.concatenate([y[:4], new_y[:6]]))
    mixed_cfg = _config(root, files="mixed/*.csv", name="mixed")
    mixed_cfg.write_text(mixed_cfg.read_text().replace("data/labels.csv", "mixed/labels.csv"))
    return {
        "disjoint": (disjoint, new_bags, new_y),
        "mixed": (mixed_cfg, [*bags[:4], *new_bags[:6]], np.concatenate([y[:4], new_y[:6]])),
    }


def test_evaluate_on_disjoint_bags_reports_every_bag(widened, evaluation_data, capsys):
    result, _ = widened
    cfg, bags, y = evaluation_data["disjoint"]
    out = evaluate(result.path, cfg)
    assert out["n_bags"] == len(bags) and out["n_overlapping"] == 0 and out["overlapping"] == []
    assert out["evaluated_on"] == "unseen bags only" and out["overlap"] == "known"
    # The metrics evaluate always gave: those of the model's predictions on every bag.
    _assert_metrics(out, _metrics(y, load(result.path).predict(bags)))
    assert main(["evaluate", str(result.path), str(cfg), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rmse"] == pytest.approx(out["rmse"])
    assert "none of the" in captured.err


def test_evaluate_reads_a_file_of_the_data_alone(widened, evaluation_data, capsys):
    # `evaluate --help` says a [data] table is enough: a file without [estimator] (nor
    # any other training table) is evaluated like the training configuration it came from.
    result, _ = widened
    cfg, _, _ = evaluation_data["disjoint"]
    data_only = cfg.with_name("data_only.toml")
    text = cfg.read_text()
    start = text.index("[data]")
    end = text.find("\n[", start + 1)
    data_only.write_text(text[start : None if end < 0 else end] + "\n")
    assert "[estimator]" not in data_only.read_text()
    assert main(["evaluate", str(result.path), str(data_only), "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["rmse"] == pytest.approx(
        evaluate(result.path, cfg)["rmse"], rel=1e-12
    )


def test_evaluate_leaves_training_bags_out_by_fingerprint(synthetic, widened, evaluation_data):
    _root, names, *_ = synthetic
    result, _ = widened
    cfg, bags, y = evaluation_data["mixed"]
    out = evaluate(result.path, cfg)
    # Matched by file digest (3 copies) and by cells (the re-written copy).
    assert out["n_bags"] == 10 and out["n_overlapping"] == 4 and out["n_unseen"] == 6
    names_seen = sorted(Path(n).name for n in out["overlapping"])
    assert names_seen == sorted([*names[:3], "copy_of_b03.csv"])
    model = load(result.path)
    # The config's files in sorted order: b00-b02, the copy of b03, then n00-n05.
    _assert_metrics(out, _metrics(y[4:], model.predict(bags[4:])))
    both = evaluate(result.path, cfg, include_training=True)
    assert both["evaluated_on"] == "all bags, training bags included"
    _assert_metrics(both, _metrics(y, model.predict(bags)))
    assert both["unseen_only"]["n_bags"] == 6
    _assert_metrics(both["unseen_only"], _metrics(y[4:], model.predict(bags[4:])))


def test_evaluate_on_the_training_config_refuses_unless_asked(synthetic, widened, capsys):
    root, names, y, bags = synthetic
    result, _ = widened
    cfg = _config(root)
    with pytest.raises(EvaluationOverlapError, match="--include-training"):
        evaluate(result.path, cfg)
    assert main(["evaluate", str(result.path), str(cfg), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: all 48 evaluated bag(s) were used to train")
    assert main(["evaluate", str(result.path), str(cfg), "--include-training", "--quiet"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["n_overlapping"] == 48 and out["unseen_only"] is None
    assert sorted(Path(n).name for n in out["overlapping"]) == sorted(names)
    _assert_metrics(out, _metrics(y, load(result.path).predict(bags)))
    assert "training bags included" in captured.err


def test_evaluate_says_unknown_for_models_without_bag_fingerprints(
    widened, evaluation_data, tmp_path
):
    result, _ = widened
    cfg, bags, y = evaluation_data["mixed"]
    # A model saved as training saved it before bag fingerprints existed.
    meta = read_manifest(result.path)["metadata"]
    del meta["training_bags"], meta["grid_edges"]
    legacy = save(load(result.path), tmp_path / "legacy", **meta)
    out = evaluate(legacy, cfg)
    assert out["overlap"] == "unknown" and out["n_overlapping"] is None
    assert out["overlapping"] is None and out["evaluated_on"] == "all bags, overlap unknown"
    _assert_metrics(out, _metrics(y, load(legacy).predict(bags)))


# ----------------------------------------------------------------- the yeast example
def test_yeast_example_edges_and_evaluation(tmp_path, capsys):
    cfg = example("yeast_dose", tmp_path)
    result, caught = _train(cfg)
    edges = {e["parameter"]: e for e in result.metrics["grid_edges"]}
    # The report of the issue: both of the estimator's own grids chosen at their
    # smallest value; both are widened once, and the manifest records it.
    assert edges["gamma"]["side"] == edges["alpha"]["side"] == "low"
    assert edges["alpha"]["chosen"] == pytest.approx(1e-8)
    assert all(e["widened"] for e in edges.values()) and len(caught) == len(edges)
    model = load(result.path)
    assert model.gamma_ == pytest.approx(edges["gamma"]["chosen_after_widening"])
    assert model.alpha_ == pytest.approx(edges["alpha"]["chosen_after_widening"])
    assert read_manifest(result.path)["metadata"]["grid_edges"] == json.loads(
        json.dumps(result.metrics["grid_edges"])
    )
    meta = read_manifest(result.path)["metadata"]
    assert len(meta["training_bags"]) == 21
    assert {Path(b["name"]).name for b in meta["training_bags"]} == set(meta["training_files"])
    # evaluate on the training configuration: every bag overlaps.
    assert main(["evaluate", str(result.path), str(cfg), "--quiet"]) == 1
    assert "--include-training" in capsys.readouterr().err
    code = main(["evaluate", str(result.path), str(cfg), "--quiet", "--include-training"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["n_overlapping"] == out["n_bags"] == 21
    assert out["r2"] > 0.99 and out["unseen_only"] is None


def test_the_report_shows_where_the_model_looks(synthetic, tmp_path):
    root, *_ = synthetic
    cfg = _config(root, estimator="alpha = 1e-3\ngamma = 10.0", name="regions")
    result, _ = _train(cfg, output=tmp_path)
    regions = result.metrics["explained_regions"]
    assert regions["markers"] == ["A", "B"] and regions["n_samples"] > 0
    assert np.array(regions["mean_contribution"]).shape == (2, 5, 1)
    page = (result.path / "report" / "report.html").read_text()
    assert "Where the model looks" in page
