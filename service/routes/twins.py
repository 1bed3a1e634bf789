"""One handler for a model's latest version and for one version of it: twin routes.

Every route that acts on a model entry comes in two paths, ``/models/{name}/...`` (the
latest version) and ``/models/{name}/versions/{version}/...``, that differ only in how
the entry is looked up (:data:`~..deps.LatestEntry`, :data:`~..deps.VersionEntry`).
:func:`add_twins` registers one handler, written with ``entry: ModelEntry``, under both.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter

from ..deps import LatestEntry, VersionEntry

__all__ = ["Twin", "add_twins", "version_path"]


@dataclass(frozen=True)
class Twin:
    """How one of the two routes is named and described in the OpenAPI document.

    Attributes
    ----------
    name : str
        The route's name (its OpenAPI operation id is derived from it).
    summary : str
    description : str
        The operation's description.
    """

    name: str
    summary: str
    description: str


def version_path(path: str) -> str:
    """The one-version twin of a latest-version path: ``/models/{name}/ready`` ->
    ``/models/{name}/versions/{version}/ready``."""
    head = "/models/{name}"
    if not path.startswith(head):
        raise ValueError(f"a twin route's path starts with {head}, got {path!r}")
    return head + "/versions/{version}" + path[len(head) :]


def _endpoint(handler: Callable[..., Any], entry: Any, twin: Twin) -> Callable[..., Any]:
    """``handler`` with its ``entry`` parameter looked up by ``entry`` (a dependency)."""
    signature = inspect.signature(handler, eval_str=True)
    parameters = [
        p.replace(annotation=entry) if p.name == "entry" else p
        for p in signature.parameters.values()
    ]

    # The endpoints are coroutines, as the routes were: a plain handler runs on the
    # event loop, not in FastAPI's thread pool.
    if inspect.iscoroutinefunction(handler):

        @functools.wraps(handler)
        async def endpoint(**kwargs: Any) -> Any:
            return await handler(**kwargs)

    else:

        @functools.wraps(handler)
        async def endpoint(**kwargs: Any) -> Any:
            return handler(**kwargs)

    endpoint.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    endpoint.__name__ = endpoint.__qualname__ = twin.name
    endpoint.__doc__ = twin.description
    del endpoint.__wrapped__  # FastAPI reads the signature above, not the handler's
    return endpoint


def add_twins(
    router: APIRouter,
    method: str,
    path: str,
    handler: Callable[..., Any],
    *,
    latest: Twin,
    version: Twin,
    **options: Any,
) -> None:
    """Register ``handler`` under ``path`` (the latest version) and its
    :func:`version_path` (one version), with the same ``options``
    (:meth:`APIRouter.add_api_route`'s: dependencies, responses, ...)."""
    for twin, route_path, entry in (
        (latest, path, LatestEntry),
        (version, version_path(path), VersionEntry),
    ):
        router.add_api_route(
            route_path,
            _endpoint(handler, entry, twin),
            methods=[method],
            name=twin.name,
            summary=twin.summary,
            **options,
        )
