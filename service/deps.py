"""FastAPI dependencies: the app's services, authentication, model lookup, the caller.

Routes declare what they need (``services: ServicesDep``, ``entry: LatestEntry``, ...)
instead of reaching into ``app.state``; the routers that need an API key carry
:func:`authenticate` as a router-wide dependency. Each dependency is a coroutine
function, although none awaits: FastAPI runs plain functions in its thread pool, a
thread hop per dependency per request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from .audit import AuditLog
from .errors import Problem
from .hl7_delivery import DeliveryQueue
from .idempotency import IdempotencyStore
from .jobs import JobStore
from .metrics import Metrics
from .model_stats import ModelStats
from .pool import WorkerPool
from .prediction import Caller, Predictor
from .registry import ModelEntry, Registry
from .repository import Repository
from .security import ApiKeys, Principal, Role
from .settings import Settings
from .uploads import Intake

__all__ = [
    "FORBIDDEN",
    "CallerDep",
    "LatestEntry",
    "ModelName",
    "ModelVersion",
    "PrincipalDep",
    "Services",
    "ServicesDep",
    "VersionEntry",
    "authenticate",
    "lookup",
    "require",
    "services",
]


@dataclass
class Services:
    """Everything a running app serves with, built once in its lifespan.

    Attributes
    ----------
    settings : Settings
    auth : ApiKeys
    metrics : Metrics
    registry : Registry
        The models served, and the artifacts refused with their reasons.
    pool : WorkerPool
    predictor : Predictor
        The prediction use-case.
    audit : AuditLog
    idempotency : IdempotencyStore
    jobs : JobStore
    deliveries : DeliveryQueue
        HL7 messages of finished jobs on their way to a laboratory system.
    repository : Repository
        Loads, reloads and unloads models while serving.
    stats : ModelStats
        Per-model inference counts and times (Triton's statistics).
    intake : Intake
        Admits requests and reads their bodies (:mod:`.uploads`).
    """

    settings: Settings
    auth: ApiKeys
    metrics: Metrics
    registry: Registry
    pool: WorkerPool
    predictor: Predictor
    audit: AuditLog
    idempotency: IdempotencyStore
    jobs: JobStore
    deliveries: DeliveryQueue
    repository: Repository
    stats: ModelStats
    intake: Intake


async def services(request: Request) -> Services:
    """The app's :class:`Services` (503 while the app is starting or stopping)."""
    found = getattr(request.app.state, "services", None)
    if found is None:
        raise Problem(503, "the service is starting", slug="not-ready")
    return found


ServicesDep = Annotated[Services, Depends(services)]


#: The two ways of presenting a key, declared for the OpenAPI document (Swagger UI's
#: Authorize button); the check itself is :meth:`ApiKeys.check`, which reads both.
_BEARER = HTTPBearer(auto_error=False, description="an API key as a bearer token")
_API_KEY = APIKeyHeader(name="X-API-Key", auto_error=False, description="an API key")


async def authenticate(
    request: Request,
    svc: ServicesDep,
    _bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)] = None,
    _key: Annotated[str | None, Security(_API_KEY)] = None,
) -> Principal:
    """Check the API key (401 without a valid one); the key's id and role go to the
    request's state, for the access log, the audit trail and the role checks."""
    principal = svc.auth.check(request)
    request.state.key_id = principal.key_id
    request.state.principal = principal
    return principal


PrincipalDep = Annotated[Principal, Depends(authenticate)]


def require(role: Role) -> Callable[..., Awaitable[Principal]]:
    """A dependency that lets only keys of ``role`` or above through (403 otherwise)."""

    async def check(principal: PrincipalDep) -> Principal:
        if not principal.may(role):
            raise Problem(
                403,
                f"this API key's role ({principal.role}) may not do this; it needs the "
                f"{role} role (BAGSERVE_API_KEYS entry {role}:KEY)",
                slug="forbidden",
            )
        return principal

    return check


async def caller(request: Request) -> Caller:
    """Who is asking, for the audit trail (after :func:`authenticate`)."""
    return Caller(
        request_id=request.state.request_id,
        key_id=getattr(request.state, "key_id", None),
        route=request.url.path,
    )


CallerDep = Annotated[Caller, Depends(caller)]


def lookup(registry: Registry, name: str, version: str | None) -> ModelEntry:
    """A served model version (the latest for ``None``), or 404 naming what exists."""
    entry = registry.get(name, version)
    if entry is None:
        if name in registry.entries:
            versions = [e.version for e in registry.versions(name)]
            raise Problem(
                404,
                f"model {name!r} has no version {version!r} (versions: {versions})",
                slug="unknown-version",
            )
        known = sorted(registry.entries)
        raise Problem(404, f"unknown model {name!r} (models: {known})", slug="unknown-model")
    return entry


#: The path parameters naming a model and a version (the examples name a demo model,
#: so that the OpenAPI document's examples work against ``bagserve demo``'s models).
ModelName = Annotated[
    str, Path(description="the model's name (its directory)", examples=["demo-dose"])
]
ModelVersion = Annotated[
    str, Path(description="a version of the model, or `latest`", examples=["1"])
]
#: What a route that needs a role answers to a key without it.
FORBIDDEN = {403: {"description": "the API key's role may not do this"}}


async def latest_entry(svc: ServicesDep, name: ModelName) -> ModelEntry:
    """The latest version of the model named in the path."""
    return lookup(svc.registry, name, None)


async def version_entry(svc: ServicesDep, name: ModelName, version: ModelVersion) -> ModelEntry:
    """The model version named in the path."""
    return lookup(svc.registry, name, version)


LatestEntry = Annotated[ModelEntry, Depends(latest_entry)]
VersionEntry = Annotated[ModelEntry, Depends(version_entry)]
