"""A small httpx client for lab pipelines: predict from arrays or files, with retries.

::

    from bagserve.service.client import Client

    with Client("http://127.0.0.1:8000", api_key="...") as c:
        result = c.predict("demo-dose", [cells], markers=["FSC-A", "SSC-A", "GFP"])
        result = c.predict_files("demo-dose", ["patient17.fcs"])

A 503 or 429 answer is retried with exponential backoff (honouring ``Retry-After``),
as are connection errors; every other error raises :class:`BagserveError` carrying the
problem details the service sent.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

# numpy is imported by the two calls that encode arrays: a pipeline that sends files,
# or only lists models, starts without it (and a caller with arrays has it loaded).
if TYPE_CHECKING:
    import numpy as np

__all__ = ["AsyncClient", "BagserveError", "Client"]

RETRY_STATUS = (429, 503)


class BagserveError(Exception):
    """An error answer from the service (or no answer after every retry).

    Attributes
    ----------
    status : int or None
    problem : dict
        The RFC 9457 body (``detail``, ``errors``, ``request_id``, ...).
    """

    def __init__(
        self, message: str, status: int | None = None, problem: dict[str, Any] | None = None
    ):
        super().__init__(message)
        self.status = status
        self.problem = problem or {}


def _json_body(
    bags: Sequence[np.ndarray], markers: Sequence[str] | None, ids: Sequence[str] | None
) -> bytes:
    import numpy as np
    import orjson

    items = []
    for i, b in enumerate(bags):
        # orjson serialises only C-contiguous arrays: a column slice or a transposed
        # array is copied into that layout (a C-contiguous float64 one is not copied).
        arr = np.ascontiguousarray(b, dtype=np.float64)
        item: dict[str, Any] = {"id": ids[i] if ids else f"bag-{i}", "points": arr}
        if markers is not None:
            item["markers"] = list(markers)
        items.append(item)
    return orjson.dumps({"bags": items}, option=orjson.OPT_SERIALIZE_NUMPY)


def _files(
    files: Sequence[str | Path | tuple[str, bytes]],
) -> list[tuple[str, tuple[str, bytes, str]]]:
    """Multipart parts of files: paths (read here, named by their file names), or a
    name and the bytes already read (sent as they were hashed)."""
    parts = []
    for f in files:
        name, data = f if isinstance(f, tuple) else (Path(f).name, Path(f).read_bytes())
        parts.append(("files", (name, data, "application/octet-stream")))
    return parts


def _path(model: str, version: str | None) -> str:
    return (
        f"/v1/models/{model}/predict"
        if version is None
        else f"/v1/models/{model}/versions/{version}/predict"
    )


def _raise_for(response: httpx.Response) -> dict[str, Any]:
    if response.status_code < 400:
        return response.json()
    try:
        problem = response.json()
    except ValueError:
        problem = {"detail": response.text}
    detail = problem.get("detail") or problem.get("error") or response.reason_phrase
    errors = problem.get("errors") or []
    message = f"{response.status_code}: {detail}" + (f" ({'; '.join(errors)})" if errors else "")
    raise BagserveError(message, response.status_code, problem)


def _content(response: httpx.Response) -> bytes:
    """A non-JSON answer's bytes, or its error raised."""
    if response.status_code >= 400:
        _raise_for(response)
    return response.content


def _delay(response: httpx.Response | None, attempt: int, backoff: float) -> float:
    if response is not None:
        retry_after = response.headers.get("retry-after", "")
        if retry_after.isdigit():
            return float(retry_after)
    return backoff * 2**attempt


def _retry_delay(
    attempt: int,
    retries: int,
    backoff: float,
    response: httpx.Response | None,
    error: httpx.TransportError | None,
) -> float | None:
    """Seconds to wait before trying again after ``attempt`` (0-based) gave
    ``response`` or ``error``; None when ``response`` is the answer. Raises
    :class:`BagserveError` when the last attempt got no answer."""
    if error is not None:
        if attempt == retries:
            raise BagserveError(f"no answer from the service: {error}") from error
        return _delay(None, attempt, backoff)
    assert response is not None
    if response.status_code not in RETRY_STATUS or attempt == retries:
        return None
    return _delay(response, attempt, backoff)


@dataclass(frozen=True)
class _Call:
    """One request of the API, as both clients send it (``kwargs`` for httpx)."""

    method: str
    url: str
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Calls:
    """The requests of the API, built once for :class:`Client` and :class:`AsyncClient`
    (which differ only in how they send them)."""

    @staticmethod
    def models() -> _Call:
        return _Call("GET", "/v1/models")

    @staticmethod
    def model(name: str) -> _Call:
        return _Call("GET", f"/v1/models/{name}")

    @staticmethod
    def predict(
        model: str,
        bags: Sequence[np.ndarray],
        markers: Sequence[str] | None,
        ids: Sequence[str] | None,
        version: str | None,
    ) -> _Call:
        return _Call(
            "POST",
            _path(model, version),
            {
                "content": _json_body(bags, markers, ids),
                "headers": {"Content-Type": "application/json"},
            },
        )

    @staticmethod
    def predict_npy(
        model: str, cells: np.ndarray, markers: Sequence[str] | None, version: str | None
    ) -> _Call:
        import numpy as np

        buf = io.BytesIO()
        np.save(buf, np.asarray(cells, dtype=np.float64), allow_pickle=False)
        params = {"markers": ",".join(markers)} if markers else None
        return _Call(
            "POST",
            _path(model, version),
            {
                "content": buf.getvalue(),
                "params": params,
                "headers": {"Content-Type": "application/x-npy"},
            },
        )

    @staticmethod
    def predict_files(
        model: str,
        paths: Sequence[str | Path | tuple[str, bytes]],
        version: str | None,
        params: Mapping[str, Any] | None,
        accept: str | None = None,
    ) -> _Call:
        kwargs: dict[str, Any] = {"files": _files(paths), "params": params}
        if accept is not None:
            kwargs["headers"] = {"accept": accept}
        return _Call("POST", _path(model, version), kwargs)


