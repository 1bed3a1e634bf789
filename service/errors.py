"""RFC 9457 problem details: every error answers ``application/problem+json``.

The body lists every problem found (``errors``), carries the request id, and also has
an ``error`` string so clients of the Open Inference Protocol find what they expect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:  # the web framework is imported where it is used: the worker
    # processes raise and pass on problems without loading it.
    from fastapi import FastAPI, Request
    from starlette.responses import Response

__all__ = ["PROBLEM_JSON", "Problem", "ServiceError", "install_handlers", "problem_response"]

PROBLEM_JSON = "application/problem+json"

_TITLES = {
    400: "Bad request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    406: "Not acceptable",
    413: "Content too large",
    415: "Unsupported media type",
    422: "Unprocessable content",
    429: "Too many requests",
    500: "Internal server error",
    503: "Service unavailable",
    504: "Gateway timeout",
}


def _slug(status: int) -> str:
    return _TITLES.get(status, "error").lower().replace(" ", "-")


class ServiceError(Exception):
    """Root of every error the service raises on purpose (:class:`Problem`, the worker
    pool's errors)."""


class Problem(ServiceError):
    """An error to answer as problem details.

    Parameters
    ----------
    status : int
    detail : str
        One sentence for humans.
    errors : list of str, optional
        Every individual problem (e.g. one per bad bag).
    slug : str, optional
        Short machine name; the ``type`` is ``urn:bagserve:problem:<slug>``.
    headers : dict, optional
        Extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        errors: list[str] | None = None,
        slug: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.errors = list(errors or [])
        self.slug = slug or _slug(status)
        self.headers = dict(headers or {})


def problem_response(
    request: Request | None,
    status: int,
    detail: str,
    *,
    errors: list[str] | None = None,
    slug: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """The ``application/problem+json`` response for an error (with the request id).

    Under ``/v2`` (the Open Inference Protocol) the answer is ``application/json`` with
    the whole message in ``error``, as KServe's and Triton's clients read it; the
    problem-details fields are kept beside it.
    """
    from starlette.responses import Response

    request_id = getattr(request.state, "request_id", None) if request is not None else None
    oip = request is not None and request.url.path.startswith("/v2/")
    full = detail if not errors else f"{detail}: " + "; ".join(errors)
    body: dict[str, Any] = {
        "type": f"urn:bagserve:problem:{slug or _slug(status)}",
        "title": _TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
        "instance": None if request is None else request.url.path,
        "errors": list(errors or []),
        "error": full if oip else detail,
        "request_id": request_id,
    }
    hdrs = dict(headers or {})
    if request_id:
        hdrs["X-Request-ID"] = request_id
    media_type = "application/json" if oip else PROBLEM_JSON
    return Response(orjson.dumps(body), status_code=status, media_type=media_type, headers=hdrs)


def install_handlers(app: FastAPI) -> None:
    """Answer :class:`Problem`, request validation, HTTP and unexpected errors as
    problem details (an unexpected error's traceback goes to the log only)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> Response:
        return problem_response(
            request, exc.status, exc.detail, errors=exc.errors, slug=exc.slug, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        errors = [
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
            for e in exc.errors()
        ]
        return problem_response(
            request, 422, "the request is not valid", errors=errors, slug="invalid-request"
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        detail = (
            exc.detail if isinstance(exc.detail, str) else _TITLES.get(exc.status_code, "error")
        )
        return problem_response(
            request, exc.status_code, detail, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        # No internals in the answer; the log has the traceback with the request id.
        import logging

        from .database import unavailable

        logging.getLogger("bagserve").exception(
            "unhandled error", extra={"request_id": getattr(request.state, "request_id", None)}
        )
        if unavailable(exc):
            # Nothing is answered that could not be recorded (jobs, audit trail).
            return problem_response(
                request,
                503,
                "the state database (jobs, idempotency records, audit trail) does not "
                "answer; nothing was recorded, try again later",
                slug="database-unavailable",
                headers={"Retry-After": "5"},
            )
        return problem_response(request, 500, "internal error; the server log has the details")
