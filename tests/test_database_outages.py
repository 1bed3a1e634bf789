"""A state database that freezes, locks or restarts: requests are answered, not held.

The outages are real: a private PostgreSQL (:mod:`tests.postgres`) whose processes are
stopped with SIGSTOP (its kernel still accepts connections and acknowledges what is
sent, as for a paused VM or container) or that is stopped immediately and started
again, and a SQLite file another process holds locked. Every bound below is wide (the
deadline is 2 s; a loaded CI machine may take many times what an idle one does): what
is tested is that an answer comes within the outage, not after it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from bagserve.core.demo import build_demo_models, demo_samples
from bagserve.service.database import Database, unavailable

from .postgres import postgres_server
from .service_harness import running_service

#: What a frozen or locked database may take to be noticed, at most: the deadline is 2 s.
NOTICED = 30.0
ENV = {"BAGSERVE_DATABASE_TIMEOUT": "2", "BAGSERVE_WORKERS": "1"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("outages") / "models"
    build_demo_models(directory)
    return directory


def dose_body(seed: int = 1) -> dict:
    bags, _, markers = demo_samples("dose", 1, seed)
    return {"bags": [{"markers": markers, "points": np.asarray(bags[0]).tolist()}]}


def timed(call, *args, **kwargs) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    # The client waits longer than the bound: a request held by the outage fails the
    # bound, with its time, rather than as a client timeout.
    response = call(*args, timeout=2 * NOTICED, **kwargs)
    return response, time.monotonic() - t0


def predict(url: str) -> tuple[httpx.Response, float]:
    return timed(httpx.post, f"{url}/v1/models/demo-dose/predict", json=dose_body())


def assert_unavailable(response: httpx.Response, seconds: float) -> None:
    """A 503 problem that says the database does not answer, in time."""
    assert seconds < NOTICED, f"answered after {seconds:.1f} s"
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert int(response.headers["retry-after"]) > 0
    problem = response.json()
    assert problem["type"].endswith("database-unavailable")
    assert "nothing was recorded" in problem["detail"]


def assert_not_ready(url: str) -> None:
    ready, seconds = timed(httpx.get, f"{url}/readyz")
    assert seconds < NOTICED
    assert ready.status_code == 503
    body = ready.json()
    assert "the state database (jobs, audit trail) does not answer" in body["reasons"]
    # Whichever comes first: the database's own error, or the probe's deadline.
    assert body["database"].startswith(("unresponsive:", "unreachable:")), body["database"]


def test_a_frozen_postgres_is_answered_503_and_served_again_once_it_thaws(models, tmp_path):
    with postgres_server() as pg:
        env = {**ENV, "BAGSERVE_DATABASE_URL": pg, "BAGSERVE_DATA_DIR": str(tmp_path / "d")}
        with running_service(models, **env) as url:
            assert predict(url)[0].status_code == 200
            pg.freeze()
            try:
                # The pooled connection is given up, then a new one is.
                times = []
                for _ in range(2):
                    response, seconds = predict(url)
                    assert_unavailable(response, seconds)
                    times.append(seconds)
                job, seconds = timed(
                    httpx.post,
                    f"{url}/v1/jobs",
                    params={"model": "demo-dose"},
                    json=dose_body(),
                )
                assert_unavailable(job, seconds)
                assert_not_ready(url)
            finally:
                pg.thaw()
            # No connection given up comes back: the first request after is answered.
            response, seconds = predict(url)
            assert response.status_code == 200, response.text
            assert seconds < NOTICED
            ready = httpx.get(f"{url}/readyz", timeout=NOTICED)
            assert ready.status_code == 200 and ready.json()["database"] == "ok"
    print(f"frozen PostgreSQL: 503 after {times[0]:.2f} s, then {times[1]:.2f} s")


def test_a_locked_sqlite_database_is_answered_503_until_the_lock_goes(models, tmp_path):
    data = tmp_path / "d"
    with running_service(models, BAGSERVE_DATA_DIR=str(data), **ENV) as url:
        assert predict(url)[0].status_code == 200
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sqlite3, sys\n"
                "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                "conn.execute('BEGIN EXCLUSIVE')\n"
                "print('locked', flush=True)\n"
                "sys.stdin.readline()\n"
                "conn.execute('ROLLBACK')\n",
                str(data / "bagserve.sqlite3"),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout.readline().strip() == "locked"
            response, seconds = predict(url)
            assert_unavailable(response, seconds)
            assert_not_ready(url)
        finally:
            holder.communicate("\n", timeout=60)
        assert predict(url)[0].status_code == 200
        assert httpx.get(f"{url}/readyz", timeout=NOTICED).status_code == 200
    print(f"locked SQLite: 503 after {seconds:.2f} s")


def test_predictions_are_answered_as_soon_as_postgres_accepts_connections(models, tmp_path):
    """Stopped at once (every process quits, no goodbye to the clients), down for a few
    seconds while requests keep coming, then started again: the first request after
    the server accepts connections is answered (no pooled connection to the old server
    is lent, no back-off delays the new one)."""
    with postgres_server() as pg:
        env = {**ENV, "BAGSERVE_DATABASE_URL": pg, "BAGSERVE_DATA_DIR": str(tmp_path / "d")}
        with running_service(models, **env) as url:
            assert predict(url)[0].status_code == 200
            pg.crash()
            outage = time.monotonic() + 8
            while time.monotonic() < outage:
                assert_unavailable(*predict(url))
                time.sleep(0.5)
            pg.start()
            response, seconds = predict(url)
            assert response.status_code == 200, response.text
            assert seconds < 10
    print(f"PostgreSQL back: first prediction answered in {seconds:.2f} s")


def test_a_frozen_server_is_given_up_by_the_client_and_its_connection_dropped(tmp_path):
    with postgres_server() as pg:
        db = Database(pg, tmp_path, pool_size=2, timeout=1)
        try:
            db.ping()
            errors: list[BaseException] = []

            def ping() -> None:
                try:
                    db.ping()
                except Exception as exc:
                    errors.append(exc)

            pg.freeze()
            caller = threading.Thread(target=ping)
            try:
                caller.start()
                caller.join(NOTICED)
                assert not caller.is_alive(), "held for as long as the server is frozen"
            finally:
                pg.thaw()
                caller.join()
            (error,) = errors
            assert unavailable(error) and "did not answer within" in str(error)
            db.ping()  # on a new connection: the one given up was closed, not pooled
        finally:
            db.close()


def test_connections_closed_by_a_restart_are_never_lent(tmp_path):
    with postgres_server() as pg:
        db = Database(pg, tmp_path, pool_size=4, timeout=2)
        try:
            # Four connections in the pool: four transactions open at once.
            together = threading.Barrier(4)

            def hold() -> None:
                with db.transaction() as cur:
                    cur.execute("SELECT 1")
                    together.wait(timeout=30)

            threads = [threading.Thread(target=hold) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            pg.crash()
            pg.start()
            for _ in range(4):
                db.ping()  # each the first try, none on a connection to the old server
        finally:
            db.close()