class Client:
    """Synchronous client. ``retries`` extra attempts on 503/429 and connection errors."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        retries: int = 4,
        backoff: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=base_url, headers=headers, timeout=timeout, transport=transport
        )
        self.retries = retries
        self.backoff = backoff

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _send(self, call: _Call) -> httpx.Response:
        attempt = 0
        while True:
            response, error = None, None
            try:
                response = self._http.request(call.method, call.url, **call.kwargs)
            except httpx.TransportError as exc:
                error = exc
            delay = _retry_delay(attempt, self.retries, self.backoff, response, error)
            if delay is None:
                assert response is not None
                return response
            time.sleep(delay)
            attempt += 1

    def models(self) -> dict[str, Any]:
        """Every served model with its versions (``GET /v1/models``)."""
        return _raise_for(self._send(_Calls.models()))

    def model(self, name: str) -> dict[str, Any]:
        """One model: its latest version and every version's description
        (``GET /v1/models/{name}``)."""
        return _raise_for(self._send(_Calls.model(name)))

    def predict(
        self,
        model: str,
        bags: Sequence[np.ndarray],
        *,
        markers: Sequence[str] | None = None,
        ids: Sequence[str] | None = None,
        version: str | None = None,
    ) -> dict[str, Any]:
        """Predict bags given as arrays (cells x markers), sent as JSON."""
        return _raise_for(self._send(_Calls.predict(model, bags, markers, ids, version)))

    def predict_npy(
        self,
        model: str,
        cells: np.ndarray,
        *,
        markers: Sequence[str] | None = None,
        version: str | None = None,
    ) -> dict[str, Any]:
        """Predict one bag sent as NPY (the fastest encoding)."""
        return _raise_for(self._send(_Calls.predict_npy(model, cells, markers, version)))

    def predict_files(
        self,
        model: str,
        paths: Sequence[str | Path],
        *,
        version: str | None = None,
        params: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Predict sample files (FCS, CSV, TSV, NPY), one bag each, in one request;
        ``params``: query parameters (``interval``, ``compensated``, ``cells``, ...)."""
        return _raise_for(self._send(_Calls.predict_files(model, paths, version, params)))

    def predict_files_as(
        self,
        model: str,
        paths: Sequence[str | Path | tuple[str, bytes]],
        accept: str,
        *,
        version: str | None = None,
        params: Mapping[str, str | Sequence[str]] | None = None,
    ) -> bytes:
        """The answer for ``paths`` (or name and bytes pairs) in another format than
        JSON (``accept``: text/csv, application/hl7-v2, application/fhir+json, ...), as
        bytes; a list in ``params`` is a repeated parameter (``order=A&order=B``)."""
        return _content(self._send(_Calls.predict_files(model, paths, version, params, accept)))


class AsyncClient:
    """Asynchronous twin of :class:`Client`: the same requests and retries
    (:class:`_Calls`, :func:`_retry_delay`), sent without blocking."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        retries: int = 4,
        backoff: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=timeout, transport=transport
        )
        self.retries = retries
        self.backoff = backoff

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _send(self, call: _Call) -> httpx.Response:
        attempt = 0
        while True:
            response, error = None, None
            try:
                response = await self._http.request(call.method, call.url, **call.kwargs)
            except httpx.TransportError as exc:
                error = exc
            delay = _retry_delay(attempt, self.retries, self.backoff, response, error)
            if delay is None:
                assert response is not None
                return response
            await asyncio.sleep(delay)
            attempt += 1

    async def models(self) -> dict[str, Any]:
        """Every served model with its versions (``GET /v1/models``)."""
        return _raise_for(await self._send(_Calls.models()))

    async def model(self, name: str) -> dict[str, Any]:
        """One model: its latest version and every version's description
        (``GET /v1/models/{name}``)."""
        return _raise_for(await self._send(_Calls.model(name)))

    async def predict(
        self,
        model: str,
        bags: Sequence[np.ndarray],
        *,
        markers: Sequence[str] | None = None,
        ids: Sequence[str] | None = None,
        version: str | None = None,
    ) -> dict[str, Any]:
        """Predict bags (2-D arrays, one per sample); see :meth:`Client.predict`."""
        return _raise_for(await self._send(_Calls.predict(model, bags, markers, ids, version)))

    async def predict_files(
        self,
        model: str,
        paths: Sequence[str | Path],
        *,
        version: str | None = None,
        params: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Predict sample files (FCS, CSV, TSV, NPY), one bag each, as multipart."""
        return _raise_for(await self._send(_Calls.predict_files(model, paths, version, params)))
