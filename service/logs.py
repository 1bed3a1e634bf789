"""Structured logs: one JSON object per line (or plain text), with the request id."""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["configure_logging"]

_STANDARD = set(vars(logging.makeLogRecord({})))


class JsonFormatter(logging.Formatter):
    """One JSON object per log line: time, level, logger, message and the record's extras."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        doc = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(
            {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        )
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


#: Loggers of the server underneath, routed through the same handler: with
#: ``log_format=json`` every line on stderr is JSON, uvicorn's start-up and shutdown
#: lines included (its access log stays off: the service logs each request itself).
SERVER_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.asgi")


def configure_logging(fmt: str = "json", level: str = "info") -> None:
    """Send the ``bagserve`` and uvicorn loggers to stderr, as JSON lines
    (``fmt='json'``) or text."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    for name in ("bagserve", *SERVER_LOGGERS):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler] if name in ("bagserve", "uvicorn") else []
        logger.setLevel(level.upper())
        # uvicorn.error and uvicorn.asgi reach the handler through "uvicorn".
        logger.propagate = name not in ("bagserve", "uvicorn")
    access = logging.getLogger("uvicorn.access")
    access.handlers[:] = []
    access.propagate = False
    access.disabled = True
