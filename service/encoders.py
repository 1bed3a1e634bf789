"""Typed predictions out: the native API's JSON, CSV, NPY and FHIR answers.

One builder per answer format, each taking the runtime's typed result
(:mod:`bagserve.core.results`) and the ids and provenance of the request, bundled once
as an :class:`Answer` (:meth:`.prediction.Outcome.answer`). The shape of each answer
follows the kind of the result (a dispatch on its type), never the estimator's class.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson
from bagserve.core.artifact_info import ArtifactInfo
from bagserve.core.results import (
    CellPrediction,
    ClassificationPrediction,
    ConditionalPrediction,
    ModelKind,
    Prediction,
)

from .codecs import FCS, JSON, NPY, media_type, npy_bytes
from .errors import Problem
from .fhir import FHIR_JSON, bundle
from .hl7 import HL7_V2, Parties, oru_r01
from .options import PredictOptions
from .tables import TableLayout, csv_bytes, level_names

__all__ = [
    "CSV_OUT",
    "FHIR_JSON",
    "FORMATS",
    "Answer",
    "encode",
    "encode_document",
    "encode_off_loop",
    "negotiate",
    "server_timing",
]

CSV_OUT = "text/csv"
#: What predict can answer, in the order offered (FCS: one bag's cells with their
#: contributions, with ``?explain=true``; :func:`.explanations.explained_fcs`).
FORMATS = (JSON, CSV_OUT, NPY, FHIR_JSON, HL7_V2, FCS)
#: Answers of per-cell models for more cells than this are encoded in a thread: a
#: label per cell of 10^6 cells takes a CSV writer seconds, which the event loop must
#: not wait for; smaller answers are encoded at once (a thread hop costs more).
ENCODE_INLINE_CELLS = 20_000
#: The stages of a prediction, in the order ``Server-Timing`` lists them ("audit": the
#: group commit of its audit record, before the answer is encoded and released).
STAGES = ("read", "parse", "validate", "queue", "transfer", "compute", "audit", "encode")

T = TypeVar("T")


async def encode_off_loop(result: Prediction, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``: in a worker thread when ``result`` is a large per-cell
    answer (the event loop keeps answering meanwhile), else at once."""
    if result.kind is ModelKind.CELL and int(result.sizes.sum()) > ENCODE_INLINE_CELLS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def server_timing(timings: dict[str, float]) -> str:
    """Where the time of a prediction went, as a W3C ``Server-Timing`` header value."""
    return ", ".join(
        f"{stage};dur={1000 * timings[stage]:.1f}" for stage in STAGES if stage in timings
    )


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
        # application/json+fhir is the media type of FHIR before R3; still sent by some.
        if t in (FHIR_JSON, "application/json+fhir"):
            return FHIR_JSON
        if t in (HL7_V2, "x-application/hl7-v2+er7"):
            return HL7_V2
        if t == FCS:
            return FCS
    raise Problem(406, f"cannot answer {accept!r}; available: {', '.join(FORMATS)}")


