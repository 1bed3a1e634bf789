"""bagserve service: a FastAPI app that serves saved models to lab pipelines.

One uvicorn process does I/O, parsing and validation; a fixed pool of worker
processes (:mod:`bagserve.service.pool`) holds the models and does the math.
"""

from .app import create_app
from .settings import Settings

__all__ = ["Settings", "create_app"]
