"""Marginal transfer on new batches: per-task normalisation chosen by CV, the linear
part of the point kernel, leave-one-batch-out selection, and batches in training
configurations."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from bagserve.core import (
    Bags,
    BagValidationError,
    MarginalTransferClassifier,
    MarginalTransferRegressor,
    load,
)
from bagserve.core.bags import (
    QUANTILE_LEVELS,
    align_quantiles,
    bag_quantiles,
    standardise_each_bag,
)
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.errors import ConfigError
from bagserve.core.estimators._transfer_refine import refine_scores
from bagserve.core.selection import leave_one_group_out_folds
from bagserve.core.training import train
from scipy.spatial.distance import cdist


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


# ----------------------------------------------------------------- folds by batch
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


def batched(n_cells: int = 150, strength: float = 2.0):
    tasks, y, batches = make_batched_cytometry_tasks(
        2, 4, n_cells, n_markers=4, n_populations=3, random_state=0, strength=strength
    )
    return tasks, y, batches


def test_named_batches_select_by_leave_one_batch_out():
    """A model with no fallback answers every task, new batches included: with two
    batches named, its search holds out one batch per fold."""
    tasks, y, batches = batched()
    model = MarginalTransferClassifier(
        n_components=16, tau=[0.0, 1.0], alpha=[1e-3], normalise="standard", random_state=0
    ).fit(tasks, y, groups=batches)
    assert model.selection_["cv"] == "leave-one-batch-out"
    expected = leave_one_group_out_folds(batches)
    assert len(model.selection_["folds"]) == 2
    for (tr, va), (etr, eva) in zip(model.selection_["folds"], expected, strict=True):
        np.testing.assert_array_equal(tr, etr)
        np.testing.assert_array_equal(va, eva)
    # One batch named is no batch to leave out: leave-tasks-out, as without groups.
    one = MarginalTransferClassifier(
        n_components=16, tau=[0.0, 1.0], alpha=[1e-3], normalise="standard", cv=3
    )
    one.set_params(random_state=0).fit(tasks, y, groups=np.zeros(len(tasks)))
    assert one.selection_["cv"] == "leave-tasks-out" and len(one.selection_["folds"]) == 3
    with pytest.raises(BagValidationError, match="one batch per task"):
        MarginalTransferClassifier(random_state=0).fit(tasks, y, groups=batches[:3])
    # Checked even when nothing is searched.
    fixed = MarginalTransferClassifier(
        n_components=16, tau=0.0, alpha=1e-3, point_bandwidth=1.0, task_gamma=1.0,
        normalise="none", random_state=0,
    )  # fmt: skip
    with pytest.raises(BagValidationError, match="one batch per task"):
        fixed.fit(tasks, y, groups=batches[:3])


# ----------------------------------------------------------------- normalisation
def check_rule(record: dict) -> None:
    """The documented rule, recomputed from the record: the first option (simplest
    first) within one paired standard error of the least mean CV error."""
    errs = {k: np.asarray(v) for k, v in record["fold_errors"].items()}
    best = min(errs, key=lambda k: errs[k].mean())
    for name in record["order"]:
        d = errs[name] - errs[best]
        if d.mean() <= d.std(ddof=1) / np.sqrt(d.size):
            assert record["chosen"] == name
            break
    for name, e in record["cv_error"].items():
        assert e == pytest.approx(errs[name].mean(), rel=1e-12)


def test_named_batches_choose_the_fallback_by_leave_one_batch_out():
    """Both batches in training and named. Leave-tasks-out folds hold both batches, so
    they need no normalisation: the primary model, which answers samples like the
    training ones, keeps the cells as they are. Leave-one-batch-out folds see the batch
    effect: there the standardised fallback beats the primary by far and is kept; it
    answers a sample of a third batch, and a new sample of a training batch is the
    primary's."""
    tasks, y, batches = make_batched_cytometry_tasks(3, 4, 300, random_state=[0, 1], strength=2)
    per = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    train = np.flatnonzero(batches < 2)
    model = MarginalTransferClassifier(n_components=32, random_state=0)
    model.fit(tasks[train], np.concatenate([per[t] for t in train]), groups=batches[train])
    record = model.selection_["normalisation"]
    check_rule(record)
    assert model.normalise_ == "none" and model.selection_["cv"] == "leave-tasks-out"
    assert record["fallback_cv"] == "leave-one-batch-out"
    assert record["primary_batch_cv_error"] > 0.3 > 0.05 > record["fallback_cv_error"], record
    assert model.fallback_ is not None and model.fallback_.normalise_ == "standard"
    # The batch folds chose between the pooled linear model and the model's own kernel.
    options = record["fallback_options"]
    assert list(options) == ["pooled linear", "own kernel"]
    assert record["fallback_cv_error"] == min(options.values())
    assert model.fallback_.point_kernel_ == (
        "linear" if options["pooled linear"] <= options["own kernel"] else "gaussian+linear"
    )

    # The disagreement threshold: the worst fold error of each model (their records
    # average to the search's CV errors), summed, times range_factor.
    worst = []
    for errs, ev in (
        (record["primary_fold_errors"], model.selection_["evaluated"]),
        (record["fallback_fold_errors"], None),
    ):
        worst.append(np.max(errs))
        if ev is not None:
            best = model.selection_["best"]
            row = next(e for e in ev if e["sigma"] == best["sigma"] and e["tau"] == best["tau"])
            li = int(np.argmin(np.abs(model.selection_["alpha_grid"] - best["alpha"])))
            assert np.mean(errs) == pytest.approx(row["cv_error"][li], rel=1e-12)
    assert model.disagreement_threshold_ == pytest.approx(1.5 * sum(worst), rel=1e-12)

    third = np.flatnonzero(batches == 2)
    far = model.predict_tasks(tasks[third])
    assert all(p.report.fallback and p.report.out_of_range for p in far)
    # A third batch's samples need not lie beyond the embedding range (here they lie
    # near batch 1's): the two models' disagreement flags them.
    alone = clone_without_fallback(model)
    flagged = [p for p in far if p.report.distance <= model.range_threshold_]
    assert flagged
    for t, p in zip(third, far, strict=True):
        if p.report.disagreement is not None:
            oracle = np.mean(alone.predict(tasks[[t]]) != model.fallback_.predict(tasks[[t]]))
            assert p.report.disagreement == pytest.approx(oracle, abs=1e-12)
            assert oracle > model.disagreement_threshold_
    assert [r.fallback for r in model.task_report(tasks[third])] == [p.report.fallback for p in far]
    truth = np.concatenate([per[t] for t in third])
    acc = np.mean(np.concatenate([p.predictions for p in far]) == truth)
    acc_alone = np.mean(alone.predict(tasks[third]) == truth)
    assert acc > 0.85 and acc > acc_alone + 0.2, (acc, acc_alone)
    # Samples of the training batches: the models agree, the primary answers.
    own = model.predict_tasks(tasks[train])
    assert not any(p.report.fallback for p in own)
    assert all(p.report.disagreement <= model.disagreement_threshold_ for p in own)


