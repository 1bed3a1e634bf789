"""The OpenAPI document: every response described, errors as problem details.

FastAPI describes what the route signatures say; this module completes the document
once, when it is first asked for:

* ``components.schemas.Problem``: the RFC 9457 body of every error, referenced by
  each error response (``application/problem+json``; ``application/json`` under
  ``/v2``, as the Open Inference Protocol's clients expect), including the 422 that
  FastAPI would describe with its own validation schema, which this service never
  sends;
* a schema for every success response, named where it is the service's own
  (``PredictAnswer``, ``Readiness``, ``JobAccepted``, ``InferAnswer``) and typed by
  media type elsewhere (CSV text, NPY bytes, Prometheus text);
* the API-key security schemes (see :mod:`.deps`) on every authenticated operation,
  and 401 among its responses; when the service runs without keys, an anonymous
  alternative (``{}``) says that a key is optional.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from .settings import Settings

__all__ = ["install_openapi"]

_PROBLEM: dict[str, Any] = {
    "type": "object",
    "description": "RFC 9457 problem details, with every problem listed in `errors`.",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "example": "urn:bagserve:problem:invalid-bags"},
        "title": {"type": "string", "example": "Unprocessable content"},
        "status": {"type": "integer", "example": 422},
        "detail": {"type": "string", "example": "2 problem(s) in the request"},
        "instance": {"type": ["string", "null"], "example": "/v1/models/yeast/predict"},
        "errors": {"type": "array", "items": {"type": "string"}},
        "error": {
            "type": "string",
            "description": "The message for Open Inference Protocol clients (`/v2`: in full).",
        },
        "request_id": {"type": ["string", "null"]},
    },
}
_DOMAIN: dict[str, Any] = {
    "type": "object",
    "description": "How close the bag is to the training bags (applicability domain).",
    "properties": {
        "score": {"type": "number", "description": "about 1 for a typical training bag"},
        "out_of_range": {"type": "boolean"},
        "nearest": {"type": "array", "items": {"type": "string"}},
        "fallback": {
            "type": "boolean",
            "description": "out of range, and answered by the model's invariant fallback "
            "(per-sample standardised; marginal-transfer models)",
        },
        "disagreement": {
            "type": ["number", "null"],
            "description": "how differently the model and its invariant fallback answer "
            "the bag: the share of cells labelled differently (or the root mean square "
            "difference of values); beyond what their validation errors allow, the bag "
            "is out of range and the fallback answers. Null without a fallback, or when "
            "the bag was out of range already",
        },
        "relabelled": {
            "type": ["number", "null"],
            "description": "the share of the bag's cells whose label changed when the "
            "model refined its answer by a mixture fitted to the bag's own cells (one "
            "Gaussian per population, started at the model's labels; only where the "
            "model's validation allows it). Null where no refinement ran",
        },
    },
}
_POPULATION_ROW: dict[str, Any] = {
    "type": "object",
    "required": ["class", "count", "percent"],
    "properties": {
        "class": {"type": ["string", "number", "integer", "boolean"]},
        "count": {"type": "integer"},
        "percent": {"type": "number"},
        "mean_probability": {"type": "number"},
    },
}
_PREDICTION: dict[str, Any] = {
    "type": "object",
    "description": (
        "One bag's answer. Bag models: `prediction` (a value, a vector or a class), with "
        "`interval`, `set`, `scores`, `probabilities`, `quantiles`, `exceedance` as asked "
        "and available. Per-cell models: `population`, `labels` (unless cells=false), "
        "`probabilities` (on request) and `report`."
    ),
    "required": ["id", "status"],
    "properties": {
        "id": {"type": "string"},
        "input_sha256": {
            "type": "string",
            "description": "sha256 of the bag's own file as uploaded (each multipart part "
            "on its own), or of its cells for cells sent as numbers",
        },
        "status": {
            "type": "string",
            "enum": ["final", "preliminary", "withheld"],
            "description": "the answer's status under the model's out-of-domain policy: "
            "`final` in domain; out of domain `final` (policy flag), `preliminary` "
            "(the default) or `withheld` (no value, interval or set; `withheld` says why)",
        },
        "withheld": {
            "type": "string",
            "description": "why the value was withheld (only with status `withheld`)",
        },
        "prediction": {},
        "interval": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        "set": {"type": "array", "items": {}},
        "scores": {"type": "object", "additionalProperties": {"type": "number"}},
        "probabilities": {"type": "object"},
        "quantiles": {"type": "object", "additionalProperties": {"type": "number"}},
        "exceedance": {"type": "object", "additionalProperties": {"type": "number"}},
        "domain": {"$ref": "#/components/schemas/Domain"},
        "n_points": {"type": "integer"},
        "labels": {"type": "array", "items": {}},
        "population": {"type": "array", "items": {"$ref": "#/components/schemas/PopulationRow"}},
        "report": {"type": "object"},
    },
}
_MODEL_REF: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "string"},
        "sha256": {"type": "string"},
    },
}
_PREDICT_ANSWER: dict[str, Any] = {
    "type": "object",
    "required": ["model", "request_id", "request_sha256", "predictions"],
    "properties": {
        "model": {"$ref": "#/components/schemas/ModelRef"},
        "request_id": {"type": "string"},
        "request_sha256": {
            "type": "string",
            "description": "sha256 of the request body as received (each bag's own file "
            "hash is its `input_sha256`)",
        },
        "warnings": {
            "type": "array",
            "items": {"type": "string"},
            "description": "what should change a reviewer's reading of the answer",
        },
        "notes": {
            "type": "array",
            "items": {"type": "string"},
            "description": "routine facts about the input (channels ignored, "
            "compensation applied); kept apart from the warnings",
        },
        "predictions": {"type": "array", "items": {"$ref": "#/components/schemas/Prediction"}},
    },
}
_READINESS: dict[str, Any] = {
    "type": "object",
    "description": (
        "`status` and `reasons` for everyone; the rest for a caller with a valid API key "
        "(or for everyone when the service has no keys)"
    ),
    "required": ["status", "reasons"],
    "properties": {
        "status": {"type": "string", "enum": ["ready", "not ready"]},
        "reasons": {
            "type": "array",
            "items": {"type": "string"},
            "description": "why it is not ready, in words (empty when ready)",
        },
        "models": {"type": "array", "items": {"type": "string"}},
        "model_failures": {"type": "object", "additionalProperties": {"type": "string"}},
        "workers": {"type": "object"},
        "database": {
            "type": "string",
            "description": "`ok`, or why the state database cannot be reached",
        },
        "anonymous_public": {
            "type": "boolean",
            "description": (
                "anyone may call the service without a key on a non-loopback address "
                "(no BAGSERVE_API_KEYS, no BAGSERVE_ALLOW_ANONYMOUS=true); the service "
                "is still ready"
            ),
        },
        "warnings": {
            "type": "array",
            "items": {"type": "string"},
            "description": "what the deployment should change, in words (empty: nothing)",
        },
    },
}
_JOB_ACCEPTED: dict[str, Any] = {
    "type": "object",
    "required": ["id", "status"],
    "properties": {
        "id": {"type": "string"},
        "status": {"type": "string"},
        "model": {"type": "string"},
        "version": {"type": "string"},
    },
    "additionalProperties": True,
}
_HL7_DELIVERY: dict[str, Any] = {
    "type": "object",
    "description": (
        "Where the job's HL7 v2 ORU^R01 message is (BAGSERVE_HL7_FORWARD): pending (not "
        "accepted yet; tried again at next_try), delivered (AA for its control id) or "
        "undelivered (refused with AR, or out of tries or time); ack and error are the "
        "last try's"
    ),
    "required": ["peer", "control_id", "status", "tries"],
    "properties": {
        "peer": {"type": "string", "description": "mllp://HOST:PORT"},
        "control_id": {"type": "string", "description": "MSH-10, which the ACK echoes"},
        "status": {"type": "string", "enum": ["pending", "delivered", "undelivered"]},
        "tries": {"type": "integer", "minimum": 0},
        "ack": {"type": ["string", "null"], "description": "the last ACK's code (MSA-1)"},
        "error": {"type": ["string", "null"]},
        "updated": {"type": "number"},
        "next_try": {"type": "number", "description": "when a pending message is tried again"},
    },
}
_JOB: dict[str, Any] = {
    "type": "object",
    "required": ["id", "status", "links"],
    "properties": {
        "id": {"type": "string"},
        "status": {
            "type": "string",
            "enum": ["queued", "running", "succeeded", "failed", "cancelled"],
        },
        "created": {"type": "number"},
        "updated": {"type": "number"},
        "model": {"type": "string"},
        "version": {"type": "string"},
        "attempts": {"type": "integer"},
        "links": {"type": "object"},
        "result": {
            "type": "object",
            "description": "once finished: the predict answer (succeeded) or a problem (failed)",
        },
        "hl7": {"$ref": "#/components/schemas/Hl7Delivery"},
    },
    "additionalProperties": True,
}
_TENSOR: dict[str, Any] = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "parameters": {"type": "object"},
        "data": {"type": "array", "items": {}},
    },
}
_INFER_ANSWER: dict[str, Any] = {
    "type": "object",
    "required": ["model_name", "outputs"],
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "parameters": {"type": "object"},
        "outputs": {"type": "array", "items": {"$ref": "#/components/schemas/Tensor"}},
    },
}
_MODEL_READY: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "ready": {"type": "boolean"}},
}
_FHIR_BUNDLE: dict[str, Any] = {
    "type": "object",
    "description": (
        "An HL7 FHIR R4 Bundle of type transaction: the model as a Device, one "
        "Observation per bag (value, interval component, interpretation EX outside the "
        "applicability domain, the input's sha256 as a contained DocumentReference), "
        "a DiagnosticReport of them with a conclusion (conclusionCode EX when a bag lies "
        "outside the domain), and a Provenance; Observations, report and Device are "
        "created conditionally on their identifiers, so a retried submission files "
        "nothing twice. Valid against the FHIR R4 JSON schema."
    ),
    "required": ["resourceType", "type", "entry"],
    "properties": {
        "resourceType": {"type": "string", "enum": ["Bundle"]},
        "type": {"type": "string", "enum": ["transaction"]},
        "identifier": {"type": "object"},
        "timestamp": {"type": "string"},
        "entry": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"fullUrl": {"type": "string"}, "resource": {"type": "object"}},
            },
        },
    },
}
_SCHEMAS = {
    "Problem": _PROBLEM,
    "FhirBundle": _FHIR_BUNDLE,
    "Domain": _DOMAIN,
    "PopulationRow": _POPULATION_ROW,
    "Prediction": _PREDICTION,
    "ModelRef": _MODEL_REF,
    "PredictAnswer": _PREDICT_ANSWER,
    "Readiness": _READINESS,
    "JobAccepted": _JOB_ACCEPTED,
    "Job": _JOB,
    "Hl7Delivery": _HL7_DELIVERY,
    "Tensor": _TENSOR,
    "InferAnswer": _INFER_ANSWER,
    "ModelReady": _MODEL_READY,
}
#: Success schemas by (path suffix, status) where FastAPI has none of its own.
_SUCCESS = {
    ("/predict", "200"): "PredictAnswer",
    ("/readyz", "200"): "Readiness",
    ("/health/ready", "200"): "ModelReady",
    ("/ready", "200"): "ModelReady",
    ("/infer", "200"): "InferAnswer",
    ("/v1/jobs", "202"): "JobAccepted",
    ("/v1/jobs/{job_id}", "200"): "Job",
}
_BY_MEDIA = {
    "text/csv": {"type": "string"},
    "text/plain": {"type": "string"},
    "application/x-npy": {"type": "string", "format": "binary"},
    "application/octet-stream": {"type": "string", "format": "binary"},
    "application/fhir+json": {"$ref": "#/components/schemas/FhirBundle"},
}
#: Operations that answer without the app's services (everything else answers 503
#: while the service starts or stops).
_WITHOUT_SERVICES = {"/healthz", "/v2", "/v2/health/live"}
#: What every operation with a path parameter answers when it names nothing served.
_NOT_FOUND = {
    "{job_id}": "unknown job (or another API key's)",
    "{name}": "unknown model or version",
}
#: What every operation that reads a request body may answer, besides its own.
_BODY_ERRORS = {
    "400": "a body that cannot be parsed, or a Content-Length that is not a number",
    "413": "over the body, decoded-size, cell or column limits",
    "415": "unsupported content type or Content-Encoding",
    "422": "invalid bags, options or parameters (every problem listed)",
    "503": "queue full or request bodies waiting over their limit; see Retry-After",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _complete(doc: dict[str, Any], keys_required: bool) -> dict[str, Any]:
    """Add the problem schema, success schemas, 401s and the anonymous alternative."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(_SCHEMAS)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, operations in doc["paths"].items():
        error_type = "application/json" if path.startswith("/v2") else "application/problem+json"
        for op in operations.values():
            responses = op.setdefault("responses", {})
            if op.get("security"):
                responses.setdefault("401", {"description": "missing or invalid API key"})
                if not keys_required:
                    op["security"] = [*op["security"], {}]
            for parameter, missing in _NOT_FOUND.items():
                if parameter in path:
                    responses.setdefault("404", {"description": missing})
            if "requestBody" in op:
                for code, why in _BODY_ERRORS.items():
                    responses.setdefault(code, {"description": why})
            if path not in _WITHOUT_SERVICES:
                responses.setdefault(
                    "503", {"description": "the service is starting or stopping; retry"}
                )
            responses.setdefault("500", {"description": "internal error (details in the log)"})
            if path == "/metrics":
                responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
            for status, response in responses.items():
                if status == "503" and (path == "/readyz" or path.endswith("/ready")):
                    # Readiness answers its own body when not ready, not a problem (a
                    # model's too: it is not ready while it loads).
                    name = "Readiness" if path == "/readyz" else "ModelReady"
                    response["content"] = {"application/json": {"schema": _ref(name)}}
                    continue
                if int(status) >= 400:
                    response["content"] = {error_type: {"schema": _ref("Problem")}}
                    continue
                named = next(
                    (
                        schema
                        for (suffix, code), schema in _SUCCESS.items()
                        if path.endswith(suffix) and code == status
                    ),
                    None,
                )
                content = response.setdefault("content", {"application/json": {}})
                for media, spec in content.items():
                    if spec.get("schema"):
                        continue
                    if named is not None and media == "application/json":
                        spec["schema"] = _ref(named)
                    else:
                        spec["schema"] = _BY_MEDIA.get(media, {"type": "object"})
    return doc


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Replace ``app.openapi`` by one that completes FastAPI's document (once)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _complete(generate(), bool(settings.api_keys))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
