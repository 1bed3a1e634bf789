"""The job runner: a stored job through the prediction use-case, its answer stored.

A job is the same prediction as ``POST /v1/models/{name}/predict``, decoded from the
body and query stored at submission, audited under the job's own request id and API
key id, its JSON answer (or problem) stored with the job. With
``BAGSERVE_HL7_FORWARD`` the answer also goes to a laboratory system as an HL7 v2
``ORU^R01`` message over MLLP before the job is finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .codecs import BodySpec
from .encoders import encode_document, encode_off_loop
from .errors import Problem
from .hl7 import Parties, oru_r01
from .jobs import JobStore
from .mllp import MllpError, send
from .options import PredictOptions
from .prediction import Caller, Predictor
from .registry import Registry
from .uploads import markers_param

__all__ = ["JobRunner"]

log = logging.getLogger("bagserve.jobs")

#: How long a job waits out refusals that pass (503: every worker busy and the queue
#: full, the model still being loaded into the workers, a worker being replaced) before
#: it fails with the last one; the wait between tries doubles from 50 ms up to 2 s.
TRANSIENT_PATIENCE = 300.0


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
        deadline = time.monotonic() + TRANSIENT_PATIENCE
        pause = 0.05
        while True:
            try:
                # A body that breaks a limit fails here with its problem, in a worker:
                # the job is failed once and the replica goes on.
                outcome = await self.predictor.run(
                    caller, entry, body, spec, options, request_sha256=meta["input_sha256"]
                )
                break
            except Problem as exc:
                if exc.status == 503 and time.monotonic() + pause < deadline:
                    # A stored job was accepted already: it waits its turn (each refused
                    # try is audited as such) instead of failing for a busy moment.
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, 2.0)
                    continue
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
        peer = self.predictor.settings.hl7_forward
        if peer:
            try:
                document["hl7"] = await self._forward(job_id, meta, entry, outcome, options, peer)
            except Problem as exc:  # placer order numbers that are not one per bag
                problem = {"status": exc.status, "detail": exc.detail, "errors": exc.errors}
                await asyncio.to_thread(store.finish, job_id, "failed", problem)
                return
        await asyncio.to_thread(store.finish, job_id, "succeeded", {"status": 200, **document})

    async def _forward(
        self,
        job_id: str,
        meta: dict[str, Any],
        entry: Any,
        outcome: Any,
        options: PredictOptions,
        peer: str,
    ) -> dict[str, Any]:
        """Send the job's answer as an HL7 v2 ORU^R01 message to the MLLP ``peer``
        (``BAGSERVE_HL7_FORWARD``), retried as :func:`.hl7.send` does; the outcome is
        logged, audited and kept in the job's result (``hl7``)."""
        settings = self.predictor.settings
        message = oru_r01(
            outcome.result,
            outcome.ids,
            outcome.provenance(meta["request_id"]),
            entry.info,
            inputs=outcome.inputs,
            coverage=options.coverage,
            refs=meta.get("hl7"),
            acquired=outcome.acquired,
            parties=Parties.from_settings(settings),
        )
        record: dict[str, Any] = {"peer": peer}
        try:
            ack = await asyncio.to_thread(
                send, message, peer, timeout=settings.hl7_timeout, retries=settings.hl7_retries,
                backoff=settings.hl7_backoff, log=log,
            )  # fmt: skip
        except MllpError as exc:
            log.error("job %s: HL7 forwarding failed: %s", job_id, exc)
            record.update(delivered=False, ack=exc.code, error=str(exc))
        else:
            record.update(delivered=True, ack=ack.code, attempts=ack.attempts)
        audit = self.predictor.audit_log
        if audit is not None:
            await asyncio.to_thread(
                audit.append,
                request_id=meta["request_id"],
                api_key_id=meta.get("api_key_id"),
                route="hl7-forward",
                job=job_id,
                hl7=record,
            )
        return record
