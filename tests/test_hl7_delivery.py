"""HL7 forwarding of jobs: a delivery queue apart from the jobs, against a laboratory
system (:mod:`tests.mllp_peer`, python-hl7) that accepts, errs, rejects, answers
garbage, drops the connection or never answers.

The service runs under uvicorn on 127.0.0.1 with ``BAGSERVE_HL7_FORWARD``; the queue
itself (claims, leases, bounds, restarts) is also tested without it, on SQLite and on
a real PostgreSQL (:mod:`tests.postgres`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hl7
import httpx
import pytest
from bagserve.core.demo import build_demo_models
from bagserve.service.database import Database
from bagserve.service.hl7_delivery import DeliveryQueue
from bagserve.service.mllp import Attempt

from .mllp_peer import Peer, mllp_peer
from .service_harness import running_service
from .test_fhir import DOSE_BAG
from .test_hl7 import HL7, segments
from .test_shared_state import fresh_database

#: A quick laboratory system: one-second tries, short waits between them.
FAST = {
    "BAGSERVE_HL7_TIMEOUT": "1",
    "BAGSERVE_HL7_BACKOFF": "0.05",
    "BAGSERVE_HL7_RETRIES": "2",
    "BAGSERVE_JOB_POLL": "0.1",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hl7-delivery") / "models"
    build_demo_models(directory)
    return directory


@pytest.fixture(scope="module")
def lab(models) -> Iterator[tuple[Peer, str]]:
    """A laboratory system and a service that forwards to it (one for the module; each
    test sets the script)."""
    with mllp_peer() as peer, running_service(models, BAGSERVE_HL7_FORWARD=peer.url, **FAST) as url:
        yield peer, url


def bags(*ids: str) -> dict[str, Any]:
    """The demo dose request with its one bag under each of ``ids``."""
    (bag,) = DOSE_BAG["bags"]
    return {"bags": [{**bag, "id": i} for i in ids]}


def submit(url: str, params: dict[str, Any], body: dict[str, Any] | None = None) -> str:
    r = httpx.post(
        f"{url}/v1/jobs", params={"model": "demo-dose", **params}, json=body or bags("s-1")
    )
    assert r.status_code == 202, r.text
    return r.headers["location"]


def poll(url: str, location: str, until: Any, timeout: float = 120.0) -> dict[str, Any]:
    """The job's state once ``until(state)`` holds (fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(f"{url}{location}").json()
        if until(state):
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def finished(state: dict[str, Any]) -> bool:
    return state["status"] in ("succeeded", "failed", "cancelled")


def settled(state: dict[str, Any]) -> bool:
    """Finished, and its delivery no longer pending (a forwarded job has one)."""
    if not finished(state):
        return False
    assert state["status"] != "succeeded" or "hl7" in state, state
    return state.get("hl7", {}).get("status") != "pending"


def tries_of(url: str, job_id: str, n: int) -> list[dict[str, Any]]:
    """The audit trail's ``hl7-forward`` records of a job, oldest first, once there
    are ``n`` (a try's record is appended just after its outcome is stored)."""
    deadline = time.monotonic() + 30
    while True:
        entries = httpx.get(f"{url}/v1/audit", params={"limit": 1000}).json()["entries"]
        mine = [e for e in entries if e.get("route") == "hl7-forward" and e.get("job") == job_id]
        if len(mine) >= n or time.monotonic() > deadline:
            return [e["hl7"] for e in reversed(mine)]
        time.sleep(0.05)


