"""A served model that predicts files the way :mod:`bagserve.cli.local` does locally."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .local import as_results

__all__ = ["RemoteModel", "remote_model"]


class RemoteModel:
    """A served model (``name`` or ``name/version`` at ``url``) that predicts files the
    way :func:`predict_files` does locally: asked for what the model gives (an interval
    where it gives one, the population summary of a per-cell model).

    The version is pinned when it is opened (``name`` alone: the latest then), so that
    every answer of one command or one table comes from the same model; ``layout`` is
    the columns of its table answers (:class:`~bagserve.service.tables.TableLayout`).
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        interval: float | None = 0.9,
        cells: bool = False,
        compensated: bool = False,
    ) -> None:
        import os

        from ..service.client import Client
        from ..service.options import PredictOptions
        from ..service.tables import TableLayout

        self.url, self.model = url, model
        self.name, _, version = model.partition("/")
        self.client = Client(url, api_key=api_key or os.environ.get("BAGSERVE_API_KEY"))
        try:
            described = self._call(self.client.model, self.name)
        except Exception:
            self.client.close()
            raise
        self.version = version or str(described.get("latest"))
        about = next(
            (v for v in described.get("versions", []) if v.get("version") == self.version), None
        )
        if about is None:
            self.client.close()
            raise ValueError(f"unknown model {self.name}/{self.version} at {url}")
        self.options = PredictOptions.asked_of(
            about, coverage=interval, cells=cells, compensated=compensated
        )
        self.layout = TableLayout.of(about, self.options)
        self.sha256 = str(about.get("sha256", ""))
        self.markers: list[str] = list((about.get("panel") or {}).get("markers") or [])
        self.params: dict[str, str] = {}
        if about.get("kind") == "cell":
            self.params["cells"] = "true" if cells else "false"
        elif self.options.coverage is not None:
            self.params["interval"] = str(self.options.coverage)
        if compensated:
            self.params["compensated"] = "true"

    def __enter__(self) -> RemoteModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        from ..service.client import BagserveError

        try:
            return method(*args, **kwargs)
        except BagserveError as exc:
            if exc.status == 404:
                # Say what is missing, and what the service has instead.
                detail = exc.problem.get("detail", exc)
                raise ValueError(f"unknown model {self.model!r} at {self.url}: {detail}") from exc
            raise ValueError(str(exc)) from exc

    def oru(self, files: Sequence[str | Path], refs: dict[str, Any] | None = None) -> str:
        """The service's HL7 v2 ORU^R01 message for ``files`` (one request); ``refs``:
        ``patient`` and ``orders`` (one per file)."""
        refs = dict(refs or {})
        params: dict[str, Any] = dict(self.params)
        if "patient" in refs:
            params["patient"] = refs["patient"]
        if refs.get("orders"):
            params["order"] = list(refs["orders"])
        message = self._call(
            self.client.predict_files_as,
            self.name,
            files,
            "application/hl7-v2",
            version=self.version,
            params=params,
        )
        return message.decode("utf-8")

    def table_csv(self, files: Sequence[str | Path | tuple[str, bytes]]) -> str:
        """The service's ``text/csv`` answer for ``files`` (paths, or name and bytes),
        one request; :class:`~bagserve.service.client.BagserveError` as it failed."""
        answer = self.client.predict_files_as(
            self.name, files, "text/csv", version=self.version, params=self.params
        )
        return answer.decode("utf-8")

    def predict(self, files: Sequence[str | Path]) -> dict[str, Any]:
        """The service's answer for ``files`` (one request), keyed by file."""
        answer = self._call(
            self.client.predict_files,
            self.name,
            files,
            version=self.version,
            params=self.params,
        )
        return as_results(answer, [str(f) for f in files])


def remote_model(args: argparse.Namespace) -> RemoteModel:
    """The served model a command's ``--url`` and MODEL name (``name[/version]``)."""
    return RemoteModel(
        args.url,
        args.model,
        api_key=args.api_key,
        interval=args.interval,
        cells=getattr(args, "cells", False),
        compensated=args.compensated,
    )
