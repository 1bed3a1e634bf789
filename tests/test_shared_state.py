"""Replicas that share state: jobs, idempotency and the audit chain in one database.

Two real replicas (``bagserve serve`` under uvicorn on 127.0.0.1) share a database,
SQLite (one file, replicas on one host) or PostgreSQL (a private server from Debian's
packages, :mod:`tests.postgres`); each case runs on both. A replica's death is a
SIGKILL of its process.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from bagserve.core.demo import demo_samples
from bagserve.service.audit import AuditLog, verify
from bagserve.service.database import Database
from bagserve.service.jobs import JobStore

from .postgres import postgres_server
from .service_harness import build_models, running_service

EXE = str(Path(sys.executable).parent / "bagserve")
#: Short leases so that a dead replica's job is taken over within seconds.
REPLICA_ENV = {"BAGSERVE_LEASE": "2", "BAGSERVE_JOB_POLL": "0.1", "BAGSERVE_WORKERS": "1"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return build_models(tmp_path_factory.mktemp("shared") / "models")


@pytest.fixture(scope="module")
def replicas(models, database, tmp_path_factory) -> Iterator[list[str]]:
    """Two replicas per database, for the module (the failover case, last, kills one)."""
    env = {**REPLICA_ENV, "BAGSERVE_DATABASE_URL": database}
    tmp = tmp_path_factory.mktemp("replicas")
    with (
        running_service(models, BAGSERVE_DATA_DIR=str(tmp / "a"), **env) as a,
        running_service(models, BAGSERVE_DATA_DIR=str(tmp / "b"), **env) as b,
    ):
        yield [a, b]


def dose_body(seed: int) -> dict:
    bags, _, markers = demo_samples("dose", 1, seed)
    return {"bags": [{"markers": markers, "points": np.asarray(bags[0]).tolist()}]}


def poll(url: str, location: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}{location}", timeout=30).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise TimeoutError(location)


def audit_of(database: str) -> AuditLog:
    return AuditLog(Database(database, Path("."), pool_size=1))


def records(database: str) -> list[dict]:
    log = audit_of(database)
    try:
        return log.recent(100_000)
    finally:
        log.db.close()


def test_idempotent_replays_across_replicas(replicas, database):
    body = dose_body(1)
    key = {"Idempotency-Key": f"order-{time.time_ns()}"}
    first = httpx.post(
        f"{replicas[0]}/v1/models/demo-dose/predict", json=body, headers=key, timeout=60
    )
    again = httpx.post(
        f"{replicas[1]}/v1/models/demo-dose/predict", json=body, headers=key, timeout=60
    )
    assert first.status_code == again.status_code == 200
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.content == first.content
    # The same key with another body, on either replica: refused.
    other = dose_body(2)
    for url in replicas:
        r = httpx.post(f"{url}/v1/models/demo-dose/predict", json=other, headers=key, timeout=60)
        assert r.status_code == 422 and r.json()["type"].endswith("idempotency-key-reused")
    # Concurrent first requests with one key on both replicas: computed once.
    key = {"Idempotency-Key": f"race-{time.time_ns()}"}
    answers: list[httpx.Response] = []

    def call(url: str) -> None:
        answers.append(
            httpx.post(f"{url}/v1/models/demo-dose/predict", json=body, headers=key, timeout=60)
        )

    threads = [threading.Thread(target=call, args=(u,)) for u in replicas * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {r.status_code for r in answers} == {200}
    assert len({r.content for r in answers}) == 1
    computed = [r for r in answers if r.headers.get("idempotent-replayed") != "true"]
    assert len(computed) == 1
    request_id = computed[0].headers["x-request-id"]
    assert [r["request_id"] for r in records(database)].count(request_id) == 1


def test_a_job_submitted_to_one_is_read_from_the_other(replicas):
    r = httpx.post(
        f"{replicas[0]}/v1/jobs", params={"model": "demo-dose"}, json=dose_body(3), timeout=30
    )
    assert r.status_code == 202, r.text
    location = r.headers["location"]
    job = poll(replicas[1], location)
    assert job["status"] == "succeeded"
    direct = httpx.post(
        f"{replicas[1]}/v1/models/demo-dose/predict", json=dose_body(3), timeout=60
    ).json()
    assert job["result"]["predictions"] == direct["predictions"]
    assert httpx.get(f"{replicas[0]}{location}").json() == job
    # Cancelling through one replica is seen by the other.
    slow = {"bags": [{"points": np.random.default_rng(0).normal(size=(30_000, 3)).tolist()}]}
    locations = [
        httpx.post(f"{u}/v1/jobs", params={"model": "slow"}, json=slow, timeout=30).headers[
            "location"
        ]
        for u in replicas
    ]
    for loc in locations:
        assert httpx.delete(f"{replicas[1]}{loc}").json()["status"] == "cancelled"
    for loc in locations:
        assert poll(replicas[0], loc)["status"] == "cancelled"


def test_concurrent_submissions_lose_nothing_and_run_once(replicas, database, tmp_path):
    body = dose_body(4)
    locations: list[tuple[str, str]] = []
    lock = threading.Lock()

    def submit(url: str, n: int) -> None:
        with httpx.Client(timeout=30) as client:
            for _ in range(n):
                r = client.post(f"{url}/v1/jobs", params={"model": "demo-dose"}, json=body)
                assert r.status_code == 202, r.text
                with lock:
                    locations.append((url, r.headers["location"]))

    threads = [threading.Thread(target=submit, args=(u, 15)) for u in replicas for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(locations) == 60 and len({loc for _, loc in locations}) == 60
    for i, (_, loc) in enumerate(locations):
        job = poll(replicas[i % 2], loc)
        assert job["status"] == "succeeded" and job["attempts"] == 1, job
    # Each job computed (and audited) exactly once, by one replica or the other; a try
    # the workers refused for a busy moment (503) is audited as such and tried again;
    # each poll that read its result is audited as such.
    attempts = [(r["route"], r["status"]) for r in records(database) if "action" not in r]
    reads = [r["job"]["id"] for r in records(database) if r.get("action") == "job-result"]
    for _, loc in locations:
        statuses = [status for route, status in attempts if route == loc]
        assert statuses.count(200) == 1 and set(statuses) <= {200, 503}, (loc, statuses)
        assert reads.count(loc.rsplit("/", 1)[1]) >= 1, loc
    # The one chain verifies after all of the above, from the database and exported.
    where = ["--database", database]
    out = subprocess.run([EXE, "audit", "verify", *where], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ok: "), out.stderr
    exported = tmp_path / "audit.jsonl"
    out = subprocess.run(
        [EXE, "audit", "export", str(exported), *where], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert verify(exported).ok
    assert verify(exported).lines >= 60


def test_the_other_replica_finishes_a_dead_replicas_job(replicas, database):
    slow = {"bags": [{"points": np.random.default_rng(1).normal(size=(10_000, 3)).tolist()}]}
    location = httpx.post(
        f"{replicas[0]}/v1/jobs", params={"model": "slow"}, json=slow, timeout=30
    ).headers["location"]
    job_id = location.rsplit("/", 1)[1]
    # Wait until some replica runs it, then kill that one.
    deadline = time.monotonic() + 60
    while (state := httpx.get(f"{replicas[1]}{location}").json())["status"] != "running":
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    owner = running_owner(database, job_id)
    victim = next(u for u in replicas if str(u.pid) == owner.split(":")[1])
    survivor = next(u for u in replicas if u != victim)
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    job = poll(survivor, location)
    assert job["status"] == "succeeded", job
    assert job["attempts"] == 2  # started by the dead replica, finished by the survivor
    print(f"failover: the job finished {time.monotonic() - t0:.1f} s after the SIGKILL")
    assert running_owner(database, job_id) is None
    # The chain verifies after all of it, the takeover included.
    out = subprocess.run(
        [EXE, "audit", "verify", "--database", database], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def running_owner(database: str, job_id: str) -> str | None:
    db = Database(database, Path("."), pool_size=1)
    try:
        with db.transaction(write=False) as cur:
            row = cur.execute("SELECT owner FROM jobs WHERE id = %s", (job_id,)).fetchone()
        return None if row is None else row[0]
    finally:
        db.close()


def fresh_database(database: str, tmp_path: Path, name: str) -> str:
    """An empty database on the same engine (and server) as ``database``: the module's
    replicas claim every job in theirs."""
    if database.startswith("sqlite"):
        return f"sqlite:///{tmp_path / (name + '.sqlite3')}"
    import psycopg

    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return database.rsplit("/", 1)[0] + f"/{name}"


def test_claims_are_exclusive_and_a_poison_job_is_failed(database, tmp_path):
    """The queue itself, without the service: 4 stores (replicas) claiming from 8 threads
    take each of 200 jobs exactly once; a job whose lease keeps running out is failed
    after ``max_attempts`` runs."""
    db = Database(fresh_database(database, tmp_path, "claims"), Path("."), pool_size=8)
    try:
        stores = [JobStore(db, 3600, lease=30, owner=f"r{i}") for i in range(4)]
        created = {stores[0].create(b"x", model="m", version="1")["id"] for _ in range(200)}
        taken: list[str] = []
        lock = threading.Lock()

        def drain(store: JobStore) -> None:
            while (job := store.claim()) is not None:
                with lock:
                    taken.append(job)
                assert store.finish(job, "succeeded", {"status": 200})

        threads = [threading.Thread(target=drain, args=(s,)) for s in stores * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(taken) == sorted(created)  # every job, none twice
        # A finish by a replica that no longer owns the job is refused.
        job = stores[0].create(b"x", model="m", version="1")["id"]
        short = [JobStore(db, 3600, lease=0.05, owner=f"p{i}", max_attempts=2) for i in range(3)]
        assert short[0].claim() == job
        time.sleep(0.1)
        assert short[1].claim() == job  # taken over: the lease ran out
        assert not short[0].finish(job, "succeeded", {"status": 200})
        assert not short[0].renew(job)
        time.sleep(0.1)
        assert short[2].claim() is None  # two runs died: failed, not run a third time
        meta, result = short[2].view(job)
        assert meta["status"] == "failed" and meta["attempts"] == 2
        assert "abandoned" in result["detail"]
    finally:
        db.close()


def test_readiness_follows_the_database(models, tmp_path):
    """A replica whose database is gone is not ready (nginx and orchestrators route
    around it) and refuses what it cannot record, with a clear problem."""
    with postgres_server() as pg:
        env = {**REPLICA_ENV, "BAGSERVE_DATABASE_URL": pg}
        with running_service(models, BAGSERVE_DATA_DIR=str(tmp_path / "d"), **env) as url:
            ready = httpx.get(f"{url}/readyz", timeout=10)
            assert ready.status_code == 200 and ready.json()["database"] == "ok"
            pg.stop()
            # Each is noticed within the database timeout (2 s; it took 10 s before),
            # with half a second for a loaded machine.
            t0 = time.perf_counter()
            down = httpx.get(f"{url}/readyz", timeout=10)
            assert time.perf_counter() - t0 < 2.5
            assert down.status_code == 503
            assert down.json()["database"].startswith("unreachable:")
            assert (
                "the state database (jobs, audit trail) does not answer" in (down.json()["reasons"])
            )
            t0 = time.perf_counter()
            r = httpx.post(
                f"{url}/v1/jobs", params={"model": "demo-dose"}, json=dose_body(1), timeout=30
            )
            assert time.perf_counter() - t0 < 2.5
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert r.json()["type"].endswith("database-unavailable")
            # A prediction that cannot be audited is not answered either.
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/v1/models/demo-dose/predict", json=dose_body(1), timeout=60)
            assert time.perf_counter() - t0 < 2.5
            assert r.status_code == 503 and "nothing was recorded" in r.json()["detail"]
            assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200


def test_a_database_that_holds_a_statement_is_given_up_within_the_timeout(models, tmp_path):
    """A server that is up but does not answer (a table locked by a stuck maintenance
    session): the statement is cancelled after the database timeout and the request
    answered 503, not held; once the lock goes, requests are served again."""
    import psycopg

    with postgres_server() as pg:
        env = {**REPLICA_ENV, "BAGSERVE_DATABASE_URL": pg}
        with running_service(models, BAGSERVE_DATA_DIR=str(tmp_path / "d"), **env) as url:
            ok = httpx.post(f"{url}/v1/models/demo-dose/predict", json=dose_body(2), timeout=60)
            assert ok.status_code == 200
            with psycopg.connect(pg) as stuck:
                stuck.execute("LOCK TABLE audit_head IN ACCESS EXCLUSIVE MODE")
                t0 = time.perf_counter()
                r = httpx.post(f"{url}/v1/models/demo-dose/predict", json=dose_body(2), timeout=60)
                assert time.perf_counter() - t0 < 3.0
                assert r.status_code == 503 and "nothing was recorded" in r.json()["detail"]
                stuck.rollback()
            again = httpx.post(f"{url}/v1/models/demo-dose/predict", json=dose_body(2), timeout=60)
            assert again.status_code == 200


def test_tampering_in_the_database_is_found(models, tmp_path):
    """Edit, delete or cut a record in the database: verify names it."""
    data = tmp_path / "data"
    with running_service(models, BAGSERVE_DATA_DIR=str(data)) as url:
        for seed in range(4):
            assert httpx.post(
                f"{url}/v1/models/demo-dose/predict", json=dose_body(seed), timeout=60
            ).is_success
    verify_cmd = [EXE, "audit", "verify", "--data-dir"]
    assert subprocess.run([*verify_cmd, str(data)], capture_output=True).returncode == 0
    original = (data / "bagserve.sqlite3").read_bytes()
    for i, (change, message) in enumerate(
        (
            (
                "UPDATE audit SET record = replace(record, '\"status\":200', '\"status\":201') "
                "WHERE seq = 2",
                "record 2 was edited",
            ),
            ("DELETE FROM audit WHERE seq = 2", "record 2 is missing"),
            ("DELETE FROM audit WHERE seq = 4", "the chain ends at record 3 but 4"),
        )
    ):
        copy = tmp_path / f"copy-{i}"
        copy.mkdir()
        (copy / "bagserve.sqlite3").write_bytes(original)
        with sqlite3.connect(copy / "bagserve.sqlite3") as conn:
            conn.execute(change)
        out = subprocess.run([*verify_cmd, str(copy)], capture_output=True, text=True)
        assert out.returncode == 1 and message in out.stderr, (change, out.stderr)


def test_state_kept_in_files_is_imported_once(models, tmp_path):
    """Jobs, idempotency records and the audit file of an earlier version."""
    data = tmp_path / "data"
    job_id = "ab" * 16
    (data / "jobs" / job_id).mkdir(parents=True)
    body = json.dumps(dose_body(5)).encode()
    (data / "jobs" / job_id / "request.bin").write_bytes(body)
    (data / "jobs" / job_id / "meta.json").write_text(
        json.dumps(
            {
                "id": job_id,
                "status": "running",  # the old replica stopped while running it
                "created": 1.0,
                "updated": 2.0,
                "model": "demo-dose",
                "version": "1",
                "content_type": "application/json",
                "markers": None,
                "options": None,
                "request_id": "old-request",
                "api_key_id": None,
                "input_sha256": "0" * 64,
            }
        )
    )
    (data / "idempotency").mkdir()
    stored = {
        "stored": time.time(),
        "fingerprint": "f" * 64,
        "status": 200,
        "headers": {"content-type": "application/json"},
        "body": base64.b64encode(b'{"old": true}').decode(),
    }
    (data / "idempotency" / ("c" * 64 + ".json")).write_text(json.dumps(stored))
    # An audit file as earlier versions wrote it: made here with today's chain code.
    scratch = Database(f"sqlite:///{tmp_path / 'scratch.sqlite3'}", tmp_path)
    old = AuditLog(scratch)
    for i in range(3):
        old.append(request_id=f"old-{i}", status=200)
    assert old.export(data / "audit.jsonl").ok
    scratch.close()

    with running_service(models, BAGSERVE_DATA_DIR=str(data)) as url:
        job = poll(url, f"/v1/jobs/{job_id}")
        assert job["status"] == "succeeded"
        assert job["result"]["request_sha256"] == "0" * 64
    assert not (data / "jobs").exists() and (data / "jobs.imported" / job_id).is_dir()
    assert (data / "idempotency.imported").is_dir() and (data / "audit.jsonl.imported").is_file()
    db = Database(None, data)
    try:
        with db.transaction(write=False) as cur:
            row = cur.execute(
                "SELECT status, body FROM idempotency WHERE key_hash = %s", ("c" * 64,)
            ).fetchone()
        assert row[0] == 200 and bytes(row[1]) == b'{"old": true}'
        chain = AuditLog(db)
        assert chain.verify().ok
        seal = chain.recent(100)[-1]
        assert seal["event"] == "import" and seal["lines"] == 3
        assert seal["last_hash"] == verify(data / "audit.jsonl.imported").last_hash
    finally:
        db.close()
    # Started again: nothing is imported twice.
    with running_service(models, BAGSERVE_DATA_DIR=str(data)):
        pass
    db = Database(None, data)
    try:
        assert [r.get("event") for r in AuditLog(db).recent(100)].count("import") == 1
    finally:
        db.close()
