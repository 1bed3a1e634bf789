"""Triton's extensions of the Open Inference Protocol: model repository, model
configuration and statistics (authenticated, like the rest of ``/v2/models``).

* ``POST /v2/repository/index``: every model version in the models directory with its
  state (READY, or UNAVAILABLE and why: not loaded yet, unloaded, refused);
* ``POST /v2/repository/models/{name}/load`` and ``.../unload``: serve a new or
  changed model, or stop serving one, without a restart (:mod:`..repository`);
* ``GET /v2/models/{name}[/versions/{version}]/config``: the model's configuration in
  Triton's form (inputs, outputs, versions, parameters);
* ``GET /v2/models/stats`` and ``/v2/models/{name}[/versions/{version}]/stats``:
  inference counts and cumulative stage times (:mod:`..model_stats`).

These routes are registered before ``/v2/models/{name}`` so that ``stats`` is never
taken for a model name.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ..deps import (
    FORBIDDEN,
    LatestEntry,
    ModelName,
    ServicesDep,
    VersionEntry,
    authenticate,
    lookup,
    require,
)
from ..errors import Problem
from ..registry import ModelEntry
from ..security import Role
from ..tensors import OUTPUTS

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
    """Every model version on disk with its state; ``{"ready": true}`` lists only the
    served ones."""
    doc = await _json_body(request)
    rows = svc.registry.on_disk()
    if doc.get("ready"):
        rows = [r for r in rows if r["state"] == "READY"]
    return rows


@router.post(
    "/repository/models/{name}/load",
    dependencies=[Depends(require(Role.ADMIN))],
    responses={**FORBIDDEN, 404: {"description": "no servable version of the model on disk"}},
    summary="Load or reload a model",
)
async def load_model(name: ModelName, svc: ServicesDep) -> dict[str, Any]:
    """Serve every valid version of model ``name`` as it is on disk now (new, changed
    or unloaded before); the service keeps answering meanwhile."""
    served = await svc.repository.load(name)
    return {"name": name, "served": [k for k in served if k.startswith(f"{name}/")]}


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


@router.get("/models/{name}/config", summary="Model configuration")
async def model_config(svc: ServicesDep, entry: LatestEntry) -> dict[str, Any]:
    """The latest version's configuration in Triton's form."""
    return _config(svc, entry)


@router.get("/models/{name}/versions/{version}/config", summary="Model version configuration")
async def model_version_config(svc: ServicesDep, entry: VersionEntry) -> dict[str, Any]:
    """One version's configuration in Triton's form."""
    return _config(svc, entry)
