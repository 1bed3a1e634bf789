"""Several bags per subject: selection, calibration, folds and the domain check leave
whole subjects out.

The oracles are independent of the closed forms under test: scikit-learn's
``KernelRidge`` refitted on the bags outside each subject (on the model's own Gram
matrix), and the estimator refitted from scratch on each calibration fold (the whole
search repeated), compared with what the fitted model stores.
"""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from bagserve.core import DistributionRidge, SlicedWasserstein, load, read_manifest
from bagserve.core.bags import Bags
from bagserve.core.selection import GridEdgeWarning, GroupBlocks, group_folds
from bagserve.core.training import GroupingWarning, repeated_subjects, train
from sklearn.kernel_ridge import KernelRidge

from .conftest import SHARED_DATA
from .test_cli import example

YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"


def subject_bags(
    n_subjects: int, per_subject: int, seed: int = 0
) -> tuple[Bags, np.ndarray, np.ndarray]:
    """Bags of subjects who differ in a way the bags show weakly: each subject has a
    location (seen in its bags) and an effect on the target (not seen), shared by its
    bags; each bag adds a little visit noise."""
    rng = np.random.default_rng(seed)
    loc = rng.normal(size=(n_subjects, 2))
    effect = rng.normal(scale=0.6, size=n_subjects)
    groups = np.repeat(np.arange(n_subjects), per_subject)
    arrays, y = [], []
    for s in groups:
        shift = loc[s] + rng.normal(scale=0.05, size=2)
        arrays.append(shift + rng.normal(size=(60, 2)))
        y.append(np.sin(2 * loc[s, 0]) + effect[s] + rng.normal(scale=0.05))
    return Bags.from_arrays(arrays), np.asarray(y), groups


def sw() -> SlicedWasserstein:
    return SlicedWasserstein(n_directions=20, n_levels=20, random_state=0)


def test_group_blocks_and_folds_keep_subjects_whole():
    labels = np.array(["b", "a", "c", "a", "b", "a", "d"])
    blocks = GroupBlocks(labels)
    assert blocks.n_groups == 4 and not blocks.singletons
    covered = np.sort(np.concatenate([idx.ravel() for idx in blocks.batches]))
    assert covered.tolist() == list(range(7))
    for idx in blocks.batches:
        for row in idx:  # one batch row is one subject's bags
            assert len(set(labels[row])) == 1 and (labels == labels[row[0]]).sum() == len(row)
    sums = blocks.group_sums(np.arange(7.0)[:, None])
    assert sums[:, 0].tolist() == [1 + 3 + 5, 0 + 4, 2, 6]
    fold = group_folds(labels, 7, 3, random_state=0)
    for g in np.unique(labels):
        assert np.unique(fold[labels == g]).size == 1
    assert np.unique(fold).size == 3
    assert group_folds(None, 5, 5, random_state=0).tolist() != [0] * 5  # bags as groups


def test_leave_subject_out_residuals_match_refits_without_the_subject():
    bags, y, groups = subject_bags(12, 3)
    groups = groups.copy()
    groups[[0, 1]] = 100  # subjects of unequal sizes: 1, 2, 3 and 4 bags
    groups[2] = 101
    groups[3:7] = 102
    model = DistributionRidge(sw(), gamma=0.5, alpha=1e-3, calibration="jackknife+").fit(
        bags, y, groups
    )
    assert model.selection_["criterion"] == "leave-one-group-out"
    K = model.kernel_matrix(bags)
    np.testing.assert_allclose(K, K.T, rtol=1e-12, atol=1e-12)
    T = len(y)
    for g in np.unique(groups):
        out, keep = groups == g, groups != g
        c = y[keep].mean()
        # bagserve's ridge is (K + λT I) on centred targets; λT stays fixed in the refit.
        ref = KernelRidge(alpha=1e-3 * T, kernel="precomputed").fit(
            K[np.ix_(keep, keep)], y[keep] - c
        )
        expected = y[out] - (ref.predict(K[np.ix_(out, keep)]) + c)
        np.testing.assert_allclose(model.loo_residuals_[out, 0], expected, rtol=1e-7, atol=1e-9)
    # Leaving single bags out instead lets a subject's other bags vouch for it: smaller
    # residuals, the optimism the groups remove.
    bag_out = DistributionRidge(sw(), gamma=0.5, alpha=1e-3, calibration="jackknife+").fit(bags, y)
    assert np.mean(np.abs(bag_out.loo_residuals_)) < np.mean(np.abs(model.loo_residuals_))


