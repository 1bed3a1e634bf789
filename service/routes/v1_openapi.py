"""The native API's predict routes as the OpenAPI document describes them.

The request body, the query parameters and the answers of ``POST /v1/models/{name}/predict``
(and its one-version twin), kept apart from the route code (:mod:`.v1`) so that each can
be read on its own. ``openapi/openapi.json`` is generated from them (``bagserve openapi``).
"""

from __future__ import annotations

from typing import Any

from ..deps import FORBIDDEN
from ..hl7 import ID_PATTERN

__all__ = ["PREDICT_DOC", "PREDICT_RESPONSES"]

EXAMPLE_BAG = {
    "bags": [
        {
            "id": "patient-17",
            "markers": ["FSC-A", "SSC-A", "GFP"],
            "points": [[2.1, 1.0, 0.3], [1.7, 0.8, 1.9], [2.4, 1.3, 0.1]],
        }
    ]
}
PREDICT_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            "One bag or many. JSON (`bags`: id, points, optional markers and weights), "
            "or one file as the body (NPY with `?markers=`, CSV/TSV with a header, FCS, "
            "Parquet or AnnData .h5ad with the optional extras), "
            "or multipart/form-data with several files (one bag each)."
        ),
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["bags"],
                    "properties": {
                        "bags": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["points"],
                                "properties": {
                                    "id": {"type": "string"},
                                    "points": {
                                        "type": "array",
                                        "items": {"type": "array", "items": {"type": "number"}},
                                    },
                                    "markers": {"type": "array", "items": {"type": "string"}},
                                    "weights": {"type": "array", "items": {"type": "number"}},
                                },
                            },
                        }
                    },
                },
                "example": EXAMPLE_BAG,
            },
            "text/csv": {
                "schema": {"type": "string"},
                "example": "FSC-A,SSC-A,GFP\n2.1,1.0,0.3\n1.7,0.8,1.9\n",
            },
            "application/x-npy": {"schema": {"type": "string", "format": "binary"}},
            "application/vnd.isac.fcs": {"schema": {"type": "string", "format": "binary"}},
            "application/vnd.apache.parquet": {"schema": {"type": "string", "format": "binary"}},
            "application/x-hdf5": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "files": {"type": "array", "items": {"type": "string", "format": "binary"}}
                    },
                }
            },
        },
    },
    "parameters": [
        {
            "name": "markers",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "description": "Comma-separated marker names of an NPY body's columns.",
        },
        {
            "name": "quantiles",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "pattern": r"^[0-9.eE+-]+(,[0-9.eE+-]+)*$"},
            "description": (
                "Conditional models (ConditionalMeanEmbedding) only: comma-separated levels "
                "in [0, 1], e.g. `0.05,0.5,0.95`; each prediction gains `quantiles` "
                "{level: value} of the outcome's predicted distribution (CSV: columns "
                "q_<level>; NPY: columns after the mean)."
            ),
        },
        {
            "name": "exceed",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "pattern": r"^[0-9.eE+-]+(,[0-9.eE+-]+)*$"},
            "description": (
                "Conditional models only: comma-separated thresholds t, e.g. `2.5`; each "
                "prediction gains `exceedance` {t: P(outcome > t)} (CSV: columns p_gt_<t>; "
                "NPY: last columns)."
            ),
        },
        {
            "name": "interval",
            "in": "query",
            "required": False,
            "schema": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "example": 0.9,
            "description": (
                "A coverage such as 0.9. Regressors: each prediction gains `interval` [lo, hi] "
                "(conformal jackknife+ on the leave-one-bag-out residuals; conditional "
                "models: the conditional quantiles); classifiers: `set`, the conformal "
                "prediction set (CSV: columns interval_lo, interval_hi or set). Every "
                "prediction carries `domain` {score, out_of_range, nearest} whatever is asked."
            ),
        },
        {
            "name": "compensated",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean", "default": False},
            "description": (
                "For models that compensate (see the model's preprocessing): `true` "
                "declares the cells compensated already, so the model's compensation is "
                "skipped (recorded in the audit trail). Without it, a model that uses each "
                "file's own spillover matrix needs FCS uploads."
            ),
        },
        {
            "name": "cells",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean", "default": True},
            "description": (
                "Per-cell models: `false` leaves out the label of every cell; the "
                "`population` summary (count, percent and mean probability per class) "
                "stays (CSV: one row per bag and class; NPY: counts, bags x classes)."
            ),
        },
        {
            "name": "plot",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 0, "maximum": 20000, "default": 0},
            "description": (
                "Per-cell models (JSON): up to this many cells per bag, drawn with a fixed "
                "seed, as the model sees them (compensated, transformed, scaled), with "
                "their labels: `plot` {markers, cells (row numbers), points, labels}. "
                "With `explain=true`: the cells with their contributions."
            ),
        },
        {
            "name": "explain",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean", "default": False},
            "description": (
                "JSON (FHIR and HL7: one line of text): each prediction gains "
                "`explanation` {method, outputs, n_cells, prediction, baseline, total, "
                "by_marker, top_cells}, which cells moved it: `exact` per-cell "
                "contributions summing to prediction - baseline where the model is linear "
                "in the sample, else each cell's first-order `influence`; per-cell models, "
                "`assignment`: the share of the bag's cells in each class (or their mean "
                "value) as a sum over cells of their own answers and their effect through "
                "the sample's context, and `by_population` by its labels (not with "
                "`unassigned`). With `plot=N`, "
                "`plot` {markers, cells, points, output, contributions} of up to N cells. "
                "With `Accept: application/vnd.isac.fcs` and one bag: that sample's cells "
                "as sent plus a `contribution` channel, as FCS. "
                "The audit trail keeps only its sha256."
            ),
        },
        {
            "name": "probabilities",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean", "default": False},
            "description": (
                "Per-cell classifiers: every cell's calibrated class probabilities (JSON: "
                "`probabilities` {classes, cells}; CSV: columns p_<class>; NPY: cells x "
                "classes). Column order of CSV and NPY: the `Bagserve-Classes` header."
            ),
        },
        {
            "name": "unassigned",
            "in": "query",
            "required": False,
            # No example: the document's examples are sent to every model, and this
            # one applies to per-cell classifiers only.
            "schema": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "description": (
                "Per-cell classifiers: every cell farther from the population it was given "
                "than this chi-square level of Mahalanobis distance (under that "
                "population's training covariance) is answered `unassigned`, a row of its "
                "own in the `population` summary. Not with `probabilities`."
            ),
        },
        {
            "name": "control",
            "in": "query",
            "required": False,
            # No example: it names a bag of the request, and applies to per-cell models
            # trained with a reference control only.
            "schema": {"type": "string", "maxLength": 256},
            "description": (
                "Per-cell models trained with a reference control (`[data] control`): the "
                "id of the request's bag that is this batch's control. Its map (per "
                "marker, its quantiles onto the training control's) is applied to every "
                "other bag before the model answers; each bag's `report.calibration` says "
                "how far it moved each marker and which markers it made worse. The "
                "control gets no answer of its own; a note names it with its sha256."
            ),
        },
        *(
            {
                "name": name,
                "in": "query",
                "required": False,
                "schema": {"type": "string"},
                "example": example,
                "description": (
                    f"FHIR answers (`Accept: application/fhir+json`): the {what} of every "
                    f"Observation, as a reference relative to the FHIR server the bundle is "
                    f"filed on: `{example.split('/')[0]}/<id>` (another type, an absolute URL "
                    "or a `urn:uuid:` is refused)."
                ),
            }
            for name, example, what in (
                ("subject", "Patient/123", "subject (the patient)"),
                ("specimen", "Specimen/9", "specimen (the sample)"),
            )
        ),
        {
            "name": "patient",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "pattern": ID_PATTERN},
            "example": "p-17",
            "description": (
                "HL7 v2 answers (`Accept: application/hl7-v2`) and forwarded jobs: the "
                "patient identifier (PID-3)."
            ),
        },
        {
            "name": "order",
            "in": "query",
            "required": False,
            "schema": {
                "type": "array",
                "items": {"type": "string", "pattern": ID_PATTERN},
                "uniqueItems": True,
            },
            "style": "form",
            "explode": True,
            "example": ["ord-4711"],
            "description": (
                "HL7 v2 answers and forwarded jobs: the placer order number of each bag "
                "(ORC-2, OBR-2), repeated in the bags' order (`order=A&order=B`): a placer "
                "order number names one order, so there are as many as bags, or none "
                "(422 otherwise)."
            ),
        },
        {
            "name": "effective",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "example": "2026-11-25T09:30:00+01:00",
            "description": (
                "FHIR answers: when the sample was taken or measured, a FHIR dateTime (a "
                "date, or a date and time with its zone); every Observation's and the "
                "report's `effectiveDateTime`. Default: the FCS file's acquisition time."
            ),
        },
    ],
}
IDEMPOTENCY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "maxLength": 255},
    "description": "A retried request with the same key and body gets the stored answer.",
}
PREDICT_DOC["parameters"].append(IDEMPOTENCY)
PREDICT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": (
            "Predictions with provenance (model name, version, sha256; request id; input sha256)."
        ),
        "content": {
            "application/json": {
                "example": {
                    "model": {"name": "demo-dose", "version": "1", "sha256": "3f1c…"},
                    "request_id": "9b2e…",
                    "request_sha256": "a41d…",
                    "warnings": [],
                    "notes": [],
                    "predictions": [
                        {
                            "id": "patient-17",
                            "input_sha256": "5c0e…",
                            "status": "final",
                            "prediction": 1.27,
                            "quantiles": {"0.05": 0.81, "0.95": 1.74},
                            "exceedance": {"1.5": 0.22},
                        }
                    ],
                }
            },
            "text/csv": {
                "schema": {
                    "type": "string",
                    "description": (
                        "The results table every CSV door writes (bagserve predict "
                        "--format csv, bagserve batch): id, the values by the model's kind, "
                        "then status, out_of_range, domain_score, withheld_reason, "
                        "input_sha256, model_sha256, warnings, error. The columns follow "
                        "from the model and the query alone; a withheld bag's value cells "
                        "are empty (docs: lab-integration, the results table)."
                    ),
                },
                "example": (
                    "id,prediction,interval_lo,interval_hi,status,out_of_range,domain_score,"
                    "withheld_reason,input_sha256,model_sha256,warnings,error\n"
                    "patient-1,0.322,0.23,0.40,final,0,0.865,,9f86d0…,a489f9…,,\n"
                ),
            },
            "application/x-npy": {},
            "application/fhir+json": {},
            "application/hl7-v2": {
                "schema": {
                    "type": "string",
                    "description": "one HL7 v2.5.1 ORU^R01 message, segments ended by CR",
                }
            },
            "application/vnd.isac.fcs": {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": (
                        "With explain=true and one bag: an FCS 3.1 file "
                        "of that bag's cells as sent (every column in its order, before "
                        "compensation and transforms, 32-bit floats) plus the channel "
                        "`contribution`, each cell's contribution to the last output, for "
                        "gating in FlowJo or FlowKit; the file `bagserve predict --explain "
                        "--fcs-dir` writes. 406 without explain=true, 422 for several bags."
                    ),
                }
            },
        },
    },
    400: {"description": "a body that cannot be parsed (JSON, multipart, Content-Length)"},
    401: {"description": "missing or invalid API key"},
    **FORBIDDEN,
    404: {"description": "unknown model or version"},
    406: {"description": "unsupported Accept (FCS without explain=true)"},
    413: {
        "description": (
            "the body is over the size limit, or decodes (inflates, or holds cells) beyond "
            "the decoded-size, cell or column limits"
        )
    },
    415: {"description": "unsupported content type or Content-Encoding"},
    422: {"description": "invalid bags or options (every problem listed)"},
    503: {
        "description": (
            "queue full, request bodies waiting over their limit, worker lost, or the "
            "state database unreachable; see Retry-After"
        )
    },
    504: {"description": "prediction timed out"},
}
