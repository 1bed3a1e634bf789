"""The cell models: what labels (or values) a calibrated cell, given its task.

Simplest first (the one-standard-error rule's order, :data:`CELL_MODELS`):

* ``"linear"``: classifiers, a pooled linear discriminant (scikit-learn's LDA); the
  issue-44 cohort's strongest row is calibration then exactly this. Regressors, a
  ridge on the standardised cells with every task weighted equally (paper 004 eq. 7,
  weights ``∝ 1 / n_i``) and its ridge by generalised cross-validation
  (scikit-learn's ``RidgeCV``).
* ``"kernel"``: marginal transfer proper (paper 004 eq. 8): the product kernel
  ``k_X(x, x') (τ + (1 - τ) k_P(P, P'))`` with ``k_X`` a Gaussian (random Fourier
  features) plus a linear part, ``k_P`` the task kernel of :mod:`.task_map` through
  its Nyström map; a weighted ridge on one-vs-rest ±1 codes. With ``ψ`` constant
  within a task, the normal equations are a sum of Kronecker products per task
  (``(c cᵀ) ⊗ (Φᵀ Φ)``, ``c = [√τ, √(1-τ) ψ]``), so a fit costs one pass over the cells.
* ``"trees"`` (classifiers): scikit-learn's histogram gradient boosting, kept as
  arrays (:mod:`.trees`; at most ``TREE_POINTS`` cells of each sample); axis-aligned
  splits, as gates are drawn.

Every model scores classes in the ±1 coding, one column per class (``2 p - 1`` for
the probabilistic ones), and is stored as plain arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ...bags import Bags
from .task_map import TaskMap
from .trees import fit_task_trees, tree_scores

__all__ = [
    "CELL_MODELS",
    "cell_scores",
    "fit_cell_model",
    "kernel_coef_blocks",
    "kernel_task_coef",
    "linear_scores",
]

#: Every cell model, simplest first.
CELL_MODELS = ("linear", "kernel", "trees")
#: Ridge of the kernel model, relative to the mean diagonal of its normal equations.
RIDGE = 1e-3
#: The ridges the linear regressor chooses among (by generalised cross-validation).
LINEAR_RIDGES = tuple(np.logspace(-4, 2, 13))
#: Share of pooling of the kernel model (paper 004's ``τ``): the pooled part answers
#: a task unlike every training task, the task part refines the others.
TAU = 0.5


def linear_scores(
    coef: NDArray[np.float64], intercept: NDArray[np.float64], x: NDArray[np.float64]
) -> NDArray[np.float64]:
    """``x coefᵀ + intercept``: (n, rows of ``coef``)."""
    return x @ coef.T + intercept


def _lda_scores(state: dict[str, Any], x: NDArray[np.float64]) -> NDArray[np.float64]:
    raw = linear_scores(state["coef"], state["intercept"], x)
    if raw.shape[1] == 1:
        p1 = 1.0 / (1.0 + np.exp(-np.clip(raw[:, 0], -500, 500)))
        prob = np.column_stack([1.0 - p1, p1])
    else:
        raw = raw - raw.max(axis=1, keepdims=True)
        prob = np.exp(raw)
        prob /= prob.sum(axis=1, keepdims=True)
    return 2.0 * prob - 1.0


def _solve(A: NDArray[np.float64], B: NDArray[np.float64]) -> NDArray[np.float64]:
    lam = RIDGE * float(np.trace(A)) / A.shape[0]
    return np.linalg.solve(A + lam * np.eye(A.shape[0]), B)


def _context(tau: float, psi: NDArray[np.float64]) -> NDArray[np.float64]:
    """``c = [√τ, √(1-τ) ψ]`` of each task (tasks x (1 + r))."""
    return np.hstack([np.full((psi.shape[0], 1), np.sqrt(tau)), np.sqrt(1.0 - tau) * psi])


def _fit_kernel(
    tasks: list[NDArray[np.float64]], Y: NDArray[np.float64], task_map: TaskMap
) -> dict[str, Any]:
    # The training tasks' embeddings are the task map's own.
    context = _context(TAU, task_map.context(task_map.train_embeddings))
    c, f = context.shape[1], task_map.cell_features(tasks[0][:1]).shape[1]
    A = np.zeros((c * f, c * f))
    B = np.zeros((c * f, Y.shape[1]))
    lo = 0
    for t, x in enumerate(tasks):
        phi = task_map.cell_features(x)
        w = 1.0 / (len(tasks) * x.shape[0])
        ct = context[t]
        A += w * np.kron(np.outer(ct, ct), phi.T @ phi)
        B += w * np.kron(ct[:, None], phi.T @ Y[lo : lo + x.shape[0]])
        lo += x.shape[0]
    return {"kind": "kernel", "tau": TAU, "coef": _solve(A, B)}


def kernel_coef_blocks(state: dict[str, Any], n_context: int) -> NDArray[np.float64]:
    """The kernel model's coefficients as one block per context entry, ``(1 + r,
    features, outputs)`` for ``r = n_context`` Nyström features: block 0 goes with
    ``√τ``, block ``1 + j`` with ``√(1-τ) ψ_j``."""
    coef = np.asarray(state["coef"])
    return coef.reshape(1 + n_context, -1, coef.shape[1])


def kernel_task_coef(state: dict[str, Any], psi: NDArray[np.float64]) -> NDArray[np.float64]:
    """``Σ_j c_j coef_j`` for one task of Nyström features ``psi`` (r,): the linear map
    from a cell's features to its scores in that task, (features, outputs)."""
    c = _context(float(state["tau"]), np.atleast_2d(psi))
    return np.tensordot(c[0], kernel_coef_blocks(state, c.shape[1] - 1), axes=1)