def test_a_fallback_no_better_on_unseen_batches_is_dropped():
    """Without batch effects, standardising each sample only moves its populations
    (their proportions differ): on leave-one-batch-out folds the fallback does worse
    than the primary model, so there is none."""
    tasks, y, batches = make_batched_cytometry_tasks(2, 4, 300, random_state=[0, 1], strength=0)
    model = MarginalTransferClassifier(n_components=32, random_state=0)
    model.fit(tasks, y, groups=batches)
    record = model.selection_["normalisation"]
    assert model.normalise_ == "none" and record["fallback_cv"] == "leave-one-batch-out"
    assert record["fallback_cv_error"] >= record["primary_batch_cv_error"], record
    assert "fallback" not in record and model.fallback_ is None


def test_new_batches_out_of_range_are_answered_by_the_invariant_fallback():
    """Folds within one batch prefer no normalisation; the new batch, far from every
    training task, is answered by the standardised fallback (the report says so), and
    labelled about as well as the training batch's own cells."""
    tasks, y, batches = make_batched_cytometry_tasks(2, 4, 600, random_state=[0, 1], strength=2)
    per = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    train = np.flatnonzero(batches == 0)
    new = np.flatnonzero(batches == 1)
    # Each training sample's first 300 cells train; its last 300 are new cells of it.
    fit_tasks = Bags.from_arrays([np.asarray(tasks[t])[:300] for t in train])
    same = Bags.from_arrays([np.asarray(tasks[t])[300:] for t in train])
    model = MarginalTransferClassifier(n_components=32, random_state=0)
    model.fit(fit_tasks, np.concatenate([per[t][:300] for t in train]))
    record = model.selection_["normalisation"]
    assert record["order"] == ["none", "standard", "quantile"]
    check_rule(record)
    assert model.normalise_ != "standard" and model.fallback_.normalise_ == "standard"

    far = model.predict_tasks(tasks[new])
    assert all(p.report.out_of_range and p.report.fallback for p in far)
    np.testing.assert_array_equal(
        model.decision_function(tasks[new]), model.fallback_.decision_function(tasks[new])
    )
    # Tasks in range are the primary model's: the same scores without the fallback.
    near = model.predict_tasks(same)
    assert not any(p.report.out_of_range or p.report.fallback for p in near)
    alone = clone_without_fallback(model)
    np.testing.assert_array_equal(model.decision_function(same), alone.decision_function(same))

    truth = np.concatenate([per[t] for t in new])
    acc = np.mean(np.concatenate([p.predictions for p in far]) == truth)
    # What the fallback adds over the primary model as it answers uncalibrated (the
    # landmark calibration, without a fallback, is the primary's own defence: here it
    # reaches about 0.92, the fallback 1.0).
    alone.calibration_ = "none"
    acc_alone = np.mean(alone.predict(tasks[new]) == truth)
    acc_same = np.mean(model.predict(same) == np.concatenate([per[t][300:] for t in train]))
    assert acc > 0.9 and acc > acc_alone + 0.2 and acc > acc_same - 0.08, (
        acc,
        acc_alone,
        acc_same,
    )


