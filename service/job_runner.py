"""The job runner: a stored job through the prediction use-case, its answer stored.

A job is the same prediction as ``POST /v1/models/{name}/predict``, decoded from the
body and query stored at submission, audited under the job's own request id and API
key id, its JSON answer (or problem) stored with the job.
"""

from __future__ import annotations

import asyncio

from .codecs import BodySpec
from .encoders import encode_document, encode_off_loop
from .errors import Problem
from .jobs import JobStore
from .options import PredictOptions
from .prediction import Caller, Predictor
from .registry import Registry
from .uploads import markers_param

__all__ = ["JobRunner"]


class JobRunner:
    """Computes one stored job (the :class:`~.jobs.JobStore` consumers call it).

    Parameters
    ----------
    store : JobStore
    registry : Registry
    predictor : Predictor
    """

    def __init__(self, store: JobStore, registry: Registry, predictor: Predictor) -> None:
        self.store = store
        self.registry = registry
        self.predictor = predictor

    async def __call__(self, job_id: str) -> None:
        store = self.store
        meta = await asyncio.to_thread(store.meta, job_id)
        entry = self.registry.get(meta["model"], meta["version"])
        if entry is None:
            detail = f"model {meta['model']}/{meta['version']} is no longer served"
            await asyncio.to_thread(
                store.finish, job_id, "failed", {"status": 404, "detail": detail}
            )
            return
        caller = Caller(meta["request_id"], meta.get("api_key_id"), f"/v1/jobs/{job_id}")
        body = await asyncio.to_thread(store.body, job_id)
        options = PredictOptions.from_json(meta.get("options"))
        spec = BodySpec(
            content_type=meta["content_type"],
            content_encoding=meta.get("content_encoding", ""),
            markers=markers_param(meta.get("markers")),
            default_id=meta.get("bag_id"),
        )
        try:
            # A body that breaks a limit fails here with its problem, in a worker: the
            # job is failed once and the replica goes on.
            outcome = await self.predictor.run(
                caller, entry, body, spec, options, request_sha256=meta["input_sha256"]
            )
        except Problem as exc:
            problem = {"status": exc.status, "detail": exc.detail, "errors": exc.errors}
            await asyncio.to_thread(store.finish, job_id, "failed", problem)
            return
        document = await encode_off_loop(
            outcome.result,
            encode_document,
            outcome.result,
            outcome.ids,
            outcome.provenance(meta["request_id"]),
            entry.info,
            inputs=outcome.inputs,
            cells=options.cells,
            plots=outcome.plots,
        )
        await asyncio.to_thread(store.finish, job_id, "succeeded", {"status": 200, **document})