def _kernel_scores(
    state: dict[str, Any], x: NDArray[np.float64], task_map: TaskMap, psi: NDArray[np.float64]
) -> NDArray[np.float64]:
    """Scores of cells ``x`` whose tasks' Nyström features are ``psi``: one row (all
    cells of one task) or one row per cell."""
    rows = np.atleast_2d(psi)
    phi = task_map.cell_features(x)
    if rows.shape[0] == 1:
        return phi @ kernel_task_coef(state, rows[0])
    c = _context(float(state["tau"]), rows)
    per = kernel_coef_blocks(state, c.shape[1] - 1)
    # Per cell: Σ_j c_j (φ(x) coef_j), all j at once.
    each = np.einsum("nf,jfk->njk", phi, per)
    return np.einsum("nj,njk->nk", c, each)


def fit_cell_model(
    kind: str,
    tasks: list[NDArray[np.float64]],
    Y: NDArray[np.float64],
    task_map: TaskMap,
    classifier: bool,
    seed: int,
) -> dict[str, Any]:
    """Cell model ``kind`` fitted on calibrated ``tasks`` (cells x markers each, the
    tasks ``task_map`` was fitted on) and their cells' targets ``Y`` (concatenated:
    ±1 codes, one column per class, for a classifier; values otherwise), as a dict
    of arrays."""
    if kind == "kernel":
        return _fit_kernel(tasks, Y, task_map)
    if kind == "trees" and classifier:
        return {"kind": "trees", "trees": fit_task_trees(Bags.from_arrays(tasks), Y, seed)}
    pooled = np.vstack(tasks)
    if kind != "linear":
        raise ValueError(f"cell_model must be one of {CELL_MODELS}, got {kind!r}")
    if classifier:
        from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

        codes = np.argmax(Y, axis=1)
        present = np.unique(codes)
        k = Y.shape[1]
        if k == 2 and present.size == 2:
            lda = LinearDiscriminantAnalysis().fit(pooled, codes)
            coef, intercept = np.asarray(lda.coef_), np.asarray(lda.intercept_)
        else:
            # One row per class; a class a fit lacks (a fold without it) scores -inf.
            coef = np.zeros((k, pooled.shape[1]))
            intercept = np.full(k, -np.inf)
            intercept[present] = 0.0
            if present.size >= 2:
                lda = LinearDiscriminantAnalysis().fit(pooled, codes)
                rows = present if present.size > 2 else present[1:]
                coef[rows], intercept[rows] = lda.coef_, lda.intercept_
        return {"kind": "linear", "coef": coef, "intercept": intercept}
    from sklearn.linear_model import RidgeCV

    # Every task weighs the same (eq. 7), weights of mean 1 so the ridges keep their
    # usual scale; the ridge by generalised cross-validation, as RidgeCV's default.
    sizes = np.array([x.shape[0] for x in tasks], dtype=np.float64)
    w = np.repeat(sizes.sum() / (sizes.size * sizes), sizes.astype(int))
    fit = RidgeCV(alphas=LINEAR_RIDGES).fit(task_map.standardise(pooled), Y, sample_weight=w)
    # Back to the cells' own units: scores = x coefᵀ + intercept.
    slope = np.atleast_2d(fit.coef_) / task_map.scale
    intercept = np.atleast_1d(fit.intercept_) - slope @ task_map.center
    return {"kind": "linear", "coef": slope, "intercept": intercept, "alpha": float(fit.alpha_)}


def cell_scores(
    state: dict[str, Any],
    x: NDArray[np.float64],
    task_map: TaskMap,
    psi: NDArray[np.float64],
    classifier: bool,
) -> NDArray[np.float64]:
    """Scores of calibrated cells ``x`` (n, d); ``psi``: their task's Nyström features
    (:meth:`TaskMap.context`), one row for cells of one task or one row per cell.
    Classifiers: (n, classes), ±1 coding."""
    kind = state["kind"]
    if kind == "kernel":
        return _kernel_scores(state, x, task_map, psi)
    if kind == "trees":
        return tree_scores(state["trees"], x)
    if classifier:
        return _lda_scores(state, x)
    return linear_scores(state["coef"], state["intercept"], x)