def weighted_ridge(tasks, labels, classes, alpha):
    """The pooled linear model's oracle: scikit-learn's Ridge on ``[x, 1]`` (no
    intercept of its own) with weights ``1/(N n_i)`` on the ±1 one-vs-rest codes;
    returns its scores of other tasks' cells."""
    from sklearn.linear_model import Ridge

    X = np.hstack([tasks.points, np.ones((tasks.n_points, 1))])
    codes = np.searchsorted(classes, labels)
    Y = -np.ones((codes.size, classes.size))
    Y[np.arange(codes.size), codes] = 1.0
    w = np.repeat(1.0 / (len(tasks) * tasks.sizes), tasks.sizes)
    ridge = Ridge(alpha=alpha, fit_intercept=False).fit(X, Y, sample_weight=w)
    return lambda new: ridge.predict(np.hstack([new.points, np.ones((new.n_points, 1))]))


def test_without_batches_the_fallback_blends_the_pooled_linear_model_and_the_kernel():
    """With one batch in training nothing can say which capacity carries over to
    another: the fallback averages the scores of the low-capacity model and of the
    model's own kernel, both on per-sample standardised cells. The low-capacity one is
    a ridge on ``[x, 1]`` with weights ``1/(N n_i)`` on the ±1 one-vs-rest codes:
    scikit-learn's Ridge at the chosen λ (no intercept) is its oracle."""
    import copy

    tasks, y, batches = make_batched_cytometry_tasks(2, 4, 300, random_state=[0, 1], strength=2)
    per = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    train = np.flatnonzero(batches == 0)
    model = MarginalTransferClassifier(n_components=32, random_state=0)
    model.fit(tasks[train], np.concatenate([per[t] for t in train]))
    fb = model.fallback_
    assert fb.point_kernel_ == "linear" and fb.tau_ == 1.0 and fb.normalise_ == "standard"
    assert fb.blend_.point_kernel_ == "gaussian+linear" and fb.blend_.normalise_ == "standard"
    record = model.selection_["normalisation"]
    assert record["fallback_cv"] == "leave-tasks-out"
    assert list(record["fallback_options"]) == ["pooled linear", "own kernel"]
    assert record["fallback_cv_error"] == max(record["fallback_options"].values())

    new = tasks[np.flatnonzero(batches == 1)]
    # The blend averages the members' scores; the fallback then refines the average
    # by each new sample's own cells (the members themselves never refine).
    assert fb.refine_ == "mixture" and fb.blend_.refine_ == "none"
    linear = copy.copy(fb)
    linear.blend_, linear.refine_ = None, "none"
    unrefined = copy.copy(fb)
    unrefined.refine_ = "none"
    average = (linear.decision_function(new) + fb.blend_.decision_function(new)) / 2
    np.testing.assert_allclose(unrefined.decision_function(new), average, rtol=1e-12, atol=1e-12)
    std_each = standardise_each_bag(new)
    sizes = np.cumsum(new.sizes)[:-1]
    refined = [
        refine_scores(np.asarray(x), s, fb.seed_)[0]
        for x, s in zip(std_each, np.split(average, sizes), strict=True)
    ]
    np.testing.assert_array_equal(fb.decision_function(new), np.concatenate(refined))
    labels = np.concatenate([per[t] for t in train])
    ridge = weighted_ridge(standardise_each_bag(tasks[train]), labels, model.classes_, fb.alpha_)
    oracle = ridge(standardise_each_bag(new))
    np.testing.assert_allclose(linear.decision_function(new), oracle, rtol=1e-7, atol=1e-9)


