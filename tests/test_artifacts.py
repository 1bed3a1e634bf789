"""Model artifacts: bit-for-bit round trips, integrity checks, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from bagserve.core import (
    ArtifactError,
    DensityFeatures,
    DistributionRidge,
    DistributionRidgeClassifier,
    HistogramEmbedding,
    MarginalTransferClassifier,
    MarginalTransferRegressor,
    MeanEmbedding,
    SlicedWasserstein,
    load,
    read_manifest,
    save,
)
from bagserve.core.artifacts import FORMAT_VERSION
from bagserve.core.datasets import make_ellipse_tasks

from .conftest import random_bags

DG_FIXED = {"n_components": 16, "cv": 2, "perturbations": 2, "random_state": 0}


def _fitted_models(rng: np.random.Generator) -> dict[str, tuple[object, object]]:
    train = random_bags(rng, n_bags=14, weighted=True)
    test = random_bags(rng, n_bags=4, sizes=(1, 60))
    y = np.array([b.mean() for b in train])
    labels = np.array(["a", "b"])[(y > np.median(y)).astype(int)]
    tasks, yt, _ = make_ellipse_tasks(5, 30, random_state=0)
    new_tasks = make_ellipse_tasks(2, 40, random_state=1)[0]
    target = tasks.points[:, 0] - tasks.points[:, 1] ** 2
    sw = SlicedWasserstein(n_directions=10, n_levels=12, random_state=0)
    sw1 = SlicedWasserstein(p=1, n_directions=8, random_state=0)
    rff8 = MeanEmbedding(method="rff", n_components=8, random_state=0)
    nys = MeanEmbedding(method="nystroem", n_components=20, random_state=0)
    dens = DensityFeatures(divergence="js", n_basis=4, n_integration=300, random_state=0)
    return {
        "ridge-sw2": (DistributionRidge(sw).fit(train, y), test),
        "ridge-sw1-multi": (
            DistributionRidge(sw1, kernel="matern32").fit(train, np.stack([y, -y], 1)),
            test,
        ),
        "ridge-mmd-exact": (DistributionRidge(MeanEmbedding(), kernel="imq").fit(train, y), test),
        "ridge-rff-primal": (DistributionRidge(rff8, kernel="linear").fit(train, y), test),
        "ridge-nystroem": (
            DistributionRidge(nys, kernel="student", kernel_params={"theta": 1.5}).fit(train, y),
            test,
        ),
        "classifier": (DistributionRidgeClassifier(sw).fit(train, labels), test),
        "ridge-density-js": (DistributionRidge(dens).fit(train, y), test),
        "ridge-density-rff": (
            DistributionRidge(dens, n_components=64, random_state=0).fit(train, y),
            test,
        ),
        "ridge-sw1-rff": (
            DistributionRidge(sw1, n_components=32, random_state=0).fit(train, y),
            test,
        ),
        "histogram-tv": (HistogramEmbedding("tv", bins=3).fit(train), test),
        "sw": (SlicedWasserstein(n_directions=5, n_levels=7, random_state=0).fit(train), test),
        "mean-rff": (
            MeanEmbedding(method="rff", n_components=16, random_state=0).fit(train),
            test,
        ),
        "dg-auto": (MarginalTransferClassifier(**DG_FIXED).fit(tasks, yt), new_tasks),
        "dg-kernel": (
            MarginalTransferClassifier(cell_model="kernel", **DG_FIXED).fit(tasks, yt),
            new_tasks,
        ),
        "dg-trees": (
            MarginalTransferClassifier(cell_model="trees", **DG_FIXED).fit(tasks, yt),
            new_tasks,
        ),
        "dg-regressor": (
            MarginalTransferRegressor(cell_model="kernel", **DG_FIXED).fit(tasks, target),
            new_tasks,
        ),
    }


def _outputs(model: object, X: object) -> list[np.ndarray]:
    if isinstance(model, SlicedWasserstein | MeanEmbedding | HistogramEmbedding):
        return [model.transform(X)]
    out = [np.asarray(model.predict(X))]
    if hasattr(model, "decision_function"):
        out.append(np.asarray(model.decision_function(X)))
    # The conformal outputs read the leave-one-out state the ridge models store.
    if isinstance(model, DistributionRidge):
        out += [model.predict_interval(X, coverage=0.8), model.loo_predict(X)]
    if isinstance(model, DistributionRidgeClassifier):
        out += [model.predict_set(X, coverage=0.8), model.predict_proba(X)]
    return out


@pytest.fixture(scope="module")
def models():
    return _fitted_models(np.random.default_rng(7))


@pytest.mark.parametrize(
    "name",
    ["ridge-sw2", "ridge-sw1-multi", "ridge-mmd-exact", "ridge-rff-primal", "ridge-nystroem",
     "classifier", "sw", "mean-rff", "dg-auto", "dg-kernel", "dg-trees", "dg-regressor",
     "ridge-density-js", "ridge-density-rff", "ridge-sw1-rff", "histogram-tv"],
)  # fmt: skip
@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip_reproduces_predictions_bit_for_bit(tmp_path, models, name, mmap):
    model, X = models[name]
    path = save(
        model,
        tmp_path / name,
        name=name,
        version="1",
        panel=["m0", "m1", "m2"][: model.n_features_in_],
    )
    again = load(path, mmap=mmap)
    assert type(again) is type(model)
    assert again.get_params(deep=False).keys() == model.get_params(deep=False).keys()
    for a, b in zip(_outputs(model, X), _outputs(again, X), strict=True):
        np.testing.assert_array_equal(a, b)
    manifest = read_manifest(path)
    assert manifest["metadata"]["name"] == name
    assert manifest["format_version"] == FORMAT_VERSION
    assert set(manifest["libraries"]) >= {"numpy", "scipy", "scikit-learn", "bagserve", "python"}


#: The calibration state each calibration stores (these models search gamma and alpha,
#: so theirs is CV+: see core/estimators/_ridge_calibration.py).
CALIBRATION_STATE = {
    "jackknife+": ("loo_smoother_", "loo_residuals_", "loo_intercept_shift_"),
    "cv+": ("cv_fold_", "cv_gamma_", "cv_alpha_", "cv_coef_", "cv_intercept_", "cv_residuals_"),
}
CLASSIFIER_STATE = ("loo_nonconformity_", "proba_scale_")


@pytest.mark.parametrize(
    "name",
    ["ridge-sw2", "ridge-sw1-multi", "ridge-mmd-exact", "ridge-rff-primal", "ridge-nystroem",
     "classifier", "ridge-density-js", "ridge-density-rff", "ridge-sw1-rff"],
)  # fmt: skip
def test_leave_one_out_state_is_stored_and_read_back_bit_for_bit(tmp_path, models, name):
    model, _ = models[name]
    path = save(model, tmp_path / name)
    state = read_manifest(path)["model"]["state"]
    again = load(path)
    assert model.calibration_ == again.calibration_ == "cv+"
    attrs = CALIBRATION_STATE[model.calibration_]
    if isinstance(model, DistributionRidgeClassifier):
        attrs += CLASSIFIER_STATE
    for attr in attrs:
        assert attr in state
        a, b = getattr(model, attr), getattr(again, attr)
        if isinstance(a, float):
            assert type(b) is float and a == b
        else:
            assert a.dtype == b.dtype and a.dtype.kind in "fi" and a.shape == b.shape
            assert np.array_equal(a, b, equal_nan=True)


def test_manifest_records_parameters_and_hashes(tmp_path, models):
    model, _ = models["ridge-sw2"]
    path = save(model, tmp_path / "m", metrics={"r2": 0.9}, training_data_sha256="ab" * 32)
    manifest = read_manifest(path)
    params = manifest["model"]["params"]
    assert manifest["estimator"] == {"class": "DistributionRidge", "format": "arrays"}
    assert params["kernel"] == "gaussian"
    assert params["representation"]["__estimator__"] == "SlicedWasserstein"
    assert manifest["metadata"]["metrics"] == {"r2": 0.9}
    files = manifest["files"]
    assert files and all(rel.startswith("arrays/") for rel in files)
    assert all(len(h) == 64 for h in files.values())
    assert "created" in manifest


def _first_array(path: Path) -> Path:
    return sorted((path / "arrays").glob("*.npy"))[0]


def test_tampered_truncated_missing_and_edited_artifacts_are_refused(tmp_path, models):
    model, _ = models["ridge-sw2"]
    for case in ("flip", "truncate", "missing", "manifest", "newer", "garbage"):
        path = save(model, tmp_path / case)
        f = _first_array(path)
        if case == "flip":
            data = bytearray(f.read_bytes())
            data[-1] ^= 0x01
            f.write_bytes(bytes(data))
            match = "does not match its sha256"
        elif case == "truncate":
            f.write_bytes(f.read_bytes()[:-8])
            match = "does not match its sha256"
        elif case == "missing":
            f.unlink()
            match = "is missing"
        elif case == "manifest":
            m = json.loads((path / "manifest.json").read_text())
            m["model"]["params"]["alpha"] = 123.0
            (path / "manifest.json").write_text(json.dumps(m))
            match = "manifest was modified"
        elif case == "newer":
            m = json.loads((path / "manifest.json").read_text())
            m["format_version"] = FORMAT_VERSION + 1
            (path / "manifest.json").write_text(json.dumps(m))
            match = "newer than this bagserve reads"
        else:
            (path / "manifest.json").write_text("{not json")
            match = "unreadable manifest"
        with pytest.raises(ArtifactError, match=match):
            load(path)
    with pytest.raises(ArtifactError, match=r"no manifest\.json"):
        load(tmp_path)


def test_unknown_classes_never_load_without_pickle(tmp_path, models):
    model, _ = models["sw"]
    path = save(model, tmp_path / "m")
    m = json.loads((path / "manifest.json").read_text())
    m["model"]["__estimator__"] = "os.system"
    import hashlib

    from bagserve.core.artifacts import _canonical

    m["manifest_sha256"] = hashlib.sha256(_canonical(m)).hexdigest()
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"unknown estimator class 'os\.system'"):
        load(path)


def test_pickle_export_needs_trust_on_both_ends(tmp_path, models):
    model, X = models["ridge-sw2"]
    with pytest.raises(ArtifactError, match=r"trusted=True"):
        save(model, tmp_path / "p", pickle=True)
    path = save(model, tmp_path / "p", pickle=True, trusted=True)
    with pytest.raises(ArtifactError, match="pickle"):
        load(path)
    np.testing.assert_array_equal(load(path, trusted=True).predict(X), model.predict(X))
    with pytest.raises(ArtifactError, match="not one of the core's estimators"):
        save(object(), tmp_path / "o")


def test_writes_are_atomic_and_never_clobber(tmp_path, models, monkeypatch):
    model, X = models["ridge-sw2"]
    path = save(model, tmp_path / "m", version="1")
    with pytest.raises(ArtifactError, match="already exists"):
        save(model, path)
    calls = {"n": 0}
    real_save = np.save

    def failing_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(np, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save(model, path, overwrite=True, version="2")
    monkeypatch.undo()
    # The old artifact is intact and no temporary directory is left behind.
    assert read_manifest(path)["metadata"]["version"] == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    save(model, path, overwrite=True, version="2")
    assert read_manifest(path)["metadata"]["version"] == "2"
    np.testing.assert_array_equal(load(path).predict(X), model.predict(X))


def test_unfitted_models_and_bad_metadata_are_refused(tmp_path):
    with pytest.raises(ArtifactError, match="not fitted"):
        save(DistributionRidge(), tmp_path / "u")
    sw = SlicedWasserstein(random_state=0).fit([np.zeros((3, 2))])
    with pytest.raises(ArtifactError, match="not JSON-serialisable"):
        save(sw, tmp_path / "b", note=object())
    with pytest.raises(ArtifactError, match="not JSON-serialisable"):
        save(sw, tmp_path / "b", score=float("nan"))
