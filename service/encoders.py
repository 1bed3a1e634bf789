"""Typed predictions out: the native API's JSON, CSV and NPY answers.

One function per answer format, each taking the runtime's typed result
(:mod:`bagserve.core.runtime`) and the ids and provenance of the request. The shape of
each answer follows the kind of the result, never the estimator's class.
"""

from __future__ import annotations

import csv
import io
from typing import Any

import numpy as np
import orjson
from bagserve.core.runtime import (
    CellPrediction,
    ClassificationPrediction,
    ConditionalPrediction,
    Prediction,
)

from .codecs import JSON, NPY, media_type, npy_bytes
from .errors import Problem

__all__ = ["CSV_OUT", "FORMATS", "encode", "encode_document", "negotiate"]

CSV_OUT = "text/csv"
#: What predict can answer, in the order offered.
FORMATS = (JSON, CSV_OUT, NPY)


def negotiate(accept: str | None) -> str:
    """The answer's media type for an ``Accept`` header, or 406."""
    accept = accept or "*/*"
    for part in accept.split(","):
        t = media_type(part)
        if t in (JSON, "*/*", "application/*", ""):
            return JSON
        if t in (CSV_OUT, "text/*"):
            return CSV_OUT
        if t == NPY:
            return NPY
    raise Problem(406, f"cannot answer {accept!r}; available: {', '.join(FORMATS)}")


def encode(result: Prediction, ids: list[str], fmt: str, meta: dict[str, Any]) -> bytes:
    """The answer in ``fmt`` (one of :data:`FORMATS`); ``meta`` heads a JSON answer."""
    if fmt == NPY:
        return npy_bytes(np.asarray(_table(result)))
    if fmt == CSV_OUT:
        return _csv(result, ids)
    return orjson.dumps(encode_document(result, ids, meta))


def encode_document(result: Prediction, ids: list[str], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer as a document: ``meta`` and one entry per bag under
    ``predictions`` (stored as such for jobs)."""
    return {**meta, "predictions": [_bag(result, i, bag_id) for i, bag_id in enumerate(ids)]}


def _bag(result: Prediction, i: int, bag_id: str) -> dict[str, Any]:
    if isinstance(result, CellPrediction):
        domain = result.domain
        assert domain is not None
        return {
            "id": bag_id,
            "n_points": int(result.sizes[i]),
            "labels": result.labels_of(i).tolist(),
            "report": {
                "out_of_range": bool(domain.out_of_range[i]),
                "distance_to_nearest": float(domain.distance[i]),
                "nearest_training_tasks": domain.nearest_of(i),
                "similarities": domain.similarities_of(i),
            },
        }
    if isinstance(result, ClassificationPrediction):
        classes = [str(c) for c in result.classes.tolist()]
        return {
            "id": bag_id,
            "prediction": result.labels[i].item(),
            "scores": dict(zip(classes, result.scores[i].tolist(), strict=True)),
        }
    out: dict[str, Any] = {"id": bag_id, "prediction": result.estimate[i].tolist()}
    if isinstance(result, ConditionalPrediction):
        if result.levels.size:
            out["quantiles"] = dict(
                zip(_names(result.levels), result.quantiles[i].tolist(), strict=True)
            )
        if result.thresholds.size:
            out["exceedance"] = dict(
                zip(_names(result.thresholds), result.exceedance[i].tolist(), strict=True)
            )
    return out


def _names(values: np.ndarray) -> list[str]:
    return [f"{v:g}" for v in values.tolist()]


def _table(result: Prediction) -> np.ndarray:
    """The NPY answer: the estimate; for conditional models the mean, then the
    quantiles, then the exceedance probabilities, as columns."""
    if isinstance(result, ConditionalPrediction):
        extra = np.hstack([result.quantiles, result.exceedance])
        return np.column_stack([result.mean, extra]) if extra.shape[1] else result.mean
    return result.estimate


def _csv(result: Prediction, ids: list[str]) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if isinstance(result, CellPrediction):
        w.writerow(["id", "cell", "label"])
        for i, bag_id in enumerate(ids):
            for j, label in enumerate(result.labels_of(i).tolist()):
                w.writerow([bag_id, j, label])
    elif isinstance(result, ClassificationPrediction):
        w.writerow(["id", "prediction", *[f"score_{c}" for c in result.classes.tolist()]])
        for i, bag_id in enumerate(ids):
            w.writerow([bag_id, result.labels[i], *result.scores[i].tolist()])
    elif isinstance(result, ConditionalPrediction):
        w.writerow(
            [
                "id",
                "prediction",
                *[f"q_{v}" for v in _names(result.levels)],
                *[f"p_gt_{t}" for t in _names(result.thresholds)],
            ]
        )
        for i, bag_id in enumerate(ids):
            w.writerow(
                [
                    bag_id,
                    result.mean[i].item(),
                    *result.quantiles[i].tolist(),
                    *result.exceedance[i].tolist(),
                ]
            )
    else:
        values = result.estimate
        multi = values.ndim == 2
        columns = [f"prediction_{j}" for j in range(values.shape[1])] if multi else ["prediction"]
        w.writerow(["id", *columns])
        for i, bag_id in enumerate(ids):
            w.writerow([bag_id, *(values[i].tolist() if multi else [values[i].item()])])
    return buf.getvalue().encode()