def clone_without_fallback(model):
    import copy

    alone = copy.copy(model)
    alone.fallback_ = None
    return alone


def test_auto_normalisation_gives_up_standardisation_when_it_costs_accuracy():
    """Each task is one population whose class is its absolute level: standardising
    erases the label, the folds see it, and "none" is chosen."""
    rng = np.random.default_rng(3)
    arrays, labels = [], []
    for t in range(10):
        cls = t % 2
        arrays.append(rng.normal(loc=3.0 * cls, scale=0.5, size=(60, 2)))
        labels.append(np.full(60, cls))
    model = MarginalTransferClassifier(n_components=16, random_state=0)
    model.fit(arrays, labels)
    check_rule(model.selection_["normalisation"])
    assert model.normalise_ == "none"
    cv = model.selection_["normalisation"]["cv_error"]
    assert cv["standard"] > 0.3 and cv["none"] < 0.05, cv
    # An explicit normalisation has no fallback.
    fixed = MarginalTransferClassifier(n_components=16, normalise="none", random_state=0)
    assert fixed.fit(arrays, labels).fallback_ is None


def test_normalisation_is_stored_and_applied_after_loading(tmp_path):
    from bagserve.core import save

    tasks, y, _ = batched()
    model = MarginalTransferClassifier(
        n_components=16, normalise="quantile", tau=[0.0], alpha=[1e-3], random_state=0
    ).fit(tasks, y)
    assert model.normalise_ == "quantile" and model.quantile_reference_.shape == (9, 4)
    # The model sees the new tasks aligned to the training reference: equal to a model
    # without normalisation fitted and asked on tasks aligned beforehand.
    aligned = align_quantiles(tasks, model.quantile_reference_)
    plain = MarginalTransferClassifier(
        n_components=16, normalise="none", tau=[0.0], alpha=[1e-3], random_state=0
    ).fit(aligned, y)
    np.testing.assert_allclose(
        model.decision_function(tasks), plain.decision_function(aligned), rtol=1e-9, atol=1e-12
    )
    again = load(save(model, tmp_path / "m"))
    np.testing.assert_array_equal(again.decision_function(tasks), model.decision_function(tasks))


