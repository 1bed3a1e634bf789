"""The baseline of bench_service.py: the FastAPI endpoint one writes first.

A pydantic ``list[list[float]]`` body, the model called in the event loop. Run by the
benchmark with ``BAGSERVE_NAIVE_MODEL=<artifact> uvicorn bench.naive_app:app``.

``/sink`` is the transport floor: it reads the raw body and answers its length, so the
benchmark can tell how much of bagserve's overhead is uvicorn receiving the bytes.
"""

from __future__ import annotations

import os

import numpy as np
from bagserve.core import load
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from pydantic import BaseModel

app = FastAPI()
model = load(os.environ["BAGSERVE_NAIVE_MODEL"])


class Bag(BaseModel):
    id: str = "bag"
    points: list[list[float]]


class Request(BaseModel):
    bags: list[Bag]


@app.post("/predict")
async def predict(request: Request) -> dict[str, list[float]]:
    bags = [np.asarray(b.points, dtype=np.float64) for b in request.bags]
    return {"predictions": model.predict(bags).tolist()}


@app.post("/sink")
async def sink(request: HTTPRequest) -> dict[str, int]:
    return {"bytes": len(await request.body())}
