"""Triton's extensions of the Open Inference Protocol: model repository, model
configuration and statistics (authenticated, like the rest of ``/v2/models``).

* ``POST /v2/repository/index``: every model version in the models directory with its
  state (READY, LOADING, or UNAVAILABLE and why: not loaded yet, unloaded, refused);
* ``POST /v2/repository/models/{name}/load`` and ``.../unload``: serve a new or
  changed model, or stop serving one, without a restart (:mod:`..repository`). A load
  answers 200 when it is done within half a second (or the ``Prefer: wait=N`` the
  client asked for), else 202 with a ``Location`` to poll:
  ``GET /v2/repository/models/{name}/load/status``;
* ``GET /v2/models/{name}[/versions/{version}]/config``: the model's configuration in
  Triton's form (inputs, outputs, versions, parameters);
* ``GET /v2/models/stats`` and ``/v2/models/{name}[/versions/{version}]/stats``:
  inference counts and cumulative stage times (:mod:`..model_stats`).

These routes are registered before ``/v2/models/{name}`` so that ``stats`` is never
taken for a model name.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Header, Request
from starlette.responses import Response

from ..deps import (
    FORBIDDEN,
    ModelName,
    ServicesDep,
    VersionEntry,
    authenticate,
    lookup,
    require,
)
from ..errors import Problem
from ..registry import ModelEntry
from ..repository import READY, LoadStatus
from ..security import Role
from ..tensors import OUTPUTS
from .twins import Twin, add_twins

router = APIRouter(
    prefix="/v2", tags=["v2 (Triton extensions)"], dependencies=[Depends(authenticate)]
)

#: Open Inference Protocol datatypes in Triton's configuration spelling.
_TRITON_TYPES = {"FP64": "TYPE_FP64", "INT64": "TYPE_INT64", "BOOL": "TYPE_BOOL"}


async def _json_body(request: Request) -> dict[str, Any]:
    body = await request.body()
    if not body.strip():
        return {}
    try:
        doc = await request.json()
    except ValueError:
        raise Problem(400, "the body must be a JSON object", slug="invalid-request") from None
    if not isinstance(doc, dict):
        raise Problem(400, "the body must be a JSON object", slug="invalid-request")
    return doc


@router.post("/repository/index", summary="Model repository index")
async def repository_index(request: Request, svc: ServicesDep) -> list[dict[str, str]]:
    """Every model version on disk with its state (READY, LOADING, UNAVAILABLE with the
    reason); ``{"ready": true}`` lists only the served ones."""
    doc = await _json_body(request)
    rows = await svc.repository.index()
    if doc.get("ready"):
        rows = [r for r in rows if r["state"] == READY]
    return rows


#: Seconds a load is waited for before 202 (a client with a 1 s timeout gets an answer).
LOAD_WAIT = 0.5
#: The longest ``Prefer: wait=N`` honoured.
MAX_LOAD_WAIT = 60.0
_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*\"?(\d+(?:\.\d+)?)", re.IGNORECASE)
_ASYNC = re.compile(r"(?:^|[,;\s])respond-async(?:$|[,;\s])", re.IGNORECASE)


def _wait(prefer: str | None) -> tuple[float, str | None]:
    """Seconds to wait for a load, and the preference applied, from an RFC 7240
    ``Prefer`` header: ``respond-async`` (answer 202 at once), ``wait=N`` (up to N s,
    at most :data:`MAX_LOAD_WAIT`). Anything else is ignored, as RFC 7240 says."""
    if prefer:
        if _ASYNC.search(prefer):
            return 0.0, "respond-async"
        found = _WAIT.search(prefer)
        if found:
            seconds = min(float(found.group(1)), MAX_LOAD_WAIT)
            return seconds, f"wait={found.group(1)}"
    return LOAD_WAIT, None


def _status_url(name: str) -> str:
    return f"/v2/repository/models/{name}/load/status"


_LOAD_STATUS_SCHEMA = {
    "type": "object",
    "required": ["name", "state", "reason"],
    "properties": {
        "name": {"type": "string"},
        "state": {"type": "string", "enum": ["READY", "LOADING", "UNAVAILABLE"]},
        "reason": {"type": "string"},
        "versions": {"type": "array", "items": {"type": "string"}},
        "served": {"type": "array", "items": {"type": "string"}},
        "started": {"type": "number"},
        "finished": {"type": ["number", "null"]},
        "seconds": {"type": ["number", "null"]},
    },
}


def _status_response(status: LoadStatus, code: int, headers: dict[str, str]) -> Response:
    return Response(
        orjson.dumps(status.to_json()),
        status_code=code,
        media_type="application/json",
        headers=headers,
    )


@router.post(
    "/repository/models/{name}/load",
    dependencies=[Depends(require(Role.ADMIN))],
    responses={
        200: {
            "description": "loaded: every valid version on disk is served",
            "content": {"application/json": {"schema": _LOAD_STATUS_SCHEMA}},
        },
        202: {
            "description": (
                "loading, not done within the wait: poll the Location "
                "(GET /v2/repository/models/{name}/load/status)"
            ),
            "content": {"application/json": {"schema": _LOAD_STATUS_SCHEMA}},
        },
        **FORBIDDEN,
        404: {"description": "no servable version of the model on disk"},
        500: {"description": "the workers could not load it; what was served still is"},
    },
    summary="Load or reload a model",
)
async def load_model(
    name: ModelName,
    svc: ServicesDep,
    prefer: Annotated[
        str | None,
        Header(
            description=(
                "RFC 7240: `respond-async` answers 202 at once; `wait=N` waits up to N "
                f"seconds (at most {MAX_LOAD_WAIT:g}) for the load before 202; "
                f"default {LOAD_WAIT:g} s"
            ),
            examples=["wait=10"],
        ),
    ] = None,
) -> Response:
    """Serve every valid version of model ``name`` as it is on disk now (new, changed
    or unloaded before). The service keeps answering meanwhile, from the versions served
    before until every worker holds the new ones. Answers 200 when the load is done
    within the wait (half a second, or ``Prefer``), else 202 with ``Location`` and
    ``Retry-After``: poll ``GET /v2/repository/models/{name}/load/status`` until its
    ``state`` is READY, or UNAVAILABLE with the ``reason``."""
    status = svc.repository.begin(name)
    seconds, applied = _wait(prefer)
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(status.done.wait(), seconds)
    headers = {"Preference-Applied": applied} if applied else {}
    if status.done.is_set():
        if status.problem is not None:
            raise status.problem
        return _status_response(status, 200, headers)
    headers.update({"Location": _status_url(name), "Retry-After": "1"})
    return _status_response(status, 202, headers)


@router.get(
    "/repository/models/{name}/load/status",
    responses={
        200: {
            "description": "the latest load of the model (or its state, when served from start-up)",
            "content": {"application/json": {"schema": _LOAD_STATUS_SCHEMA}},
        },
        404: {"description": "no load of the model was asked for, and it is not served"},
    },
    summary="Status of a model's load",
)
async def load_status(name: ModelName, svc: ServicesDep) -> Response:
    """The latest load of model ``name``: ``state`` LOADING, READY (``served`` lists its
    versions) or UNAVAILABLE with the ``reason`` (what was served before still is)."""
    return _status_response(svc.repository.status(name), 200, {})


@router.post(
    "/repository/models/{name}/unload",
    dependencies=[Depends(require(Role.ADMIN))],
    responses={**FORBIDDEN, 404: {"description": "the model is not loaded"}},
    summary="Unload a model",
)
async def unload_model(name: ModelName, svc: ServicesDep) -> dict[str, Any]:
    """Stop serving model ``name`` (until it is loaded again)."""
    await svc.repository.unload(name)
    return {"name": name, "served": []}


def _config(svc: ServicesDep, entry: ModelEntry) -> dict[str, Any]:
    """The model's configuration as Triton's ``ModelConfig`` JSON."""

    def tensor(spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": spec["name"],
            "data_type": _TRITON_TYPES.get(spec["datatype"], "TYPE_STRING"),
            "dims": spec["shape"],
        }

    panel = entry.panel
    return {
        "name": entry.name,
        "platform": "bagserve",
        "backend": "bagserve",
        "max_batch_size": 0,
        "version_policy": {
            "specific": {"versions": [e.version for e in svc.registry.versions(entry.name)]}
        },
        "input": [
            {"name": "points", "data_type": "TYPE_FP64", "dims": [-1, entry.n_features]},
            {"name": "bag_sizes", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
        ],
        "output": [tensor(o) for o in OUTPUTS[entry.kind]],
        "parameters": {
            "estimator": {"string_value": entry.info.estimator},
            "kind": {"string_value": str(entry.kind)},
            "markers": {"string_value": ",".join(panel.markers) if panel else ""},
            "sha256": {"string_value": entry.sha256},
        },
    }


@router.get("/models/stats", summary="Statistics of every model")
async def all_stats(svc: ServicesDep) -> dict[str, Any]:
    """Inference counts and cumulative stage times of every served model version."""
    return svc.stats.triton(sorted(e.key for e in svc.registry.all()))


@router.get("/models/{name}/stats", summary="Statistics of a model")
async def model_stats(name: ModelName, svc: ServicesDep) -> dict[str, Any]:
    """Inference counts and times of every served version of model ``name``."""
    lookup(svc.registry, name, None)
    return svc.stats.triton([e.key for e in svc.registry.versions(name)])


@router.get("/models/{name}/versions/{version}/stats", summary="Statistics of a version")
async def version_stats(svc: ServicesDep, entry: VersionEntry) -> dict[str, Any]:
    """Inference counts and times of one model version."""
    return svc.stats.triton([entry.key])


add_twins(
    router,
    "GET",
    "/models/{name}/config",
    _config,
    latest=Twin(
        "model_config",
        "Model configuration",
        "The latest version's configuration in Triton's form.",
    ),
    version=Twin(
        "model_version_config",
        "Model version configuration",
        "One version's configuration in Triton's form.",
    ),
)
