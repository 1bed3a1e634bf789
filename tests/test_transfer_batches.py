"""Marginal transfer across batches: the quantile tools of the bags, leave-one-batch-
out folds, a model fitted with batches named, and batches in training configurations."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from bagserve.core import Bags, BagValidationError, MarginalTransferClassifier, load
from bagserve.core.bags import QUANTILE_LEVELS, align_quantiles, bag_quantiles
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.errors import ConfigError
from bagserve.core.selection import leave_one_group_out_folds
from bagserve.core.training import train


def batched(n_cells: int = 150, strength: float = 2.0):
    tasks, y, batches = make_batched_cytometry_tasks(
        2, 4, n_cells, n_markers=4, n_populations=3, random_state=0, strength=strength
    )
    return tasks, y, batches


# ----------------------------------------------------------------- quantile alignment
def test_bag_quantiles_match_numpy_with_and_without_weights():
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(n, 3)) * [1, 2, 5] for n in (50, 301)]
    bags = Bags.from_arrays(arrays)
    q = bag_quantiles(bags)
    for t, a in enumerate(arrays):
        np.testing.assert_allclose(q[t], np.quantile(a, QUANTILE_LEVELS, axis=0), rtol=1e-12)
    weights = [rng.uniform(0.1, 3.0, size=a.shape[0]) for a in arrays]
    weighted = Bags.from_arrays(arrays, weights=weights)
    qw = bag_quantiles(weighted)
    for t, (a, w) in enumerate(zip(arrays, weights, strict=True)):
        for j in range(3):
            expected = np.quantile(a[:, j], QUANTILE_LEVELS, weights=w, method="inverted_cdf")
            np.testing.assert_allclose(qw[t, :, j], expected, rtol=1e-12)


def test_quantile_alignment_lands_on_the_reference_and_undoes_monotone_distortions():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4000, 2))
    reference = np.quantile(a, QUANTILE_LEVELS, axis=0)
    # The same cells seen through an increasing affine map, and through a non-linear
    # increasing one (the shape of a changed detector voltage).
    affine = a * [2.0, 0.5] + [3.0, -1.0]
    curved = a + 0.8 * np.tanh(a - 0.3)
    for seen in (affine, curved):
        out = np.asarray(align_quantiles(Bags.from_arrays([seen]), reference).points)
        # Independent oracle: numpy's interpolation through the bag's own quantiles.
        q = np.quantile(seen, QUANTILE_LEVELS, axis=0)
        inside = (seen > q[0]) & (seen < q[-1])
        for j in range(2):
            expected = np.interp(seen[:, j], q[:, j], reference[:, j])
            np.testing.assert_allclose(out[inside[:, j], j], expected[inside[:, j]], atol=1e-7)
        # Order is kept in every marker (the map is monotone, tails included).
        for j in range(2):
            order = np.argsort(seen[:, j])
            assert np.all(np.diff(out[order, j]) >= -1e-12)
    # An affine map is undone exactly, tails included (linear continuation).
    back = np.asarray(align_quantiles(Bags.from_arrays([affine]), reference).points)
    plain = np.asarray(align_quantiles(Bags.from_arrays([a]), reference).points)
    np.testing.assert_allclose(back, plain, atol=1e-6)
    # The non-linear one only up to the landmarks' resolution, far better than not at all.
    bent = np.asarray(align_quantiles(Bags.from_arrays([curved]), reference).points)
    assert np.median(np.abs(bent - a)) < 0.1 * np.median(np.abs(curved - a))


# ----------------------------------------------------------------- batches
def test_leave_one_group_out_folds_hold_out_each_batch_once():
    groups = np.array(["b", "a", "b", "c", "a", "c", "c"])
    folds = leave_one_group_out_folds(groups)
    assert len(folds) == 3
    held = np.concatenate([val for _, val in folds])
    np.testing.assert_array_equal(np.sort(held), np.arange(7))
    for fit_on, val in folds:
        assert np.unique(groups[val]).size == 1
        assert groups[val][0] not in set(groups[fit_on])
        np.testing.assert_array_equal(np.union1d(fit_on, val), np.arange(7))
    with pytest.raises(ValueError, match="at least 2 groups"):
        leave_one_group_out_folds(np.zeros(4))


SMALL = {"n_components": 16, "cv": 2, "perturbations": 2, "random_state": 0}


def test_named_batches_are_left_out_one_at_a_time_instead_of_drawn_instruments():
    """With two batches named the search holds out one batch per fold and scores it
    as measured (the real shift); one batch named is no batch to leave out."""
    tasks, y, batches = batched()
    model = MarginalTransferClassifier(**SMALL).fit(tasks, y, groups=batches)
    assert model.selection_["folds"] == "leave one batch out"
    one = MarginalTransferClassifier(**SMALL).fit(tasks, y, groups=np.zeros(len(tasks)))
    assert one.selection_["folds"] == "2 folds x 2 drawn instruments"
    with pytest.raises(BagValidationError, match="groups has 3 entries for 8 tasks"):
        MarginalTransferClassifier(**SMALL).fit(tasks, y, groups=batches[:3])
    # Checked even when nothing is searched.
    fixed = MarginalTransferClassifier(calibrate="standardise", cell_model="linear")
    with pytest.raises(BagValidationError, match="groups has 3 entries"):
        fixed.fit(tasks, y, groups=batches[:3])


def _write_tasks(tmp_path, tasks, y):
    (tmp_path / "data").mkdir()
    names = []
    for t in range(len(tasks)):
        x = np.asarray(tasks[t])
        lab = y[tasks.offsets[t] : tasks.offsets[t + 1]]
        rows = "\n".join(
            ",".join(repr(float(v)) for v in row) + f",{int(c)}"
            for row, c in zip(x, lab, strict=True)
        )
        header = ",".join(f"M{j}" for j in range(x.shape[1]))
        (tmp_path / "data" / f"s{t}.csv").write_text(f"{header},y\n{rows}\n")
        names.append(f"s{t}.csv")
    return names


def test_training_configuration_names_batches(tmp_path):
    tasks, y, batches = batched(80)
    names = _write_tasks(tmp_path, tasks, y)
    sheet = "file,centre\n" + "\n".join(
        f"{n},{'north' if b == 0 else 'south'}" for n, b in zip(names, batches, strict=True)
    )
    (tmp_path / "samples.csv").write_text(sheet + "\n")
    cfg = tmp_path / "batched.toml"
    cfg.write_text(
        textwrap.dedent(
            """
            [model]
            name = "batched"
            output = "models"
            [data]
            files = "data/*.csv"
            cell_label_column = "y"
            batches = "samples.csv"
            batch_column = "centre"
            [panel]
            markers = ["M0", "M1", "M2", "M3"]
            [estimator]
            class = "MarginalTransferClassifier"
            n_components = 16
            perturbations = 2
            random_state = 0
            [search]
            widen_edges = false
            """
        )
    )
    result = train(cfg)
    assert result.metrics["cv"]["scheme"] == "leave-one-batch-out"
    assert result.metrics["cv"]["n_folds"] == 2
    # The final fit chose its calibration and cell model leave-one-batch-out too.
    assert load(result.path).selection_["folds"] == "leave one batch out"
    # A data file the sheet does not name is an error naming it.
    (tmp_path / "samples.csv").write_text("\n".join(sheet.splitlines()[:-1]) + "\n")
    with pytest.raises(ConfigError, match=names[-1]):
        train(cfg, overwrite=True)
