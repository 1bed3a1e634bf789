"""Marginal-transfer fits that share their fold evaluations answer as fits alone.

Training fits the kept candidate on every outer fold, then, when one of its own grids
sat on an edge, the same candidate with only that grid widened. Within
:func:`reusing_fold_evaluations` the second fit takes the configurations the first
evaluated (per-fold errors) and every per-fold cache as computed; its selection record
and its model must be exactly those of the fit alone, and it must evaluate less.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from bagserve.core import MarginalTransferClassifier, artifacts
from bagserve.core.blas import one_thread
from bagserve.core.datasets import make_batched_cytometry_tasks
from bagserve.core.estimators import _transfer_cv, _transfer_nystroem, transfer
from bagserve.core.estimators._transfer_cv import reusing_fold_evaluations
from bagserve.core.representations import mean
from bagserve.core.representations.mean import _median_distance, sharing_median_distances
from sklearn.base import clone

from .exact import assert_same


@pytest.fixture(scope="module")
def data():
    tasks, y, batches = make_batched_cytometry_tasks(2, 4, 250, random_state=0, strength=1.5)
    return tasks, y, batches


def _fits(tasks, y, groups, models):
    out = []
    for model in models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.append(clone(model).fit(tasks, y, groups=groups))
    return out


@pytest.mark.parametrize("batched", [False, True])
def test_refit_with_a_widened_grid_is_the_fit_alone(data, batched, monkeypatch):
    tasks, y, batches = data
    groups = batches if batched else None
    edge = MarginalTransferClassifier(random_state=0, cv=3)
    first = _fits(tasks, y, groups, [edge])[0]
    # The refit training makes: the chosen task γ's grid moved, as absolute values.
    widened = clone(edge).set_params(task_gamma=list(np.logspace(-1, 1, 3) * 7.0))
    models = [edge, widened]

    calls = {"n": 0}
    evaluate = _transfer_cv.FoldEvaluator._fold_error

    def counting(self, cand, f):
        calls["n"] += 1
        return evaluate(self, cand, f)

    monkeypatch.setattr(_transfer_cv.FoldEvaluator, "_fold_error", counting)
    alone = _fits(tasks, y, groups, models)
    alone_calls = calls["n"]
    calls["n"] = 0
    with reusing_fold_evaluations():
        shared = _fits(tasks, y, groups, models)
    shared_calls = calls["n"]

    assert_same(first.selection_, alone[0].selection_)
    for a, s in zip(alone, shared, strict=True):
        assert_same(a.selection_, s.selection_)
        assert a.normalise_ == s.normalise_
        assert np.array_equal(a.decision_function(tasks), s.decision_function(tasks))
    # The second fit evaluated only what the first had not.
    assert shared_calls < alone_calls


def test_evaluations_are_not_kept_after_the_block(data):
    tasks, y, _ = data
    with reusing_fold_evaluations():
        assert _transfer_cv._REUSED.get() == {}
        _fits(tasks, y, None, [MarginalTransferClassifier(random_state=0, cv=3)])
        assert _transfer_cv._REUSED.get()
    assert _transfer_cv._REUSED.get() is None


def test_every_fold_evaluates_the_final_bandwidth_and_features_each_task_once(data, monkeypatch):
    """A relative ``σ`` scales one median, of all the fit's points: the folds evaluate
    the bandwidth the final model gets, and each task's feature statistics at a
    bandwidth are computed once in the search, not once per fold that trains on it."""
    tasks, y, _ = data
    specs: dict[int, set[Any]] = {}
    sigma = _transfer_cv.FoldEvaluator._sigma

    def recording(self, f, spec):
        specs.setdefault(id(self.setup.data.tasks), set()).add(spec)
        return sigma(self, f, spec)

    computed: list[tuple[int, float, int]] = []
    statistics = _transfer_nystroem.task_statistics

    def counting(maps, tasks_, Y, sigma_, which=None, into=None, *rows):
        if which is not None:  # the search's folds (the final fit passes none)
            done = np.zeros(len(tasks_), bool) if into is None else into.done
            computed.extend((id(tasks_), sigma_, int(t)) for t in which if not done[t])
        return statistics(maps, tasks_, Y, sigma_, which, into, *rows)

    monkeypatch.setattr(_transfer_cv.FoldEvaluator, "_sigma", recording)
    monkeypatch.setattr(_transfer_nystroem, "task_statistics", counting)
    model = _fits(tasks, y, None, [MarginalTransferClassifier(random_state=0, cv=3)])[0]
    assert computed and len(computed) == len(set(computed))
    # One σ per spec and set of tasks (a fold's own median would give one per fold).
    for data_id in {d for d, _, _ in computed}:
        sigmas = {s for d, s, _ in computed if d == data_id}
        assert len(sigmas) <= len(specs[data_id])
    # The oracle: the final fit's bandwidth, from its own median of the same points.
    assert model.point_bandwidth_ in {s for _, s, _ in computed}


@pytest.mark.parametrize("threads", [1, 2])
def test_held_out_features_come_with_the_statistics(data, threads, monkeypatch):
    """A held-out task's points are training points of the other folds: their features
    are taken from the pass that computes its statistics, the same bits as computed
    on their own. The oracle is the fit that computes every held-out task's features
    separately; with two folds or more per round (two cores) no fold of a fit without
    batches computes any."""
    tasks, y, batches = data
    monkeypatch.setattr(_transfer_cv, "n_threads_for", lambda n_jobs: threads)
    separate: list[int] = []
    features = _transfer_nystroem.FeatureMaps.point_features

    def in_folds(self, points, sigma):
        if any(f.function == "fold_errors" for f in inspect.stack(context=0)[1:3]):
            separate.append(points.shape[0])
        return features(self, points, sigma)

    monkeypatch.setattr(_transfer_nystroem.FeatureMaps, "point_features", in_folds)
    models = [MarginalTransferClassifier(random_state=0, cv=3)]
    taken = [_fits(tasks, y, None, models)[0]]
    computed_in_folds = len(separate)
    # With batches named, the calibrated held-out tasks are not training points.
    taken.append(_fits(tasks, y, batches, models)[0])
    monkeypatch.setattr(_transfer_cv.FoldEvaluator, "_training_held_out_rows", lambda self: None)
    separate.clear()
    alone = [_fits(tasks, y, groups, models)[0] for groups in (None, batches)]
    assert len(separate) > 0
    if threads > 1:
        assert computed_in_folds == 0
    for a, t in zip(alone, taken, strict=True):
        assert_same(a.selection_, t.selection_)
        assert np.array_equal(a.decision_function(tasks), t.decision_function(tasks))


def test_final_fits_complete_the_searchs_statistics(data, monkeypatch):
    """The final fits (the model's, its blend partner's, the fallback's) take the task
    statistics the search computed on the same tasks at the same bandwidth: each
    task's statistics for a kernel and bandwidth are computed once in the whole fit.
    The oracle is the fit whose final fits compute their own (one BLAS thread for
    both, so that the two computations are the same bits)."""
    tasks, y, batches = data
    computed: list[tuple[int, str, float, int]] = []
    statistics = _transfer_nystroem.task_statistics

    def counting(maps, tasks_, Y, sigma_, which=None, into=None, *rows):
        done = np.zeros(len(tasks_), bool) if into is None else into.done.copy()
        todo = range(len(tasks_)) if which is None else which
        computed.extend(
            (id(tasks_), maps.point_kernel, sigma_, int(t)) for t in todo if not done[t]
        )
        return statistics(maps, tasks_, Y, sigma_, which, into, *rows)

    monkeypatch.setattr(_transfer_nystroem, "task_statistics", counting)
    model = MarginalTransferClassifier(random_state=0, cv=3)
    shared = []
    for groups in (None, batches):
        computed.clear()
        with one_thread():
            shared.append(_fits(tasks, y, groups, [model])[0])
        assert computed and len(computed) == len(set(computed))
    assert shared[0].fallback_ is not None  # its final fits shared too
    fit = _transfer_nystroem.NystroemFeatureStrategy.fit
    monkeypatch.setattr(
        _transfer_nystroem.NystroemFeatureStrategy,
        "fit",
        lambda self, problem: fit(
            self, replace(problem, data=replace(problem.data, statistics={}))
        ),
    )
    computed.clear()
    with one_thread():
        alone = [_fits(tasks, y, None, [model])[0]]
    assert len(computed) > len(set(computed))
    with one_thread():
        alone.append(_fits(tasks, y, batches, [model])[0])
    for a, s in zip(alone, shared, strict=True):
        assert_same(a.selection_, s.selection_)
        assert np.array_equal(a.decision_function(tasks), s.decision_function(tasks))


def test_final_fits_on_the_same_tasks_share_their_embedding(data, monkeypatch, tmp_path):
    """A blend's members, and the fallback and its partner, are fitted on the same tasks:
    they share one task embedding and its distances (and, answering, the new tasks'
    similarities), and the model is the one whose final fits each compute their own
    (the oracle)."""
    tasks, y, batches = data
    model = MarginalTransferClassifier(random_state=0, cv=3)
    shared = [_fits(tasks, y, groups, [model])[0] for groups in (None, batches)]
    pairs = [
        (m, partner)
        for fitted in shared
        for m in (fitted, fitted.fallback_)
        if m is not None
        for partner in (m.blend_,)
        if partner is not None
    ]
    assert pairs
    for m, partner in pairs:
        assert partner.train_embedding_ is m.train_embedding_
        assert partner.task_sq_distances_ is m.task_sq_distances_
        assert partner.shares_task_view_
    # The partners answer from their model's view of the new tasks: the same answers
    # as computing their own (the oracle; models saved before the flag do).
    answers = [m.decision_function(tasks) for m in shared]
    for _, partner in pairs:
        partner.shares_task_view_ = False
    for m, a in zip(shared, answers, strict=True):
        assert np.array_equal(m.decision_function(tasks), a)
    for _, partner in pairs:
        partner.shares_task_view_ = True
    # Saved and loaded, the arrays are no longer shared; the partner still answers
    # from its model's view, the same answers.
    loaded = artifacts.load(artifacts.save(shared[0], tmp_path / "model"))
    partners = [m.blend_ for m in (loaded, loaded.fallback_) if m is not None and m.blend_]
    assert partners and all(p.shares_task_view_ for p in partners)
    assert np.array_equal(loaded.decision_function(tasks), answers[0])
    keys = iter(range(10**6))
    monkeypatch.setattr(transfer, "content_digest", lambda *parts: next(keys))
    alone = [_fits(tasks, y, groups, [model])[0] for groups in (None, batches)]
    for a, s in zip(alone, shared, strict=True):
        assert_same(a.selection_, s.selection_)
        assert np.array_equal(a.decision_function(tasks), s.decision_function(tasks))
        assert np.array_equal(a.task_sq_distances_, s.task_sq_distances_)


def test_each_median_heuristic_is_computed_once_per_fit(data, monkeypatch):
    """The median heuristics (a distance matrix of up to 2,000 points each: the point
    bandwidth's, the task embedding's) are computed once for each set of points and
    generator state in a fit, the final fits' and the fallback's included, and the
    model is the one computed without keeping them."""
    tasks, y, _ = data
    seen: list[tuple[bytes, str]] = []
    median = mean._computed_median_distance

    def recording(points, kernel, rng):
        seen.append((np.ascontiguousarray(points).tobytes(), repr(rng.bit_generator.state)))
        return median(points, kernel, rng)

    monkeypatch.setattr(mean, "_computed_median_distance", recording)
    model = MarginalTransferClassifier(random_state=0, cv=3)
    kept = _fits(tasks, y, None, [model])[0]
    assert kept.fallback_ is not None  # the fallback's final fit asks too
    assert len(seen) >= 4 and len(seen) == len(set(seen))
    # The oracle: every median computed again wherever it is asked for.
    monkeypatch.setattr(transfer, "sharing_median_distances", contextlib.nullcontext)
    seen.clear()
    again = _fits(tasks, y, None, [model])[0]
    assert len(seen) > len(set(seen))  # asked for again, so the first fit saved some
    assert kept.point_bandwidth_ == again.point_bandwidth_
    assert kept.fallback_.point_bandwidth_ == again.fallback_.point_bandwidth_
    assert kept.embedding_.bandwidth_ == again.embedding_.bandwidth_
    assert kept.fallback_.embedding_.bandwidth_ == again.fallback_.embedding_.bandwidth_
    assert_same(kept.selection_, again.selection_)
    np.testing.assert_array_equal(kept.predict(tasks[:2]), again.predict(tasks[:2]))
    np.testing.assert_array_equal(kept.decision_function(tasks), again.decision_function(tasks))


def test_a_kept_median_leaves_the_generator_where_its_computation_did():
    points = np.random.default_rng(0).standard_normal((3000, 3))
    plain = np.random.default_rng(5)
    first = _median_distance(points, "gaussian", plain)
    after = plain.random(4)
    with sharing_median_distances():
        for _ in range(2):
            rng = np.random.default_rng(5)
            assert _median_distance(points, "gaussian", rng) == first
            np.testing.assert_array_equal(rng.random(4), after)
        other = np.random.default_rng(6)  # another state: its own subsample
        alone = _median_distance(points, "gaussian", np.random.default_rng(6))
    assert _median_distance(points, "gaussian", other) == alone


def test_task_statistics_on_all_cores_are_those_computed_one_task_after_another(monkeypatch):
    """Tasks spread over threads give every task's ``A_i``, ``b_i`` and kept features
    to the last bit, whether computed all at once or into a cache holding some."""
    from bagserve.core import Bags
    from bagserve.core.estimators._transfer_strategy import FeatureMaps

    rng = np.random.default_rng(3)
    tasks = Bags.from_arrays([rng.standard_normal((n, 4)) for n in (900, 1500, 700, 1200, 50)])
    Y = rng.standard_normal((tasks.n_points, 3))
    W = rng.standard_normal((16, 4))
    maps = FeatureMaps("gaussian+linear", W, None, tasks.points.mean(0), tasks.points.std(0))
    stats = _transfer_nystroem.task_statistics
    monkeypatch.setattr(_transfer_nystroem, "_PARALLEL_POINTS", 10**12)
    alone = stats(maps, tasks, Y, 1.7)
    monkeypatch.setattr(_transfer_nystroem, "_PARALLEL_POINTS", 0)
    monkeypatch.setattr(_transfer_nystroem, "n_threads_for", lambda n_jobs: 3)
    threads: set[str] = set()
    point_features = FeatureMaps.point_features

    def recording(self, points, sigma):
        import threading

        threads.add(threading.current_thread().name)
        return point_features(self, points, sigma)

    monkeypatch.setattr(FeatureMaps, "point_features", recording)
    at_once = stats(maps, tasks, Y, 1.7)
    part = stats(maps, tasks, Y, 1.7, which=np.array([1, 3]))
    threads_used = set(threads)
    rest = stats(maps, tasks, Y, 1.7, which=np.arange(len(tasks)), into=part)
    assert len(threads_used) > 1
    for got in (at_once, rest):
        assert got.done.all()
        np.testing.assert_array_equal(got.A, alone.A)
        np.testing.assert_array_equal(got.B, alone.B)
        for z, z0 in zip(got.Z, alone.Z, strict=True):
            np.testing.assert_array_equal(z, z0)


def test_grid_edge_warnings_point_at_the_callers_fit(data):
    """The fit runs inside the medians' block; its grid-edge warnings still name the
    line that called ``fit``, as every estimator's do."""
    tasks, y, _ = data
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MarginalTransferClassifier(random_state=0, cv=3).fit(tasks, y)
    edges = [w for w in caught if "grid" in str(w.message)]
    assert edges
    assert {w.filename for w in edges} == {__file__}
