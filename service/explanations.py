"""Explanations on the doors: one JSON document per bag, and its plotted cells.

Every door that answers ``explain`` takes its explanation from here, built by
:meth:`bagserve.core.Explanation.to_dict` in the worker (so no cell crosses the pipe
beyond the plotted sample); text-only doors (FHIR, HL7) take
:func:`summary_text` of the same document. The audit trail
keeps only the documents' sha256 (:func:`explanations_sha256`). An answer in FCS
(``Accept: application/vnd.isac.fcs``) is the one bag's cells as received with each
cell's contribution as a channel (:func:`explained_fcs`), written by the CLI's writer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from bagserve.core.hashing import json_sha256
from bagserve.core.io import DataError, Sample, fcs_with_channel

from .errors import Problem

__all__ = [
    "CONTRIBUTION_CHANNEL",
    "TOP_CELLS",
    "explained_fcs",
    "explanation_documents",
    "explanations_sha256",
    "summary_text",
]

#: Cells listed with their marker values in each explanation.
TOP_CELLS = 10
#: The channel an FCS answer adds: each cell's contribution to the last output.
CONTRIBUTION_CHANNEL = "contribution"


def explanation_documents(
    runtime: Any, bags: Any, plot: int = 0, control: Any = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[Any]]:
    """Per bag, the explanation document; with ``plot`` > 0 also up to that many cells
    per bag (the seeded draw of the per-cell plots), as the model sees them, with their
    contributions to the last output: ``{markers, cells, points, contributions}`` (a
    per-cell model's also with their ``labels``); and
    the explanations themselves (:class:`bagserve.core.Explanation`). ``control``: the
    batch's reference control a per-cell model calibrates by (as it predicted)."""
    try:
        explanations = runtime.explain(bags, control=control, preprocessed=False)
    except TypeError as exc:  # no explanation (histograms, a pre-issue-44 per-cell model)
        raise Problem(422, str(exc), errors=[str(exc)], slug="invalid-request") from None
    documents = [e.to_dict(top=TOP_CELLS) for e in explanations]
    if not plot:
        return documents, None, explanations
    rng = np.random.default_rng(0)
    plots = []
    for e in explanations:
        rows = np.arange(e.points.shape[0])
        if rows.size > plot:
            rows = np.sort(rng.choice(rows.size, plot, replace=False))
        drawn = {
            "markers": list(e.markers),
            "cells": rows.tolist(),
            "points": np.round(e.points[rows], 5).tolist(),
            "output": e.outputs[-1],
            "contributions": e.contributions[rows, -1].tolist(),
        }
        if e.labels is not None:
            drawn["labels"] = e.labels[rows].tolist()
        plots.append(drawn)
    return documents, plots, explanations


def explained_fcs(bags: list[Any], explanations: list[Any]) -> bytes:
    """The FCS answer of a request of one bag: its cells as received (every column, in
    its order, before compensation and transforms) plus the channel ``contribution``,
    each cell's contribution to the last output (:func:`bagserve.core.io.fcs_with_channel`,
    the writer of ``bagserve predict --fcs-dir``).

    Raises
    ------
    Problem
        422 for a request of several bags (an FCS file holds one sample), or cells that
        cannot be written with the channel (a column already named ``contribution``).
    """
    if len(bags) != 1:
        message = (
            f"an FCS answer holds one sample; this request has {len(bags)} bags: send one "
            "bag per request, or ask for JSON"
        )
        raise Problem(422, message, errors=[message], slug="invalid-request")
    bag, explanation = bags[0], explanations[0]
    # Cells sent without names (NPY without markers) are the model's columns.
    names = list(bag.names) if bag.names is not None else list(explanation.markers)
    alt = list(bag.alt_names) if bag.alt_names is not None else names
    sample = Sample(bag.points, names, alt, str(bag.id), file_name=str(bag.id))
    try:
        return fcs_with_channel(sample, CONTRIBUTION_CHANNEL, explanation.contributions[:, -1])
    except DataError as exc:
        raise Problem(422, str(exc), errors=[str(exc)], slug="invalid-request") from None


def explanations_sha256(documents: list[dict[str, Any]] | None) -> str | None:
    """The sha256 of the explanations as canonical JSON: all the audit trail keeps."""
    return None if documents is None else json_sha256({"explanations": documents})


def summary_text(document: Mapping[str, Any], *, markers: int = 3) -> str:
    """A one-line text of an explanation's JSON (:meth:`bagserve.core.Explanation.to_dict`),
    for the doors that carry text only (FHIR, HL7): the method, the baseline (a per-cell
    model: the share, or mean value, it explains) and the markers whose position
    matters most for the last output, no cell data."""
    k = len(document["outputs"]) - 1
    output = document["outputs"][k]
    parts = [
        f"{m['marker']} {m['effect'][k]:+.3g}" for m in document["by_marker"][: max(0, markers)]
    ]
    if document["method"] == "assignment":  # a per-cell model: its share of the cells
        return (
            f"Why this prediction (assignment, {output}): {document['prediction'][k]:.4g} "
            f"from the {document['n_cells']} cells' own answers and the sample's context; "
            "marker effects (high cells push up if +): " + ", ".join(parts)
        )
    return (
        f"Why this prediction ({document['method']}, {output}): baseline "
        f"{document['baseline'][k]:.4g}, cells {document['total'][k]:+.3g} over "
        f"{document['n_cells']} cells; marker effects (high cells push up if +): "
        + ", ".join(parts)
    )
