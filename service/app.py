"""The FastAPI application: settings, lifespan (registry + worker pool), middleware, routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bagserve.core.signing import load_trusted_keys
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers, MutableHeaders, QueryParams
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bagserve import __version__

from .audit import AuditLog
from .database import Database
from .deps import Services, ServicesDep
from .errors import install_handlers
from .exposure import anonymous_exposure
from .file_import import import_files
from .group_commit import GroupCommit, prompt_threads
from .hl7_delivery import DeliveryQueue
from .idempotency import IdempotencyStore
from .job_runner import JobRunner
from .jobs import JobStore, replica_id
from .logs import configure_logging
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .model_stats import ModelStats
from .openapi_doc import install_openapi
from .pool import WorkerPool
from .prediction import Predictor
from .registry import Registry
from .repository import Repository
from .routes import health, jobs, repository, ui, v1, v2
from .security import ApiKeys
from .settings import Settings
from .uploads import Intake

__all__ = ["create_app"]

log = logging.getLogger("bagserve.http")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class RequestContext:
    """Request id, per-request metrics and the access log, as plain ASGI middleware.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware``
    relays the request body through extra tasks and streams, which cost a large upload
    about as much time again as uvicorn takes to receive it.
    """

    #: Paths of probes and scrapes: counted, but not logged unless ``log_probes``.
    PROBES = frozenset({"/healthz", "/readyz", "/metrics"})

    def __init__(self, app: ASGIApp, log_probes: bool = False) -> None:
        self.app = app
        self.log_probes = log_probes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        # request.state reads and writes scope["state"].
        state = scope.setdefault("state", {})
        state.update(request_id=request_id, key_id=None)
        status = 500
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = MutableHeaders(scope=message)
                headers["X-Request-ID"] = request_id
                # The app's own time for the request, beside the predict stages if any.
                total = f"app;dur={1000 * (time.perf_counter() - t0):.1f}"
                stages = headers.get("server-timing")
                headers["Server-Timing"] = f"{stages}, {total}" if stages else total
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            model = (scope.get("path_params") or {}).get("name") or (
                QueryParams(scope.get("query_string", b"")).get("model") or ""
            )
            scope["app"].state.metrics.requests.labels(
                getattr(route, "path", "unmatched"),
                model if route is not None else "",
                str(status),
            ).inc()
            if self.log_probes or scope["path"] not in self.PROBES:
                log.info(
                    "request",
                    extra={
                        "request_id": request_id,
                        "method": scope["method"],
                        "path": scope["path"],
                        "status": status,
                        "seconds": round(time.perf_counter() - t0, 6),
                        "api_key_id": state.get("key_id"),
                    },
                )


async def _reload_quietly(repository: Repository) -> None:
    """A reload asked for by a signal: its outcome goes to the log (nobody waits)."""
    try:
        await repository.load()
    except Exception:
        log.exception("reload on SIGHUP failed; the models served before are still served")


async def _sweep_keys(idempotency: IdempotencyStore) -> None:
    """Delete expired idempotency answers now and then (any replica may)."""
    while True:
        await asyncio.sleep(min(idempotency.ttl, 60.0))
        try:
            await asyncio.to_thread(idempotency.sweep)
        except Exception:
            log.exception("cannot sweep idempotency records")


def _lifespan(
    settings: Settings, auth: ApiKeys, app_metrics: Metrics, trusted: list[Any]
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the services started, the jobs and the key sweeper run, the
    models reloaded on SIGHUP; everything stopped in reverse at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started = await _start_services(settings, auth, app_metrics, trusted)
        svc, db, commits, owner = started.svc, started.db, started.commits, started.owner
        imported, requeued = started.imported, started.requeued
        pool, registry, repository = svc.pool, svc.registry, svc.repository
        store, deliveries, idempotency = svc.jobs, svc.deliveries, svc.idempotency
        predictor = svc.predictor

        async def start_jobs() -> None:
            # A job computed before its model is loaded would fail (503): jobs wait.
            await repository.started.wait()
            runner = JobRunner(store, registry, predictor, deliveries)
            store.start(runner, concurrency=settings.workers)

        jobs_starting = asyncio.get_running_loop().create_task(start_jobs())
        app.state.services = svc
        sweeper = asyncio.get_running_loop().create_task(_sweep_keys(idempotency))
        # SIGHUP: reload the models directory, as daemons reload their configuration.
        loop = asyncio.get_running_loop()
        reloads: set[asyncio.Task[Any]] = set()

        def on_hangup() -> None:
            task = loop.create_task(_reload_quietly(svc.repository))
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        with contextlib.suppress(NotImplementedError, RuntimeError):  # not on Windows
            loop.add_signal_handler(signal.SIGHUP, on_hangup)
        # At every start (not in create_app: `bagserve openapi` builds an app too), and
        # again in /readyz for whoever checks the deployment rather than the log.
        exposure = anonymous_exposure(settings)
        if exposure:
            log.warning(exposure, extra={"host": settings.host})
        log.info(
            "serving",
            extra={
                "models": [e.key for e in registry.all()],
                "workers": settings.workers,
                "database": db.where,
                "replica": owner,
                "jobs": await asyncio.to_thread(store.counts),
                "imported": imported,
                "hl7_requeued": requeued,
            },
        )
        try:
            with prompt_threads():
                yield
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGHUP)
            app.state.services = None
            sweeper.cancel()
            jobs_starting.cancel()
            await repository.stop()
            await store.stop()
            await deliveries.stop()
            await pool.stop()
            # Records still queued are committed before the database closes.
            await asyncio.to_thread(commits.close)
            await asyncio.to_thread(db.close)

    return lifespan


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; models load and workers start in the lifespan."""
    settings = settings or Settings()
    configure_logging(settings.log_format, settings.log_level)

    auth = ApiKeys(settings.api_keys)
    app_metrics = Metrics()
    # A key file that cannot be read stops the start-up here, naming it.
    trusted = load_trusted_keys(settings.trusted_keys) if settings.trusted_keys else []

    lifespan = _lifespan(settings, auth, app_metrics, trusted)

    app = FastAPI(
        title="bagserve",
        version=__version__,
        description=(
            "Predictions on bags of points (flow-cytometry samples and the like) from "
            "versioned models. Errors are RFC 9457 problem details."
        ),
        lifespan=lifespan,
        # Served by routes.ui from vendored assets (no CDN), for air-gapped networks.
        docs_url=None,
        redoc_url=None,
    )
    # The request middleware counts requests here, also before and after the lifespan.
    app.state.metrics = app_metrics
    install_handlers(app)
    install_openapi(app, settings)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "X-API-Key", "Content-Type", "X-Request-ID"],
            expose_headers=[
                "X-Request-ID",
                "X-Model-Name",
                "X-Model-Version",
                "X-Model-SHA256",
                "X-Input-SHA256",
            ],
        )

    app.add_middleware(RequestContext, log_probes=settings.log_probes)

    @app.get(
        "/metrics",
        tags=["health"],
        summary="Prometheus metrics",
        response_class=Response,
        responses={401: {"description": "BAGSERVE_METRICS_AUTH is on: an API key is needed"}},
    )
    async def metrics(request: Request, svc: ServicesDep) -> Response:
        """Request counts, stage timings, queue and worker gauges (Prometheus text).
        Open by default, like the probes; with ``BAGSERVE_METRICS_AUTH=true`` a scrape
        needs an API key of any role (Prometheus: ``authorization`` in its scrape
        configuration)."""
        if settings.metrics_auth:
            svc.auth.check(request)
        body = svc.metrics.render(svc.pool.status(), len(svc.registry.failures))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.mount("/static", ui.static_files(), name="static")
    # FastAPI tries the routers in this order, a route at a time (1–2 µs each,
    # twice per request): the prediction routes first, the pages and probes last.
    # Before v2: /v2/models/stats must not be read as the metadata of a model "stats".
    app.include_router(repository.router)
    app.include_router(v2.router)
    app.include_router(v1.router)
    app.include_router(jobs.router)
    app.include_router(health.router)
    app.include_router(ui.router)
    return app


