"""Decoded bags against the model: panel, compensation, sizes, values, weights.

Runs in the worker that decoded the bags (:mod:`.worker`), with the model's own
description (:class:`~.registry.ModelEntry`): every problem is collected and answered
together (422), so a lab fixes a request once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from bagserve.core.bags import Bags
from bagserve.core.io import DataError, Sample
from bagserve.core.results import CellPrediction, ModelKind

from .codecs import IncomingBag, RequestLimits
from .errors import Problem
from .options import PredictOptions

if TYPE_CHECKING:
    from .registry import ModelEntry

__all__ = ["plot_samples", "validate_bags"]


def validate_bags(
    bags: list[IncomingBag],
    entry: ModelEntry,
    limits: RequestLimits,
    errors: list[str],
    options: PredictOptions,
) -> tuple[list[np.ndarray], list[np.ndarray | None], list[str]]:
    """Compensate and align every bag to the model's panel; collect every problem
    before answering.

    Returns the bags' points and weights, and *notes*: routine facts about the request
    (channels the model does not use, compensation applied) that a reviewer may read
    but need not act on. What should change a reviewer's decision (out of the domain,
    clipped cells) is a warning, raised where the prediction is known.
    """
    errors = list(errors)
    notes: list[str] = []
    panel = entry.panel
    compensation = entry.info.preprocessing.compensation
    compensate = compensation.active and not options.compensated
    if len(bags) > limits.max_bags:
        errors.append(f"{len(bags)} bags, more than the limit of {limits.max_bags}")
    ids = [b.id for b in bags]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        errors.append(f"bag ids must be unique, repeated: {dup}")
    arrays, weights = [], []
    total = 0
    for b in bags:
        where = f"bag {b.id!r}"
        n = b.points.shape[0]
        total += n
        if n == 0:
            errors.append(f"{where} is empty (0 points)")
            continue
        if b.points.shape[1] > limits.max_columns:
            errors.append(
                f"{where} has {b.points.shape[1]} columns, more than the limit of "
                f"{limits.max_columns}"
            )
            continue
        if n > limits.max_points_per_bag:
            errors.append(
                f"{where} has {n} points, more than the limit of {limits.max_points_per_bag}"
            )
        if entry.kind is ModelKind.CELL and n < 2:
            errors.append(f"{where} has a single cell: its distribution cannot be estimated")
        pts = b.points
        if compensate:
            if b.names is None:
                errors.append(
                    f"{where}: the model compensates ({compensation.describe()}), which needs "
                    "the channel names: send them (markers), or declare the cells compensated "
                    "already (compensated=true)"
                )
                continue
            try:
                pts = compensation.apply(
                    Sample(pts, b.names, b.alt_names or b.names, where, b.spillover)
                ).points
            except DataError as exc:
                errors.append(f"{exc} (cells compensated already: compensated=true)")
                continue
            notes.append(f"{where}: compensated ({compensation.describe()})")
        if b.names is not None and panel is not None:
            try:
                cols = panel.columns(b.names, b.alt_names, source=where)
            except DataError as exc:
                errors.append(str(exc))
                continue
            used = set(cols.tolist())
            extra = [name for j, name in enumerate(b.names) if j not in used]
            if extra:
                notes.append(f"{where}: channels the model does not use: {extra}")
            if not np.array_equal(cols, np.arange(pts.shape[1])):
                pts = pts[:, cols]
        elif pts.shape[1] != entry.n_features:
            expected = f" {list(panel.markers)}" if panel is not None else ""
            errors.append(
                f"{where} has {pts.shape[1]} column(s), the model takes "
                f"{entry.n_features}{expected}"
            )
            continue
        # A second pass over 10^6 values costs about 0.5 ms: skipped when done already.
        if not b.finite and not np.isfinite(pts).all():
            bad = ~np.isfinite(pts)
            row, col = np.argwhere(bad)[0]
            errors.append(
                f"{where}: {int(bad.sum())} non-finite value(s) (NaN/Inf), first at row {row}, "
                f"column {col}"
            )
            continue
        problem = _weights_problem(b.weights, n, where)
        if problem is not None:
            errors.append(problem)
            continue
        arrays.append(np.ascontiguousarray(pts, dtype=np.float64))
        weights.append(b.weights)
    if total > limits.max_total_points:
        errors.append(f"{total} points in all, more than the limit of {limits.max_total_points}")
    if errors:
        raise Problem(
            422, f"{len(errors)} problem(s) in the request", errors=errors, slug="invalid-bags"
        )
    return arrays, weights, notes


def _weights_problem(w: np.ndarray | None, n: int, where: str) -> str | None:
    """What is wrong with a bag's weights (one per point, finite, non-negative, a
    positive sum), or None."""
    if w is None:
        return None
    if w.shape != (n,):
        return f"{where}: {w.size} weight(s) for {n} point(s)"
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        return f"{where}: weights must be finite, non-negative, with a positive sum"
    return None


def plot_samples(
    entry: ModelEntry, arrays: list[np.ndarray], result: CellPrediction, n: int
) -> list[dict[str, Any]]:
    """Up to ``n`` cells of each bag (a seeded draw, in cell order), transformed and
    scaled as the model sees them, with their labels: what a scatter plot needs."""
    pre = entry.info.preprocessing
    markers = list(entry.info.markers)
    rng = np.random.default_rng(0)
    out = []
    for i, points in enumerate(arrays):
        rows = np.arange(points.shape[0])
        if rows.size > n:
            rows = np.sort(rng.choice(rows.size, n, replace=False))
        cells = pre.scale_points(pre.transform_points(points[rows], markers))
        out.append(
            {
                "markers": markers,
                "cells": rows.tolist(),
                "points": np.round(cells, 5).tolist(),
                "labels": result.labels_of(i)[rows].tolist(),
            }
        )
    return out


def split_control(
    bags: list[IncomingBag],
    points: list[np.ndarray],
    weights: list[np.ndarray | None],
    options: PredictOptions,
) -> tuple[list[IncomingBag], list[np.ndarray], list[np.ndarray | None], Bags, str]:
    """The bag ``?control=`` names taken out of the request: the other bags (their
    points and weights), the control as one bag (aligned like them; the runtime
    preprocesses it with them), and a note naming it with its sha256.

    Raises
    ------
    Problem
        422: no bag has that id, or it is the only bag (nothing left to answer).
    """
    ids = [b.id for b in bags]
    if options.control not in ids:
        shown = ", ".join(repr(i) for i in ids[:5]) + (" ..." if len(ids) > 5 else "")
        detail = f"control {options.control!r} names no bag of the request (its bags: {shown})"
        raise Problem(422, detail, errors=[detail], slug="invalid-bags")
    k = ids.index(options.control)
    if len(bags) == 1:
        detail = (
            f"bag {options.control!r} is the batch's control: the request has no other bag "
            "to answer"
        )
        raise Problem(422, detail, errors=[detail], slug="invalid-bags")
    control = Bags.from_arrays([points[k]])
    note = (
        f"bag {options.control!r} is this batch's reference control (sha256 "
        f"{bags[k].input_sha256}): every other bag was mapped by it onto the training "
        "batch, and it has no answer of its own"
    )
    keep = [i for i in range(len(bags)) if i != k]
    return (
        [bags[i] for i in keep],
        [points[i] for i in keep],
        [weights[i] for i in keep],
        control,
        note,
    )