@dataclass(frozen=True)
class Answer:
    """A finished prediction as every output format takes it: the one bundle of what
    the request sent and the model answered (:meth:`.prediction.Outcome.answer`).

    Attributes
    ----------
    result : Prediction
        The runtime's typed answer.
    ids : list of str
        Bag ids, in request order.
    meta : dict
        The provenance that heads the answer (:meth:`.prediction.Outcome.provenance`).
    info : ArtifactInfo
        The model's: the training bags of the domain report and the out-of-domain
        policy whose status each bag carries.
    inputs : list of str, optional
        Per bag, the sha256 of its input (its file, or its cells).
    acquired : list of str or None, optional
        Per bag, when its instrument acquired it.
    plots : list of dict, optional
        Per bag, cells for a scatter plot (``?plot=N``); JSON only.
    explanations : list of dict, optional
        Per bag, its explanation (``?explain=true``): in JSON whole, in FHIR and HL7 as
        one line of text (:func:`.explanations.summary_text`), not in CSV or NPY.
    """

    result: Prediction
    ids: list[str]
    meta: dict[str, Any]
    info: ArtifactInfo
    inputs: list[str] | None = None
    acquired: list[str | None] | None = None
    plots: list[dict[str, Any]] | None = None
    explanations: list[dict[str, Any]] | None = None

    def document(self, *, cells: bool = True) -> dict[str, Any]:
        """The JSON answer as a document (:func:`encode_document`)."""
        return encode_document(
            self.result,
            self.ids,
            self.meta,
            self.info,
            inputs=self.inputs,
            cells=cells,
            plots=self.plots,
            explanations=self.explanations,
        )

    def fhir(
        self,
        *,
        coverage: float | None = None,
        refs: dict[str, Any] | None = None,
        performer: str | None = None,
        timezone: str | None = None,
    ) -> dict[str, Any]:
        """The FHIR R4 Bundle (:func:`.fhir.bundle`)."""
        return bundle(
            self.result,
            self.ids,
            self.meta,
            self.info,
            inputs=self.inputs,
            coverage=coverage,
            refs=refs,
            acquired=self.acquired,
            performer=performer,
            timezone=timezone,
            explanations=self.explanations,
        )

    def hl7(
        self,
        *,
        coverage: float | None = None,
        refs: dict[str, Any] | None = None,
        parties: Parties | None = None,
        control_id: str | None = None,
    ) -> str:
        """The HL7 v2.5.1 ORU^R01 message (:func:`.hl7.oru_r01`)."""
        return oru_r01(
            self.result,
            self.ids,
            self.meta,
            self.info,
            inputs=self.inputs,
            coverage=coverage,
            refs=refs,
            acquired=self.acquired,
            parties=parties,
            control_id=control_id,
            explanations=self.explanations,
        )


def encode(
    answer: Answer,
    fmt: str,
    options: PredictOptions,
    *,
    refs: dict[str, Any] | None = None,
    performer: str | None = None,
    timezone: str | None = None,
    parties: Parties | None = None,
) -> bytes:
    """The answer in ``fmt`` (one of :data:`FORMATS`); its ``meta`` heads a JSON answer.

    A withheld bag's value, interval and set are left out of every format (NaN in NPY
    tables). ``options``: what the request asked (CSV columns follow from it and the
    model alone, :mod:`.tables`; ``cells=False`` leaves out a per-cell model's label of
    every cell, its population summary stays; ``coverage``: the interval's). Per-cell
    classifiers in NPY: every cell's class probabilities when they were asked for, else
    the population counts per bag with ``cells=False``, else the labels; columns follow
    the model's classes. FHIR (:mod:`.fhir`): ``meta`` is the provenance, ``refs`` the
    subject, specimen and effective time, ``performer`` and ``timezone`` the service's
    settings (:func:`.fhir.bundle`). HL7 (:func:`.hl7.oru_r01`): ``refs`` the patient
    and placer order numbers, ``parties`` MSH-3..6.
    """
    cells, coverage = options.cells, options.coverage
    if fmt == FHIR_JSON:
        return orjson.dumps(
            answer.fhir(coverage=coverage, refs=refs, performer=performer, timezone=timezone)
        )
    if fmt == HL7_V2:
        return answer.hl7(coverage=coverage, refs=refs, parties=parties).encode("utf-8")
    if fmt == NPY:
        return npy_bytes(np.asarray(_table(answer.result, cells)))
    if fmt == CSV_OUT:
        layout = TableLayout.of(answer.info.answer_shape(), options)
        rows = layout.rows(answer.result, answer.ids, answer.info, inputs=answer.inputs)
        return csv_bytes(layout.columns, rows)
    return orjson.dumps(answer.document(cells=cells))