def test_a_forwarded_job_carries_patient_and_order_as_the_synchronous_door(lab):
    """PID, ORC and OBR-2 from the job's ``patient`` and ``order``, the same segments
    and values as ``Accept: application/hl7-v2`` answers the same request."""
    peer, url = lab
    peer.script[:] = []
    before = len(peer.received)
    params = {"patient": "MRN-9", "order": "ORD-9"}
    location = submit(url, params)
    assert poll(url, location, finished)["status"] == "succeeded"
    deadline = time.monotonic() + 60
    while len(peer.received) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    (forwarded,) = peer.received[before:]
    assert str(forwarded.segment("PID")[3]) == "MRN-9"
    (orc,), (obr,) = segments(forwarded, "ORC"), segments(forwarded, "OBR")
    assert str(orc[2]) == str(obr[2]) == "ORD-9"
    assert str(obr[3]).endswith("/s-1^bagserve")
    state = poll(url, location, settled)
    delivery = state["hl7"]
    assert delivery["status"] == "delivered" and delivery["ack"] == "AA"
    assert delivery["tries"] == 1 and delivery["error"] is None
    assert delivery["peer"] == peer.url
    assert str(forwarded.segment("MSH")[10]) == delivery["control_id"]
    r = httpx.post(
        f"{url}/v1/models/demo-dose/predict",
        json=bags("s-1"),
        params=params,
        headers={"accept": HL7},
    )
    assert r.status_code == 200, r.text
    answered = hl7.parse(r.text)
    assert [str(s[0]) for s in answered] == [str(s[0]) for s in forwarded]
    for name, fields in (("MSH", (3, 4, 5, 6, 9, 12)), ("PID", (3,)), ("ORC", (1, 2)),
                         ("OBR", (2, 4, 25)), ("OBX", (2, 3, 5, 6, 8, 11, 17, 18))):  # fmt: skip
        for k in fields:
            assert str(answered.segment(name)[k]) == str(forwarded.segment(name)[k]), (name, k)
    # The answer stored with the job is the JSON answer, as without forwarding.
    assert state["result"]["predictions"][0]["id"] == "s-1"
    (audited,) = tries_of(url, state["id"], 1)
    assert audited == {
        "peer": peer.url,
        "control_id": delivery["control_id"],
        "try": 1,
        "ack": "AA",
        "error": None,
        "status": "delivered",
    }


def test_patient_and_orders_are_checked_when_a_job_is_submitted(lab):
    peer, url = lab
    for params, why in (
        ({"patient": "MRN 9"}, "patient must be 1 to 64 letters"),
        ({"order": ["A-1", "A-1"]}, "order 'A-1' is given twice"),
        ({"order": "A|1"}, "order must be 1 to 64 letters"),
    ):
        r = httpx.post(f"{url}/v1/jobs", params={"model": "demo-dose", **params}, json=bags("s-1"))
        assert r.status_code == 422, (params, r.text)
        assert why in r.json()["detail"]
    # One order for two bags: the job fails saying why, and nothing is sent.
    before = len(peer.received)
    location = submit(url, {"order": "ORD-1"}, bags("s-1", "s-2"))
    state = poll(url, location, finished)
    assert state["status"] == "failed" and state["result"]["status"] == 422
    assert "1 placer order number(s) for 2 bag(s)" in state["result"]["detail"]
    assert "hl7" not in state and len(peer.received) == before
    # One per bag: each bag's OBR and ORC carries its own.
    location = submit(url, {"order": ["ORD-1", "ORD-2"]}, bags("s-1", "s-2"))
    state = poll(url, location, settled)
    assert state["hl7"]["status"] == "delivered"
    assert [str(o[2]) for o in segments(peer.received[-1], "OBR")] == ["ORD-1", "ORD-2"]
    assert [str(o[2]) for o in segments(peer.received[-1], "ORC")] == ["ORD-1", "ORD-2"]