# ----------------------------------------------------------------- the linear part
def test_gaussian_plus_linear_kernel_is_the_documented_sum():
    """k_X = exp(-|x - x'|²/(2σ²)) + x̃ᵀx̃'/d + 1 with x̃ standardised by the training
    points' mean and standard deviation (oracle: scipy's cdist and numpy)."""
    tasks, y, _ = batched(40)
    model = MarginalTransferRegressor(
        solver="exact",
        loss="squared",
        normalise="none",
        pooling=True,
        point_bandwidth=1.3,
        alpha=1e-3,
        random_state=0,
    ).fit(tasks, y.astype(float))
    assert model.point_kernel_ == "gaussian+linear"
    x = np.asarray(tasks.points)
    xt = (x - x.mean(axis=0)) / x.std(axis=0)
    expected = np.exp(-cdist(x, x, "sqeuclidean") / (2 * 1.3**2)) + xt @ xt.T / x.shape[1] + 1
    np.testing.assert_allclose(model.joint_kernel(tasks), expected, rtol=1e-10, atol=1e-12)
    # The random features converge to it: their Gram is the RFF Gram plus the exact part.
    rf = MarginalTransferRegressor(
        normalise="none",
        pooling=True,
        point_bandwidth=1.3,
        alpha=1e-3,
        n_components=4096,
        random_state=0,
    ).fit(tasks, y.astype(float))
    Z = rf.joint_features(tasks)
    assert np.max(np.abs(Z @ Z.T - expected)) < 0.15
    # The paper's two-layer map keeps the Gaussian kernel by default.
    paper = MarginalTransferClassifier(
        task_map="rff", normalise="none",
        point_bandwidth=1.0, task_gamma=1.0, alpha=1e-3, n_components=16, random_state=0,
    ).fit(tasks, y)  # fmt: skip
    assert paper.point_kernel_ == "gaussian"


# ----------------------------------------------------------------- configurations
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
            tau = [0.0, 1.0]
            alpha = [1e-3]
            random_state = 0
            [search]
            widen_edges = false
            """
        )
    )
    result = train(cfg)
    assert result.metrics["cv"]["scheme"] == "leave-one-batch-out"
    assert result.metrics["cv"]["n_folds"] == 2
    model = load(result.path)
    # The final fit chose its fallback for new batches leave-one-batch-out too (or,
    # without a fallback search, its one model).
    record = model.selection_["normalisation"]
    assert "leave-one-batch-out" in (model.selection_["cv"], record.get("fallback_cv"))
    # A data file the sheet does not name is an error naming it.
    (tmp_path / "samples.csv").write_text("\n".join(sheet.splitlines()[:-1]) + "\n")
    with pytest.raises(ConfigError, match=names[-1]):
        train(cfg, overwrite=True)


def test_runtime_answers_say_which_tasks_the_fallback_answered(tmp_path):
    """Through a saved artifact and the model runtime: the domain report of each bag
    flags the fallback, and the labels equal the fallback's own."""
    from bagserve.core import save
    from bagserve.core.io import Panel
    from bagserve.core.runtime import ModelRuntime

    tasks, y, batches = make_batched_cytometry_tasks(2, 4, 400, random_state=[0, 1], strength=2)
    per = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    train = np.flatnonzero(batches == 0)
    model = MarginalTransferClassifier(n_components=32, random_state=0)
    model.fit(tasks[train], np.concatenate([per[t] for t in train]))
    assert model.fallback_ is not None
    markers = [f"M{j}" for j in range(tasks.dim)]
    path = save(model, tmp_path / "m", panel=Panel(markers).to_json())
    runtime = ModelRuntime.open(path)
    # One new-batch sample and one training sample.
    bags = Bags.from_arrays([np.asarray(tasks[4]), np.asarray(tasks[0])])
    result = runtime.predict(bags)
    np.testing.assert_array_equal(result.domain.fallback, [True, False])
    np.testing.assert_array_equal(result.domain.out_of_range, [True, False])
    assert runtime.info.domain_of(result.domain, 0)["fallback"] is True
    # The far sample was the fallback's alone; the training sample was asked of both
    # models, which agree on it within the threshold.
    assert runtime.info.domain_of(result.domain, 0)["disagreement"] is None
    own = runtime.info.domain_of(result.domain, 1)["disagreement"]
    assert own == model.task_report(tasks[[0]])[0].disagreement
    assert 0.0 <= own <= model.disagreement_threshold_
    # Each answer says how many labels the answering model's refinement changed: the
    # fallback's, for the far sample; none for the training one (the primary does not
    # refine here).
    reports = model.task_report(tasks[[4, 0]])
    assert model.fallback_.refine_ == "mixture" and model.refine_ == "none"
    assert runtime.info.domain_of(result.domain, 0)["relabelled"] == reports[0].relabelled
    assert reports[0].relabelled is not None
    assert runtime.info.domain_of(result.domain, 1)["relabelled"] is None
    np.testing.assert_array_equal(
        result.labels[: tasks.sizes[4]], model.fallback_.predict(np.asarray(tasks[4]))
    )
    np.testing.assert_array_equal(result.labels[tasks.sizes[4] :], model.predict(tasks[[0]]))


