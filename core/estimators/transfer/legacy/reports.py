"""What a loaded model of the design before issue 44 reports of each new task besides
its labels: how far the task lies from the training tasks, and whether it was out of
range, answered by the fallback, relabelled or calibrated
(:class:`~core.estimators.transfer.TaskReport`, one per task, and the
:class:`~core.domain.DomainReport` of them all).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from numpy.typing import NDArray

from ....domain import DomainReport
from ..reports import TaskReport
from ..reports import domain_report as domain_report_of

__all__ = ["domain_report", "task_reports"]


def task_reports(
    similarity: NDArray[np.float64],
    sq_new: NDArray[np.float64],
    range_threshold: float,
    has_fallback: bool,
) -> list[TaskReport]:
    """Each new task's report from ``k_P`` (``similarity``) and squared embedding
    distances ``sq_new`` to the training tasks: its three nearest, and out of range
    beyond ``range_threshold`` (then answered by the fallback where there is one)."""
    dist = np.sqrt(np.maximum(sq_new, 0.0))
    out = []
    for row_k, row_d in zip(similarity, dist, strict=True):
        order = np.argsort(row_d, kind="stable")[:3]
        far = bool(row_d[order[0]] > range_threshold)
        out.append(
            TaskReport(
                nearest_tasks=order,
                similarities=row_k[order],
                distance=float(row_d[order[0]]),
                out_of_range=far,
                fallback=far and has_fallback,
            )
        )
    return out


def domain_report(
    reports: list[TaskReport], task_sq_distances: NDArray[np.float64]
) -> DomainReport:
    """The :class:`~core.domain.DomainReport` of tasks from their reports: the distance
    to the nearest training task in units of the median such distance among the
    training tasks (each to its nearest other one, from their squared distances
    ``task_sq_distances``), and the reports' flags."""
    sq = np.asarray(task_sq_distances, dtype=np.float64)
    if sq.shape[0] > 1:
        d = np.sqrt(np.maximum(sq, 0.0) + np.diag(np.full(sq.shape[0], np.inf)))
        scale = float(np.median(d.min(axis=1))) or 1.0
    else:
        scale = 1.0
    # The fields of the current design's report, and this design's own three.
    return replace(
        domain_report_of(reports, scale),
        fallback=np.array([r.fallback for r in reports], dtype=bool),
        disagreement=np.array(
            [np.nan if r.disagreement is None else r.disagreement for r in reports]
        ),
        relabelled=np.array([np.nan if r.relabelled is None else r.relabelled for r in reports]),
    )