@pytest.mark.parametrize(
    ("script", "status", "acks", "error"),
    [
        (["AA"], "delivered", ["AA"], None),
        (["AE", "AA"], "delivered", ["AE", "AA"], None),
        (["AR"], "undelivered", ["AR"], "AR: the peer says AR"),
        (["AE"] * 3, "undelivered", ["AE"] * 3, "AE: the peer says AE"),
        (["GARBAGE"] * 3, "undelivered", [None] * 3, "unreadable ACK"),
        (["DROP"] * 3, "undelivered", [None] * 3, "closed the connection before its ACK"),
        (["OTHER"] * 3, "undelivered", ["AA"] * 3, "ACK for another message"),
        (["SILENT"] * 3, "undelivered", [None] * 3, "no ACK within 1 s"),
    ],
)
def test_each_answer_of_the_laboratory_system_gives_its_delivery_state(
    lab, script, status, acks, error
):
    """Retried with backoff until accepted, refused (AR: not retried) or out of tries
    (BAGSERVE_HL7_RETRIES=2: three); the job is succeeded throughout; every try is in
    the audit trail with the message's control id, which every resend keeps."""
    peer, url = lab
    peer.script[:] = script
    before = len(peer.received)
    location = submit(url, {"patient": "MRN-1"})
    state = poll(url, location, settled)
    assert state["status"] == "succeeded" and state["result"]["predictions"]
    delivery = state["hl7"]
    assert (delivery["status"], delivery["ack"], delivery["tries"]) == (status, acks[-1], len(acks))
    if error is None:
        assert delivery["error"] is None
    else:
        assert error in delivery["error"]
    sent = peer.received[before:]
    assert len(sent) == len(acks) and peer.script == []
    assert {str(m.segment("MSH")[10]) for m in sent} == {delivery["control_id"]}
    assert {str(m) for m in sent} == {str(sent[0])}  # the same message each time
    audited = tries_of(url, state["id"], len(acks))
    assert [t["try"] for t in audited] == list(range(1, len(acks) + 1))
    assert [t["ack"] for t in audited] == acks
    assert {t["control_id"] for t in audited} == {delivery["control_id"]}
    assert [t["status"] for t in audited] == ["pending"] * (len(acks) - 1) + [status]


def test_a_silent_laboratory_system_holds_no_job_slot(models):
    """One job consumer (one worker) and a system that takes every message and never
    answers, with a minute per try: the jobs still finish at once, one after the
    other, their messages pending, and predictions go on."""
    with (
        mllp_peer(["SILENT"] * 100) as peer,
        running_service(
            models,
            BAGSERVE_WORKERS="1",
            BAGSERVE_HL7_FORWARD=peer.url,
            BAGSERVE_HL7_TIMEOUT="60",
            BAGSERVE_JOB_POLL="0.1",
        ) as url,
    ):
        locations = [submit(url, {"patient": f"MRN-{i}"}) for i in range(3)]
        # Each job takes well under a second here; a minute per try held in the job
        # slot would take minutes (the margin is wide for a loaded machine).
        deadline = time.monotonic() + 30
        states = [poll(url, at, finished, timeout=deadline - time.monotonic()) for at in locations]
        assert [s["status"] for s in states] == ["succeeded"] * 3
        assert [s["hl7"]["status"] for s in states] == ["pending"] * 3
        r = httpx.post(f"{url}/v1/models/demo-dose/predict", json=bags("now"), timeout=30)
        assert r.status_code == 200
        # One try at a time: the first message is being waited for, the others wait.
        assert len(peer.received) <= 1


def test_deliveries_not_yet_accepted_are_resent_after_a_restart(models, database, tmp_path):
    """A replica stops while its laboratory system is silent: the next one, on the same
    database, sends the pending message again (the same message, the same control id)
    until it is accepted."""
    db = fresh_database(database, tmp_path, "restart")
    env = {
        "BAGSERVE_DATABASE_URL": db,
        "BAGSERVE_HL7_TIMEOUT": "0.5",
        "BAGSERVE_HL7_BACKOFF": "0.1",
        "BAGSERVE_HL7_RETRIES": "20",
        "BAGSERVE_JOB_POLL": "0.1",
        "BAGSERVE_WORKERS": "1",
    }
    with mllp_peer(["SILENT"] * 1000) as peer:
        with running_service(
            models, BAGSERVE_HL7_FORWARD=peer.url, BAGSERVE_DATA_DIR=str(tmp_path / "a"), **env
        ) as first:
            location = submit(first, {"patient": "MRN-7", "order": "ORD-7"})
            state = poll(first, location, finished, timeout=60)
            assert state["status"] == "succeeded" and state["hl7"]["status"] == "pending"
            poll(first, location, lambda s: s["hl7"]["tries"] >= 2, timeout=60)
        tried = len(peer.received)
        peer.script[:] = []  # the laboratory system answers again
        with running_service(
            models, BAGSERVE_HL7_FORWARD=peer.url, BAGSERVE_DATA_DIR=str(tmp_path / "b"), **env
        ) as second:
            state = poll(second, location, settled, timeout=60)
            delivery = state["hl7"]
            assert delivery["status"] == "delivered" and delivery["tries"] > 2
            assert len(peer.received) > tried
            assert set(peer.control_ids()) == {delivery["control_id"]}
            assert str(peer.received[-1].segment("PID")[3]) == "MRN-7"
            audited = tries_of(second, state["id"], delivery["tries"])
            assert [t["try"] for t in audited] == list(range(1, delivery["tries"] + 1))
            assert audited[-1]["status"] == "delivered"