def test_a_regressor_fallback_answers_new_batches_and_measures_disagreement_in_rms():
    """The same mechanism for values: a population's index to predict per cell. Within
    one batch the raw cells serve; the new batch is the fallback's (its predictions its
    own, a blend or the capacity its folds chose), and the in-range disagreement is the
    root mean square difference of the two models' values."""
    import copy

    from bagserve.core import MarginalTransferRegressor

    tasks, y, batches = make_batched_cytometry_tasks(2, 4, 300, random_state=[0, 1], strength=2)
    per = [y[tasks.offsets[t] : tasks.offsets[t + 1]].astype(float) for t in range(len(tasks))]
    train = np.flatnonzero(batches == 0)
    model = MarginalTransferRegressor(n_components=32, random_state=0)
    model.fit(tasks[train], np.concatenate([per[t] for t in train]))
    assert model.normalise_ == "none"
    choice = model.selection_["normalisation"]["fallback_choice"]["chosen"]
    assert (model.fallback_.blend_ is not None) == (choice == "blend")
    new = np.flatnonzero(batches == 1)
    far = model.predict_tasks(tasks[new])
    assert all(p.report.fallback for p in far)
    np.testing.assert_array_equal(
        np.concatenate([p.predictions for p in far]), model.fallback_.predict(tasks[new])
    )
    truth = np.concatenate([per[t] for t in new])
    alone = copy.copy(model)
    alone.fallback_ = None
    rmse = np.sqrt(np.mean((model.predict(tasks[new]) - truth) ** 2))
    rmse_alone = np.sqrt(np.mean((alone.predict(tasks[new]) - truth) ** 2))
    assert rmse < 0.5 * rmse_alone, (rmse, rmse_alone)
    for t, p in zip(train, model.predict_tasks(tasks[train]), strict=True):
        a = alone.predict(tasks[[t]])
        b = model.fallback_.predict(tasks[[t]])
        assert p.report.disagreement == pytest.approx(np.sqrt(np.mean((a - b) ** 2)), rel=1e-9)
        assert not p.report.fallback


@pytest.mark.parametrize(
    ("linear", "kernel", "constant", "chosen"),
    [
        # Real-data-like: the kernel removes 5 points of fold error, well beyond noise.
        ([0.10, 0.11, 0.09, 0.12, 0.10], [0.05, 0.06, 0.04, 0.06, 0.05], 0.6, "own kernel"),
        # Both nearly perfect: a 0.7-point gain, below 2 % of the constant's 0.6.
        ([0.008, 0.007, 0.006, 0.009, 0.007], [0.0, 0.0, 0.001, 0.0, 0.0], 0.6, "blend"),
        # A large gain the folds disagree on: within the paired noise.
        ([0.30, 0.02, 0.25, 0.03, 0.28], [0.02, 0.25, 0.03, 0.30, 0.05], 0.6, "blend"),
        # The linear model better by more than both bars.
        ([0.05, 0.06, 0.04, 0.05, 0.05], [0.10, 0.12, 0.09, 0.11, 0.10], 0.6, "pooled linear"),
    ],
)
def test_without_batches_the_folds_choose_a_capacity_only_by_a_clear_margin(
    linear, kernel, constant, chosen
):
    from bagserve.core.estimators._transfer_fallback import CAPACITY_GAIN, _capacity_choice

    record = _capacity_choice(np.asarray(linear), np.asarray(kernel), constant)
    diff = np.asarray(linear) - np.asarray(kernel)
    se = diff.std(ddof=1) / np.sqrt(diff.size)  # the paired standard error, by hand
    assert record["gain"] == pytest.approx(diff.mean())
    assert record["se"] == pytest.approx(se)
    assert record["margin"] == pytest.approx(max(se, CAPACITY_GAIN * constant))
    assert record["chosen"] == chosen