@dataclass
class _Started:
    """What the lifespan started and must stop (the services hold the rest)."""

    svc: Services
    db: Database
    commits: GroupCommit
    owner: str
    imported: Any
    requeued: Any


async def _start_services(
    settings: Settings, auth: ApiKeys, app_metrics: Metrics, trusted: list[Any]
) -> _Started:
    """Everything the lifespan starts, in order: the workers (forked from the preloaded
    server, see WorkerPool) while the models are verified and the database opened;
    the models load in the background (Repository.start), and the server answers
    meanwhile: /readyz says what is still loading."""
    pool = WorkerPool(settings.workers, settings.queue_size, settings.request_limits().to_json())
    await pool.start()
    registry = await asyncio.to_thread(Registry, settings.models_dir, trusted)
    for key, reason in registry.failures.items():
        log.error("model not loaded", extra={"model": key, "reason": reason})
    repository = Repository(registry, pool)
    repository.start()
    data = Path(settings.data_dir)
    db = await asyncio.to_thread(
        Database,
        settings.database_url,
        data,
        pool_size=settings.database_pool,
        timeout=settings.database_timeout,
    )
    imported = await asyncio.to_thread(import_files, db, data, settings.audit_log)
    # One writer for the audit and idempotency records: the records of requests
    # that finish together share a transaction and its fsync.
    commits = GroupCommit(db, on_commit=app_metrics.observe_audit_commit)
    audit = AuditLog(db, writer=commits)
    stats = ModelStats()
    predictor = Predictor(settings, pool, app_metrics, audit, stats)
    owner = replica_id()
    idempotency = IdempotencyStore(
        db, settings.idempotency_ttl, lease=settings.lease, owner=owner, writer=commits
    )
    store = JobStore(
        db, settings.jobs_ttl, lease=settings.lease, poll=settings.job_poll, owner=owner
    )
    deliveries = DeliveryQueue(
        db,
        owner=owner,
        timeout=settings.hl7_timeout,
        retries=settings.hl7_retries,
        backoff=settings.hl7_backoff,
        give_up=settings.hl7_give_up,
        lease=settings.lease,
        poll=settings.job_poll,
        ttl=settings.jobs_ttl,
        audit=audit,
    )
    # Messages given up before this start get a new round of tries; the sender runs
    # whether or not forwarding is still configured: what was queued is sent.
    requeued = await asyncio.to_thread(deliveries.requeue)
    deliveries.start()
    svc = Services(
        settings=settings,
        auth=auth,
        metrics=app_metrics,
        registry=registry,
        pool=pool,
        predictor=predictor,
        audit=audit,
        idempotency=idempotency,
        jobs=store,
        deliveries=deliveries,
        repository=repository,
        stats=stats,
        intake=Intake(settings, pool),
    )
    return _Started(svc, db, commits, owner, imported, requeued)
