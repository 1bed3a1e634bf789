"""Leave-tasks-out validation errors for the marginal-transfer search.

Kept apart from the estimators: it caches, per fold, the fold's own embedding (fitted
on its training tasks only), the per-task statistics for each point bandwidth, and
scores held-out tasks from their own points, so one evaluation of a configuration
covers the whole ridge path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from ..bags import Bags
from ._transfer_solvers import (
    _CHUNK_POINTS,
    TaskStatistics,
    structured_ridge_path,
    task_ridge_path,
)

if TYPE_CHECKING:
    from .transfer import _MarginalTransfer

__all__ = ["FoldEvaluator"]


class FoldEvaluator:
    """Validation errors of candidate configurations, with caches shared across them."""

    def __init__(
        self,
        model: _MarginalTransfer,
        tasks: Bags,
        emb_tasks: Bags,
        Y: NDArray[np.float64],
        folds: list[tuple[NDArray[np.int64], NDArray[np.int64]]],
    ):
        self.m = model
        self.tasks = tasks
        self.emb_tasks = emb_tasks
        self.Y = Y
        self.folds = folds
        self._stats: dict[float, TaskStatistics] = {}
        self._sigmas: dict[tuple[int, Any], float] = {}
        self._emb: dict[
            tuple[int, float], tuple[NDArray[np.float64], NDArray[np.float64], Any]
        ] = {}

    def _fold_embedding(
        self, f: int, factor: float
    ) -> tuple[NDArray[np.float64], NDArray[np.float64], Any]:
        key = (f, factor)
        if key not in self._emb:
            train, val = self.folds[f]
            rep, emb = self.m._fit_embedding(self.emb_tasks[train], factor)
            sq_tr = emb.sq_distances()
            val_emb = rep.embed(self.emb_tasks[val])
            sq_va = val_emb.sq_distances(emb)
            self._emb[key] = (sq_tr, sq_va, (emb, val_emb))
        return self._emb[key]

    def _sigma(self, f: int, spec: tuple[str, float]) -> float:
        """The point bandwidth of fold ``f``: relative values use its training points only."""
        if (f, spec) not in self._sigmas:
            self._sigmas[(f, spec)] = self.m._sigma_value(spec, self.tasks[self.folds[f][0]].points)
        return self._sigmas[(f, spec)]

    def _error(self, scores: NDArray[np.float64], y: NDArray[np.float64]) -> float:
        if self.m._is_classifier:
            if scores.shape[1] == 1:
                return float(np.mean(np.sign(scores[:, 0]) != np.sign(y[:, 0])))
            return float(np.mean(np.argmax(scores, 1) != np.argmax(y, 1)))
        return float(np.mean((scores - y) ** 2))

    def score(self, cand: dict[str, Any]) -> NDArray[np.float64]:
        """Mean validation error (per task, then over folds) for each ``λ`` of the grid."""
        m = self.m
        lams = m._alpha_grid
        errors = np.zeros(lams.size)
        for f, (train, val) in enumerate(self.folds):
            if cand["tau"] == 1.0:
                sq_tr = np.zeros((train.size, train.size))
                sq_va = np.zeros((val.size, train.size))
                extra = None
            else:
                sq_tr, sq_va, extra = self._fold_embedding(f, cand["emb"])
            gamma = m._gamma_value(cand["gamma"], sq_tr)
            kp_tr = np.ones_like(sq_tr) if gamma is None else m.task_kernel_(sq_tr, gamma)
            kp_va = np.ones_like(sq_va) if gamma is None else m.task_kernel_(sq_va, gamma)
            sigma = self._sigma(f, cand["sigma"])
            if m.solver == "exact":
                errs = self._exact_fold(sigma, cand, train, val, kp_tr, kp_va, lams)
            elif m.task_map == "nystroem":
                errs = self._nystroem_fold(sigma, cand, train, val, kp_tr, kp_va, lams)
            else:
                errs = self._paper_fold(sigma, train, val, gamma, extra, lams)
            errors += errs
        return errors / len(self.folds)

    def _nystroem_fold(self, sigma, cand, train, val, kp_tr, kp_va, lams) -> NDArray[np.float64]:
        m = self.m
        if sigma not in self._stats:
            self._stats[sigma] = m._task_statistics(self.tasks, self.Y, sigma)
        stats = self._stats[sigma]
        basis = None if cand["tau"] == 1.0 else m._nystroem(kp_tr)
        S = m._task_coords(kp_tr, basis, cand["tau"])
        Sv = m._task_coords(kp_va, basis, cand["tau"])
        # Validation errors do not need the final fit's precision.
        thetas = task_ridge_path(S, stats, train, lams, rtol=1e-6)
        held = []
        for v in val:
            pts, yv = self._validation_points(v)
            held.append((m._point_features(pts, sigma), yv))
        errs = np.zeros(lams.size)
        for li, theta in enumerate(thetas):
            V = np.einsum("ta,apk->tpk", Sv, theta)
            errs[li] = np.mean([self._error(Z @ V[j], yv) for j, (Z, yv) in enumerate(held)])
        return errs

    def _validation_points(self, v: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        lo, hi = int(self.tasks.offsets[v]), int(self.tasks.offsets[v + 1])
        pick = np.arange(lo, hi)
        if pick.size > self.m.cv_points:
            pick = np.sort(
                np.random.default_rng([self.m.seed_, v]).choice(
                    pick, self.m.cv_points, replace=False
                )
            )
        return self.tasks.points[pick], self.Y[pick]

    def _exact_fold(self, sigma, cand, train, val, kp_tr, kp_va, lams) -> NDArray[np.float64]:
        m = self.m
        sub = self.tasks[train]
        local = sub.bag_index()
        K = m._point_gram(sub.points, sub.points, sigma)
        K *= cand["tau"] + (1.0 - cand["tau"]) * kp_tr[np.ix_(local, local)]
        c = np.repeat(1.0 / (train.size * sub.sizes), sub.sizes)
        Ysub = np.concatenate(
            [self.Y[self.tasks.offsets[t] : self.tasks.offsets[t + 1]] for t in train]
        )
        errs = np.zeros(lams.size)
        for li, lam in enumerate(lams):
            coef = m._exact_solve(K, Ysub, c, lam)
            e = []
            for j, v in enumerate(val):
                pts, yv = self._validation_points(v)
                Kv = m._point_gram(pts, sub.points, sigma)
                Kv *= cand["tau"] + (1.0 - cand["tau"]) * kp_va[j][local]
                e.append(self._error(Kv @ coef, yv))
            errs[li] = np.mean(e)
        return errs

    def _paper_fold(self, sigma, train, val, gamma, extra, lams) -> NDArray[np.float64]:
        m = self.m
        emb_tr, emb_va = extra
        n_tr = train.size
        F = 2 * m.joint_frequencies_.shape[0]
        A = np.zeros((1, F, F))
        B = np.zeros((1, F, self.Y.shape[1]))
        for j, t in enumerate(train):
            lo, hi = int(self.tasks.offsets[t]), int(self.tasks.offsets[t + 1])
            for c0 in range(lo, hi, _CHUNK_POINTS):
                c1 = min(hi, c0 + _CHUNK_POINTS)
                u = m._paper_inputs(self.tasks.points[c0:c1], emb_tr.features[j], gamma, sigma)
                Z = m._paper_features(u)
                A[0] += Z.T @ Z / ((hi - lo) * n_tr)
                B[0] += Z.T @ self.Y[c0:c1] / ((hi - lo) * n_tr)
        thetas = structured_ridge_path(np.ones((1, 1)), A, B, lams)
        feats = []
        for j, v in enumerate(val):
            pts, yv = self._validation_points(v)
            u = m._paper_inputs(pts, emb_va.features[j], gamma, sigma)
            feats.append((m._paper_features(u), yv))
        return np.array(
            [np.mean([self._error(Z @ theta[0], yv) for Z, yv in feats]) for theta in thetas]
        )