# ----------------------------------------------------------------- the primary's capacity
def test_without_batches_the_primary_averages_its_kernel_with_the_pooled_linear_model(tmp_path):
    """Gaussian populations a linear model separates as well as the kernel: the folds
    of one batch show no clear gain for the kernel, so the primary model answers with
    both averaged, the pooled linear one fitted on the tasks as the primary sees them
    (no normalisation here). scikit-learn's Ridge on ``[x, 1]`` with weights
    ``1/(N n_i)`` at the chosen λ is the linear member's oracle; the average is what
    answers, refined by the primary's own choice, and it survives saving."""
    import copy

    from bagserve.core import save
    from bagserve.core.estimators._transfer_fallback import CAPACITY_GAIN

    tasks, y, batches = make_batched_cytometry_tasks(2, 4, 300, random_state=[0, 1], strength=2)
    per = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    train_idx = np.flatnonzero(batches == 0)
    model = MarginalTransferClassifier(n_components=32, refine="none", random_state=0)
    model.fit(tasks[train_idx], np.concatenate([per[t] for t in train_idx]))
    record = model.selection_["capacity"]
    gain = np.mean(record["fold_errors"]["pooled linear"]) - np.mean(
        record["fold_errors"]["own kernel"]
    )
    assert abs(gain) <= max(record["se"], CAPACITY_GAIN * record["constant_error"])
    assert record["chosen"] == "blend"
    partner = model.blend_
    assert partner.point_kernel_ == "linear" and partner.tau_ == 1.0
    assert partner.normalise_ == model.normalise_ == "none"
    assert model.point_kernel_ == "gaussian+linear"

    labels = np.concatenate([per[t] for t in train_idx])
    ridge = weighted_ridge(tasks[train_idx], labels, model.classes_, partner.alpha_)
    inside = tasks[train_idx[:2]]
    np.testing.assert_allclose(
        partner.decision_function(inside), ridge(inside), rtol=1e-7, atol=1e-9
    )
    kernel = copy.copy(model)
    kernel.blend_, kernel.fallback_ = None, None
    answered = model.predict_tasks(inside)
    assert not any(p.report.fallback for p in answered)
    average = (kernel.decision_function(inside) + partner.decision_function(inside)) / 2
    np.testing.assert_allclose(
        np.concatenate([p.scores for p in answered]), average, rtol=1e-12, atol=1e-12
    )
    again = load(save(model, tmp_path / "m"))
    np.testing.assert_array_equal(again.decision_function(tasks), model.decision_function(tasks))
    # The model card says so.
    from bagserve.core.card import render_card
    from bagserve.core.training.saving import _new_batch_record

    card = render_card(
        {"new_batches": _new_batch_record(model)},
        estimator="MarginalTransferClassifier",
        kind="cell",
    )
    assert (
        "- Samples like the training samples: answered by the average of a pooled linear "
        "model and the model's own kernel (its folds did not show the kernel clearly better)"
    ) in card


def test_the_primary_keeps_its_kernel_alone_where_the_folds_show_it_clearly_better():
    """Two classes on the diagonals of four clusters (an exclusive or): no linear
    model separates them, the kernel's folds gain far beyond both bars, and the kernel
    answers alone."""
    rng = np.random.default_rng(0)
    centres = np.array([[-2.0, -2.0], [2.0, 2.0], [-2.0, 2.0], [2.0, -2.0]])
    bags, labels = [], []
    for _ in range(5):
        which = rng.integers(0, 4, 240)
        bags.append(centres[which] + rng.normal(scale=0.5, size=(240, 2)))
        labels.append(np.where(which < 2, "a", "b"))
    model = MarginalTransferClassifier(n_components=32, refine="none", random_state=0)
    model.fit(Bags.from_arrays(bags), np.concatenate(labels))
    record = model.selection_["capacity"]
    assert record["chosen"] == "own kernel", record
    assert record["gain"] > max(record["se"], 0.02 * record["constant_error"])
    assert model.blend_ is None
    assert np.mean(model.predict(Bags.from_arrays(bags)) == np.concatenate(labels)) > 0.95