def encode_document(
    result: Prediction,
    ids: list[str],
    meta: dict[str, Any],
    info: ArtifactInfo,
    *,
    inputs: list[str] | None = None,
    cells: bool = True,
    plots: list[dict[str, Any]] | None = None,
    explanations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON answer as a document: ``meta`` and one entry per bag under
    ``predictions`` (stored as such for jobs); ``plots``: per bag, cells for a
    scatter plot (``?plot=N``); ``explanations``: per bag, its ``explanation``
    (``?explain=true``, :mod:`.explanations`). A withheld bag gets neither."""
    answers = []
    for i, bag_id in enumerate(ids):
        answer: dict[str, Any] = {"id": bag_id}
        if inputs is not None:
            answer["input_sha256"] = inputs[i]
        answer["status"] = result.status_of(i)
        if result.released(i):
            answer.update(_bag(result, i, cells, info.markers))
        else:
            answer.update(_withheld(result, i, info))
        answer.update(_trust(result, i, info))
        answers.append(answer)
    for answer, plot, i in zip(answers, plots or [], range(len(ids)), strict=False):
        if result.released(i):
            answer["plot"] = plot
    for answer, explanation, i in zip(answers, explanations or [], range(len(ids)), strict=False):
        if result.released(i):
            answer["explanation"] = explanation
    return {**meta, "predictions": answers}


def _withheld(result: Prediction, i: int, info: ArtifactInfo) -> dict[str, Any]:
    """What a withheld bag's answer holds instead of its value: why."""
    assert result.domain is not None  # only an out-of-range bag is withheld
    return {"withheld": info.withheld_reason(result.domain, i), **_withheld_value(result, i, info)}


@functools.singledispatch
def _withheld_value(result: Prediction, i: int, info: ArtifactInfo) -> dict[str, Any]:
    """A withheld bag-level answer's empty value."""
    return {"prediction": None}


@_withheld_value.register
def _(result: CellPrediction, i: int, info: ArtifactInfo) -> dict[str, Any]:
    # A per-cell model's report stays: it says why the sample was withheld.
    return {"n_points": int(result.sizes[i]), "report": _cell_report(result, i, info.markers)}


def _trust(result: Prediction, i: int, info: ArtifactInfo) -> dict[str, Any]:
    """How far to trust bag ``i``'s answer: its domain report and, where released, its
    interval or set."""
    out: dict[str, Any] = {}
    if result.domain is not None:
        out["domain"] = info.domain_of(result.domain, i)
    if not result.released(i):
        return out
    if result.interval is not None:
        out["interval"] = result.interval[i].tolist()
    members = result.prediction_set(i)
    if members is not None:
        out["set"] = members
    return out


def _cell_report(result: CellPrediction, i: int, markers: Sequence[str] = ()) -> dict[str, Any]:
    domain = result.domain
    assert domain is not None
    return {
        "out_of_range": bool(domain.out_of_range[i]),
        "distance_to_nearest": float(domain.distance[i]),
        "nearest_training_tasks": domain.nearest_of(i),
        "similarities": domain.similarities_of(i),
        # Answered by the invariant fallback (per-sample standardised), out of range.
        "fallback": bool(domain.fallback[i]),
        "disagreement": domain.disagreement_of(i),
        # Labels changed by the mixture fitted to this bag's own cells.
        "relabelled": domain.relabelled_of(i),
        # How the bag was mapped onto the training batch before it was labelled.
        "calibrated": domain.calibrated_of(i),
        "calibration_shift": domain.calibration_shift_of(i),
        **_calibration(domain, i, markers),
        **_suspect(domain, i, markers),
    }


def _suspect(domain: Any, i: int, markers: Sequence[str]) -> dict[str, Any]:
    """The markers of bag ``i`` not measured as the training batch measures them
    (each puts the bag out of range): the channels a lab should look at. Nothing for
    models without the check."""
    if domain.suspect_markers is None:
        return {}
    flags = domain.suspect_markers[i]
    names = list(markers) or [str(j) for j in range(flags.size)]
    return {"suspect_markers": [n for n, f in zip(names, flags, strict=True) if f]}


def _calibration(domain: Any, i: int, markers: Sequence[str]) -> dict[str, Any]:
    """How a per-marker map (the batch's reference control, or the bag's landmarks)
    moved bag ``i`` (nothing for other calibrations): per marker, the median
    displacement of its cells in the training batch's sd, and the markers the map
    made worse; for landmarks, whether those refused the map (the bag then answered
    as measured)."""
    if domain.calibration_moved is None:
        return {}
    moved = domain.calibration_moved[i]
    names = list(markers) or [str(j) for j in range(moved.size)]
    by = "control" if domain.calibration_by is None else str(domain.calibration_by[i])
    refused = {}
    if by == "landmarks" and domain.calibration_refused is not None:
        refused = {"refused": bool(domain.calibration_refused[i])}
    return {
        "calibration": {
            "by": by,
            **refused,
            "moved": {n: round(float(v), 4) for n, v in zip(names, moved, strict=True)},
            "worse": [n for n, w in zip(names, domain.calibration_worse[i], strict=True) if w],
        }
    }


@functools.singledispatch
def _bag(
    result: Prediction, i: int, cells: bool = True, markers: Sequence[str] = ()
) -> dict[str, Any]:
    """Bag ``i``'s released answer (its id, status and trust fields are added apart),
    by the kind of the result: here a regression's value."""
    return {"prediction": result.estimate[i].tolist()}


@_bag.register
def _(
    result: CellPrediction, i: int, cells: bool = True, markers: Sequence[str] = ()
) -> dict[str, Any]:
    cell: dict[str, Any] = {"n_points": int(result.sizes[i])}
    population = result.population(i)
    if population is not None:
        cell["population"] = population
    if cells:
        cell["labels"] = result.labels_of(i).tolist()
    probabilities = result.probabilities_of(i)
    if probabilities is not None:
        assert result.classes is not None
        cell["probabilities"] = {
            "classes": result.classes.tolist(),
            "cells": probabilities.tolist(),
        }
    cell["report"] = _cell_report(result, i, markers)
    return cell


@_bag.register
def _(
    result: ClassificationPrediction, i: int, cells: bool = True, markers: Sequence[str] = ()
) -> dict[str, Any]:
    classes = [str(c) for c in result.classes.tolist()]
    out = {
        "prediction": result.labels[i].item(),
        "scores": dict(zip(classes, result.scores[i].tolist(), strict=True)),
    }
    if result.probabilities is not None:
        out["probabilities"] = dict(zip(classes, result.probabilities[i].tolist(), strict=True))
    return out


@_bag.register
def _(
    result: ConditionalPrediction, i: int, cells: bool = True, markers: Sequence[str] = ()
) -> dict[str, Any]:
    out: dict[str, Any] = {"prediction": result.estimate[i].tolist()}
    if result.levels.size:
        out["quantiles"] = dict(
            zip(level_names(result.levels.tolist()), result.quantiles[i].tolist(), strict=True)
        )
    if result.thresholds.size:
        out["exceedance"] = dict(
            zip(
                level_names(result.thresholds.tolist()),
                result.exceedance[i].tolist(),
                strict=True,
            )
        )
    return out


def _table(result: Prediction, cells: bool = True) -> np.ndarray:
    """The NPY answer: the estimate; for conditional models the mean, then the
    quantiles, then the exceedance probabilities, as columns (per-cell classifiers:
    see :func:`encode`). A withheld bag's rows are NaN (empty strings for labels)."""
    table, per = _table_of(result, cells)
    withheld = np.array([not result.released(i) for i in range(result.n_bags)], dtype=bool)
    if not withheld.any():
        return table
    rows = withheld if per == "bag" else np.repeat(withheld, result.sizes)
    table = np.array(table, copy=True)
    table[rows] = "" if table.dtype.kind in "US" else np.nan
    return table


@functools.singledispatch
def _table_of(result: Prediction, cells: bool) -> tuple[np.ndarray, str]:
    """The NPY table of a result and whether its rows are per ``"bag"`` or per
    ``"point"``: here the estimate, a row per bag."""
    return result.estimate, "bag"


@_table_of.register
def _(result: CellPrediction, cells: bool) -> tuple[np.ndarray, str]:
    if result.probabilities is not None:
        return result.probabilities, "point"
    if not cells and result.counts is not None:
        return result.counts.astype(np.float64), "bag"
    return result.labels, "point"


@_table_of.register
def _(result: ConditionalPrediction, cells: bool) -> tuple[np.ndarray, str]:
    extra = np.hstack([result.quantiles, result.exceedance])
    return (np.column_stack([result.mean, extra]) if extra.shape[1] else result.mean), "bag"