def test_claims_are_exclusive_leased_and_bounded(database, tmp_path):
    """The queue itself, without the service: 4 replicas claiming from 8 threads take
    each of 100 deliveries exactly once; a claim whose lease ran out is another's, and
    the first replica can no longer record it; retries and time are bounded; a
    restart gives what was not refused a new round; a stop hands claims back."""
    db = Database(fresh_database(database, tmp_path, "claims"), Path("."), pool_size=8)
    try:

        def queue(owner: str, **kw: Any) -> DeliveryQueue:
            kw = {"timeout": 30.0, "lease": 30.0, "backoff": 0.0, "retries": 2, **kw}
            return DeliveryQueue(db, owner=owner, **kw)

        def add(q: DeliveryQueue, job_id: str) -> None:
            with db.transaction() as cur:
                q.enqueue(job_id, request_id=f"r-{job_id}", api_key_id=None,
                          peer="mllp://127.0.0.1:9", control_id=f"C{job_id}",
                          message=f"MSH|^~\\&|||||||ORU^R01|C{job_id}|P|2.5.1\r")(cur)  # fmt: skip

        queues = [queue(f"r{i}") for i in range(4)]
        created = {f"j{k:03d}" for k in range(100)}
        for job in created:
            add(queues[0], job)
        taken: list[str] = []
        lock = threading.Lock()

        def drain(q: DeliveryQueue) -> None:
            while (d := q.claim()) is not None:
                with lock:
                    taken.append(d.job_id)
                assert q.record(d, Attempt("AA")) == "delivered"

        threads = [threading.Thread(target=drain, args=(q,)) for q in queues * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(taken) == sorted(created)  # every one, none twice
        assert queues[1].state("j007")["status"] == "delivered"

        # A lease that ran out: another replica takes the delivery over.
        short = [queue(f"p{i}", timeout=0.05, lease=0.0) for i in range(2)]
        add(short[0], "lease")
        claimed = short[0].claim()
        assert claimed is not None and short[1].claim() is None
        time.sleep(0.2)
        again = short[1].claim()
        assert again is not None and again.job_id == "lease"
        assert short[0].record(claimed, Attempt("AA")) is None  # no longer its own
        assert short[1].record(again, Attempt("AA")) == "delivered"

        # Bounded by tries (retries=2: three), by time, and refusals end at once.
        q = queues[0]
        add(q, "tries")
        for expected in ("pending", "pending", "undelivered"):
            d = q.claim()
            assert d is not None and q.record(d, Attempt(None, "no ACK")) == expected
        assert q.state("tries")["tries"] == 3 and q.claim() is None
        add(q, "refused")
        d = q.claim()
        assert d is not None and q.record(d, Attempt("AR", "AR: no")) == "undelivered"
        hurried = queue("h", give_up=0.0, backoff=1.0)
        add(hurried, "late")
        d = hurried.claim()
        assert d is not None and hurried.record(d, Attempt("AE", "AE: later")) == "undelivered"

        # A restart: what was not refused is pending again, with its tries from zero.
        assert q.requeue() == 2
        assert q.state("refused")["status"] == "undelivered"
        for job in ("tries", "late"):
            assert (q.state(job)["status"], q.state(job)["tries"]) == ("pending", 0)
        # A stop hands its claims back at once.
        assert q.claim() is not None and q.claim() is not None
        assert queues[1].claim() is None
        assert q.release() == 2
        assert queues[1].claim() is not None
        # Finished deliveries go with their jobs' ttl; pending ones never.
        assert queue("s", ttl=0.0).sweep() == 102
        assert q.state("j007") is None and q.state("late") is not None
    finally:
        db.close()