def test_a_fixed_linear_kernel_batch_folds_or_no_fallback_ask_no_capacity_question():
    """The comparison is for a kernel chosen on leave-tasks-out folds beside a fallback:
    a model told to be linear has nothing to compare, a model chosen on batch folds
    (batches named, no fallback) had the transfer itself measured, and without a
    fallback the primary answers the tasks far out of range too, where a linear model
    of raw cells extrapolates worst."""
    tasks, y, batches = make_batched_cytometry_tasks(2, 4, 200, random_state=[0, 1], strength=2)
    alone = MarginalTransferClassifier(
        n_components=16, normalise="none", refine="none", random_state=0
    ).fit(tasks[batches == 0], y[np.repeat(batches, tasks.sizes) == 0])
    assert alone.fallback_ is None
    assert "capacity" not in alone.selection_ and alone.blend_ is None
    linear = MarginalTransferClassifier(
        n_components=16, point_kernel="linear", refine="none", random_state=0
    ).fit(tasks, y)
    assert "capacity" not in linear.selection_ and linear.blend_ is None
    by_batch = MarginalTransferClassifier(
        n_components=16, normalise="standard", refine="none", random_state=0
    ).fit(tasks, y, groups=batches)
    assert by_batch.selection_["cv"] == "leave-one-batch-out"
    assert "capacity" not in by_batch.selection_ and by_batch.blend_ is None


def test_where_the_linear_model_is_chosen_the_primary_is_that_model(monkeypatch):
    """The plumbing of the third outcome, forced (the kernel has a linear part, so folds
    rarely show the linear model clearly better): the primary model is then the pooled
    linear model at the λ its folds chose, as a model fixed to it is."""
    from bagserve.core.estimators import _transfer_fallback

    real = _transfer_fallback._capacity_choice

    def linear_wins(linear, kernel, constant):
        return {**real(linear, kernel, constant), "chosen": "pooled linear"}

    monkeypatch.setattr(_transfer_fallback, "_capacity_choice", linear_wins)
    tasks, y, _ = make_batched_cytometry_tasks(2, 4, 200, random_state=[0, 1], strength=2)
    model = MarginalTransferClassifier(n_components=16, refine="none", random_state=0)
    model.fit(tasks, y)
    linear = model.selection_["capacity"]["pooled_linear"]
    assert model.point_kernel_ == "linear" and model.tau_ == 1.0 and model.blend_ is None
    assert model.alpha_ == linear["alpha"]
    fixed = MarginalTransferClassifier(
        n_components=16,
        point_kernel="linear",
        tau=[1.0],
        alpha=[linear["alpha"]],
        normalise=model.normalise_,
        refine="none",
        random_state=0,
    ).fit(tasks, y)
    inside = tasks[[0, 1]]
    alone, fixed_alone = clone_without_fallback(model), clone_without_fallback(fixed)
    np.testing.assert_allclose(
        alone.decision_function(inside),
        fixed_alone.decision_function(inside),
        rtol=1e-9,
        atol=1e-12,
    )


def test_with_batches_named_the_calibration_is_chosen_for_the_blend_that_answers(monkeypatch):
    """Batches named and a fallback: the primary is chosen on leave-tasks-out folds and
    may be a blend; each calibration is then judged on the held-out batches for both
    members, counted fold by fold as the worse of the two (the refinement's and reject
    rule's convention), not for the kernel alone."""
    from bagserve.core.estimators import _transfer_calibration

    seen = {}
    real = _transfer_calibration.choose_calibration

    def spy(uncalibrated, evaluators):
        record = real(uncalibrated, evaluators)
        seen.update(
            {
                how: [ev.per_fold(best) for ev, best in members]
                for how, members in evaluators.items()
            }
        )
        return record

    monkeypatch.setattr(_transfer_calibration, "choose_calibration", spy)
    tasks, y, batches = make_batched_cytometry_tasks(2, 4, 300, random_state=[0, 1], strength=2)
    model = MarginalTransferClassifier(n_components=32, refine="none", random_state=0)
    model.fit(tasks, y, groups=batches)
    assert model.fallback_ is not None and model.selection_["cv"] == "leave-tasks-out"
    assert model.selection_["capacity"]["chosen"] == "blend"
    record = model.selection_["calibration"]
    for how in ("quantile", "mmd"):
        assert len(seen[how]) == 2
        np.testing.assert_array_equal(record["fold_errors"][how], np.max(seen[how], axis=0))
