"""The job runner: a stored job through the prediction use-case, its answer stored.

A job is the same prediction as ``POST /v1/models/{name}/predict``, decoded from the
body and query stored at submission, audited under the job's own request id and API
key id, its JSON answer (or problem) stored with the job. With
``BAGSERVE_HL7_FORWARD`` the answer is also built into an HL7 v2 ``ORU^R01`` message
(with the patient and placer order numbers given at submission) and queued for
delivery in the same transaction that stores it (:mod:`.hl7_delivery`): the job is
finished then, the delivery runs apart.
"""

from __future__ import annotations

import asyncio
import time

from .codecs import BodySpec
from .encoders import encode_off_loop
from .errors import Problem
from .hl7 import Parties, new_control_id
from .hl7_delivery import DeliveryQueue
from .jobs import JobStore
from .options import PredictOptions
from .prediction import Caller, Predictor
from .registry import Registry
from .uploads import markers_param

__all__ = ["JobRunner"]


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
    deliveries : DeliveryQueue, optional
        Where answers are queued for HL7 forwarding (with ``BAGSERVE_HL7_FORWARD``).
    """

    def __init__(
        self,
        store: JobStore,
        registry: Registry,
        predictor: Predictor,
        deliveries: DeliveryQueue | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.predictor = predictor
        self.deliveries = deliveries

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
        answer = outcome.answer(meta["request_id"])
        document = await encode_off_loop(outcome.result, answer.document, cells=options.cells)
        settings, deliveries = self.predictor.settings, self.deliveries
        also = None
        if settings.hl7_forward and deliveries is not None:
            control_id = new_control_id()
            try:
                message = await encode_off_loop(
                    outcome.result,
                    answer.hl7,
                    coverage=options.coverage,
                    refs=meta.get("hl7"),
                    parties=Parties.from_settings(settings),
                    control_id=control_id,
                )
            except Problem as exc:  # placer order numbers that are not one per bag
                problem = {"status": exc.status, "detail": exc.detail, "errors": exc.errors}
                await asyncio.to_thread(store.finish, job_id, "failed", problem)
                return
            also = deliveries.enqueue(
                job_id,
                request_id=meta["request_id"],
                api_key_id=meta.get("api_key_id"),
                peer=settings.hl7_forward,
                control_id=control_id,
                message=message,
            )
        result = {"status": 200, **document}
        stored = await asyncio.to_thread(store.finish, job_id, "succeeded", result, also)
        if stored and also is not None and deliveries is not None:
            deliveries.wake()
