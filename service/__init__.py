"""bagserve service: a FastAPI app that serves saved models to lab pipelines.

One uvicorn process does the I/O; a fixed pool of worker processes
(:mod:`bagserve.service.pool`) holds the models, decodes and validates request bodies
(:mod:`.codecs`, :mod:`.tensors`, :mod:`.validation`) and does the math.

``create_app`` and ``Settings`` are imported on first use, so that the parts a lab
pipeline or an auditor needs alone (:mod:`.client`, :mod:`.audit`) do not load the web
framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .settings import Settings

__all__ = ["Settings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "Settings":
        from .settings import Settings

        return Settings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
