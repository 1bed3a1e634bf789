"""Which cells moved a marginal-transfer answer: per-cell explanations (issue 45).

A per-cell model labels every cell of a sample; what it says of the sample as a whole
is the share of its cells in each population (a classifier) or the mean of its cells'
values (a regressor). A cell moves that answer in two ways.

* **Its own answer.** A classifier's cell counts ``1/n`` towards the share of the
  population it is labelled with; a regressor's cell adds its value over ``n``. These
  assignments sum exactly to the answer (baseline 0).
* **Through the sample's context** (the ``"kernel"`` cell model only). Its scores read
  the sample through the task embedding ``μ_P``, the mean of the random features
  ``z`` over ``m`` of its cells (at most ``embedding_points``, a seeded draw,
  :meth:`.task_map.TaskMap.embed`), and the Nyström features ``ψ(μ_P)``: each of those
  cells moves every cell's score. Its contribution is the first-order change of the
  answer ``F`` when its share of the embedding grows, ``(1/m) ∇_μ F · (z(x) - μ_P)``;
  these sum to exactly zero over the ``m`` cells, so the sum above still holds, and
  removing cells ``S`` from the embedding moves ``F`` by about
  ``-(m / (m - |S|)) Σ_S c_x``. A share counted by labels moves only where a label
  flips (its derivative is zero almost everywhere), so for a classifier ``F`` is the
  model's expected share, the mean over cells of ``(s_k + 1) / 2`` (the scores' ±1
  coding read as the least-squares estimate of the class probability); for a
  regressor ``F`` is the answer itself, and the derivative is exact.

The ``"linear"`` (LDA, ridge) and ``"trees"`` cell models read each cell on its own:
their explanation is the assignment alone, and says so (no context part is invented).
The calibration is held where it is: a sample calibrated by its own statistics
(``"standardise"``, ``"landmarks"``) is moved by each of its cells through that too,
which the explanation does not include.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ...explanations.result import Explanation
from .cell_models import cell_scores, kernel_coef_blocks, kernel_task_coef
from .task_map import TaskMap

__all__ = ["context_gradient", "explain_task"]


def context_gradient(
    task_map: TaskMap,
    cell_model: dict[str, Any],
    mean_features: NDArray[np.float64],
    embedding: NDArray[np.float64],
    scale: float,
) -> NDArray[np.float64]:
    """``∇_μ F`` of ``F = scale · (mean over cells of the scores)`` at the task
    embedding ``μ = embedding`` (D,), for the kernel cell model: (D, outputs).

    ``mean_features`` is the mean of the sample's cell features ``φ`` (the scores are
    ``φ · Σ_j c_j coef_j`` with ``c = [√τ, √(1-τ) ψ]``), ``ψ_r(μ) = Σ_t e_t B_tr``,
    ``e_t = exp(-γ ‖μ - μ_t‖²)`` over the training tasks ``t``.
    """
    r = task_map.basis.shape[1]
    blocks = kernel_coef_blocks(cell_model, r)
    tau = float(cell_model["tau"])
    # ∂F/∂ψ_r (r, K), then onto the training tasks through the Nyström basis.
    slope = scale * np.sqrt(1.0 - tau) * np.einsum("f,rfk->rk", mean_features, blocks[1:])
    e = np.exp(-task_map.gamma * task_map.sq_distances(embedding[None, :])[0])
    w = e[:, None] * (task_map.basis @ slope)  # (T, K)
    # ∂e_t/∂μ = -2γ e_t (μ - μ_t)
    towards = embedding[:, None] * w.sum(axis=0)[None, :] - task_map.train_embeddings.T @ w
    return -2.0 * task_map.gamma * towards


def explain_task(
    cells: NDArray[np.float64],
    calibrated: NDArray[np.float64],
    task_map: TaskMap,
    cell_model: dict[str, Any],
    codes_of: Callable[[NDArray[np.float64]], NDArray[np.int64]] | None,
    outputs: list[Any] | None,
    markers: list[Any] | None,
) -> Explanation:
    """The :class:`~core.explanations.Explanation` of one sample's answer.

    Parameters
    ----------
    cells : ndarray of shape (n, d)
        The sample as the model took it (shown in the summaries).
    calibrated : ndarray of shape (n, d)
        The same cells in the cell model's space (after the calibration).
    task_map : TaskMap
    cell_model : dict
        The fitted cell model's arrays (:func:`.cell_models.fit_cell_model`).
    codes_of : callable or None
        A classifier's rule from scores to class codes (its reject rule included);
        None for a regressor.
    outputs : list or None
        The classes; None for a regressor (``"prediction"``, or each output's index).
    markers : list or None
        The columns' names (default ``x0``, ``x1``, ...).

    Returns
    -------
    Explanation
        ``method="assignment"``: ``prediction`` the share of cells labelled with each
        class (a regressor: the mean value), ``baseline`` 0, and
        ``contributions.sum(axis=0) == prediction`` to rounding; a classifier's
        ``labels`` are its cells' (the populations :meth:`~Explanation.to_dict`
        summarises by).
    """
    n, d = calibrated.shape
    names = [f"x{j}" for j in range(d)] if markers is None else [str(m) for m in markers]
    if len(names) != d:
        raise ValueError(f"got {len(names)} marker name(s) for {d} column(s)")
    outputs = None if outputs is None else [str(c) for c in outputs]
    # The embedding as TaskMap.embed takes it, its cells' features kept for the context.
    rows = task_map.embedding_rows(calibrated)
    z = task_map.random_features(calibrated[rows])
    embedding = np.array([z.mean(axis=0)])
    psi = task_map.context(embedding)[0]
    kernel = cell_model["kind"] == "kernel"
    classifier = codes_of is not None
    if kernel:  # the features are kept for the context's gradient
        phi = task_map.cell_features(calibrated)
        scores = phi @ kernel_task_coef(cell_model, psi)
    else:
        scores = cell_scores(cell_model, calibrated, task_map, psi, classifier)
    codes = None
    if codes_of is not None and outputs is not None:
        codes = codes_of(scores)
        contributions = np.zeros((n, len(outputs)))
        contributions[np.arange(n), codes] = 1.0 / n
        prediction = np.bincount(codes, minlength=len(outputs)) / n
    else:
        k = scores.shape[1]
        outputs = ["prediction"] if k == 1 else [str(j) for j in range(k)]
        contributions = scores / n
        prediction = scores.mean(axis=0)
    if kernel:
        gradient = context_gradient(
            task_map, cell_model, phi.mean(axis=0), embedding[0], 0.5 if classifier else 1.0
        )
        contributions[rows] += (z - embedding[0]) @ gradient / rows.size
    return Explanation(
        method="assignment",
        outputs=outputs,
        prediction=prediction,
        baseline=np.zeros(prediction.size),
        contributions=contributions,
        points=cells,
        markers=names,
        labels=None if codes is None else np.asarray(outputs)[codes],
    )