def test_cv_plus_fold_models_are_refits_with_the_whole_search():
    bags, y, groups = subject_bags(15, 2, seed=3)
    model = DistributionRidge(
        sw(), gamma=[0.1, 1.0, 10.0], calibration="cv+", calibration_folds=4, random_state=0
    ).fit(bags, y, groups)
    assert model.calibration_ == "cv+"
    folds = model.cv_fold_
    for g in np.unique(groups):  # whole subjects per fold
        assert np.unique(folds[groups == g]).size == 1
    test, _, _ = subject_bags(4, 1, seed=99)
    fold_mu = model._loo_decision(test)[:, :, 0]  # (bags, T): each bag's fold model
    for f in np.unique(folds):
        keep = folds != f
        refit = DistributionRidge(
            sw(), gamma=[0.1, 1.0, 10.0], calibration="jackknife+", random_state=0
        ).fit(bags.take(np.flatnonzero(keep)), y[keep], groups[keep])
        assert (refit.gamma_, refit.alpha_) == (model.cv_gamma_[f], model.cv_alpha_[f])
        held = np.flatnonzero(~keep)
        np.testing.assert_allclose(
            model.cv_residuals_[held, 0],
            y[held] - refit.predict(bags.take(held)),
            rtol=1e-8,
            atol=1e-10,
        )
        np.testing.assert_allclose(fold_mu[:, held[0]], refit.predict(test), rtol=1e-8, atol=1e-10)
    # Each interval holds its prediction (its exact form: test_conformal's oracle).
    lo, hi = model.predict_interval(test, coverage=0.8).T
    assert np.all(lo < model.predict(test)) and np.all(model.predict(test) < hi)


def test_estimators_warn_when_a_choice_lands_on_a_grid_edge():
    bags, y, _ = subject_bags(10, 2, seed=5)
    with pytest.warns(GridEdgeWarning, match="alpha"):
        DistributionRidge(sw(), gamma=1.0, alpha=[1e-1, 1.0, 10.0], calibration="jackknife+").fit(
            bags, y
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", GridEdgeWarning)  # fixed values: nothing to warn of
        DistributionRidge(sw(), gamma=1.0, alpha=1e-3, calibration="jackknife+").fit(bags, y)


def test_names_that_suggest_repeated_subjects():
    assert repeated_subjects(["P01_t1.fcs", "P01_t2.fcs", "P02_t1.fcs", "P03_t1.fcs"]) == {"P01": 2}
    assert repeated_subjects([p.name for p in sorted(YEAST.glob("*.fcs"))]) == {}
    assert repeated_subjects(["a.fcs", "b.fcs"]) == {}


def _subject_copies(tmp_path: Path) -> Path:
    """The 21 dosed yeast files as 7 'subjects' of 3 'visits' each (links, new names),
    with a doses table keyed by the new names and a sample id column."""
    with Path("examples/yeast_dose/doses.csv").open() as f:
        doses = list(csv.DictReader(f))
    folder = tmp_path / "subjects"
    folder.mkdir()
    rows = ["file,log10_IP,sample,subject"]
    for k, row in enumerate(doses):
        name = f"S{k // 3:02d}_v{k % 3}.fcs"
        (folder / name).symlink_to(YEAST / row["file"])
        rows.append(f"{name},{row['log10_IP']},patient-{k // 3}-visit-{k % 3},S{k // 3:02d}")
    (tmp_path / "doses.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_toml_groups_fold_calibrate_and_report_by_subject(tmp_path):
    folder = _subject_copies(tmp_path)
    data = {
        "files": str(folder / "*.fcs"),
        "labels": str(tmp_path / "doses.csv"),
        "label_column": "log10_IP",
    }
    fixed = {"search": {"representation__p": [2]}}
    # Without groups: trained, with a warning naming the suspected subjects.
    (tmp_path / "plain").mkdir()
    cfg = example("yeast_dose", tmp_path / "plain", data=data, **fixed)
    with pytest.warns(GroupingWarning, match=r"S00 \(3 files\)"):
        plain = train(cfg, progress=False)
    meta = read_manifest(plain.path)["metadata"]
    assert meta["grouping"]["by"] == "bags" and meta["grouping"]["suspected_repeats"]["S03"] == 3
    card = (plain.path / "card.md").read_text()
    assert "Subjects: not given" in card and "S00" in card
    # With groups (and sample ids): folds, calibration and report by subject.
    (tmp_path / "grouped").mkdir()
    cfg = example(
        "yeast_dose",
        tmp_path / "grouped",
        data={
            **data,
            "groups": str(tmp_path / "doses.csv"),
            "group_column": "subject",
            "sample_column": "sample",
        },
        **fixed,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", GroupingWarning)
        warnings.simplefilter("ignore", GridEdgeWarning)
        grouped = train(cfg, progress=False)
    meta = read_manifest(grouped.path)["metadata"]
    assert meta["grouping"]["by"] == "groups" and meta["grouping"]["n_groups"] == 7
    assert meta["calibration"]["groups"] is True
    tables = json.loads((grouped.path / "report" / "metrics.json").read_text())
    assert tables["cv"]["scheme"].startswith("k-fold over groups")
    fold_of: dict[str, set[int]] = {}
    for row in tables["per_sample"]:
        fold_of.setdefault(row["file"].split("-visit-")[0], set()).add(row["fold"])
    assert len(fold_of) == 7 and all(len(f) == 1 for f in fold_of.values())
    model = load(grouped.path)
    assert np.unique(model.calibration_groups_).size == 7
    assert "Subjects: 7" in (grouped.path / "card.md").read_text()
    # Training samples are known by their sample ids, never by a path.
    names = [b["name"] for b in meta["training_bags"]]
    assert sorted(names) == sorted(f"patient-{k // 3}-visit-{k % 3}" for k in range(21))
    assert "How the folds were grouped" in (grouped.path / "report" / "report.html").read_text()
