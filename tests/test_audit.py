"""The audit chain: key ids inside the hash, and heads kept elsewhere.

The oracle of each test is an edit made with plain SQL, as someone with write access to
the database could make it: the chain must name it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from bagserve.service.audit import AuditLog, verify
from bagserve.service.database import Database

from bagserve.cli import main


@pytest.fixture
def chain(tmp_path):
    """A chain of six records by two keys and one anonymous caller."""
    log = AuditLog(Database(None, tmp_path, pool_size=1))
    for i, key in enumerate(["aaaaaaaaaaaa", "bbbbbbbbbbbb", None, "aaaaaaaaaaaa", None, "bbbb"]):
        log.append(request_id=f"r{i}", api_key_id=key, route="/v1/x", status=200)
    yield log
    log.db.close()


def sql(tmp_path, statement: str) -> None:
    with sqlite3.connect(tmp_path / "bagserve.sqlite3") as conn:
        conn.execute(statement)


def cli(*args: str) -> int:
    return main(["audit", *args])


def test_a_record_moved_to_another_key_is_an_edit(chain, tmp_path, capsys):
    assert chain.verify().ok
    assert [r["request_id"] for r in chain.recent(10, "bbbbbbbbbbbb")] == ["r1"]
    sql(tmp_path, "UPDATE audit SET api_key_id = 'bbbbbbbbbbbb' WHERE seq = 1")
    result = chain.verify()
    assert not result.ok and "record 1 was moved to another API key" in result.problem
    # The listing of key b does not show a's record, whatever the column says.
    assert [r["request_id"] for r in chain.recent(10, "bbbbbbbbbbbb")] == ["r1"]
    assert cli("verify", "--data-dir", str(tmp_path)) == 1
    assert "moved to another API key" in capsys.readouterr().err
    # An anonymous record given a key is caught too (NULL column, null in the record).
    sql(tmp_path, "UPDATE audit SET api_key_id = 'aaaaaaaaaaaa' WHERE seq = 1")
    sql(tmp_path, "UPDATE audit SET api_key_id = 'aaaaaaaaaaaa' WHERE seq = 3")
    assert "record 3 was moved" in chain.verify().problem


def test_every_record_keeps_its_key_inside_the_hash(chain):
    for record in chain.recent(10):
        assert "api_key_id" in record
    # An import record (no key) has a NULL column and verifies.
    chain.append(event="import", source="old.jsonl", lines=0)
    assert chain.verify().ok


def test_a_head_kept_elsewhere_catches_a_cut_tail(chain, tmp_path, capsys):
    head = tmp_path / "elsewhere" / "head.json"
    head.parent.mkdir()
    assert cli("head", "--data-dir", str(tmp_path), "--output", str(head)) == 0
    taken = json.loads(head.read_text())
    assert taken["lines"] == 6 and taken["last_hash"] == chain.verify().last_hash
    chain.append(request_id="r6", api_key_id=None, route="/v1/x", status=200)
    assert cli("verify", "--data-dir", str(tmp_path), "--head", str(head)) == 0
    assert "holds the head" in capsys.readouterr().out
    # Cut the last three records and move the head row back to match: the chain alone
    # looks intact, the head taken earlier does not.
    sql(tmp_path, "DELETE FROM audit WHERE seq >= 5")
    with sqlite3.connect(tmp_path / "bagserve.sqlite3") as conn:
        last = json.loads(conn.execute("SELECT record FROM audit WHERE seq = 4").fetchone()[0])
        conn.execute("UPDATE audit_head SET seq = 4, last_hash = ?", (last["hash"],))
    assert chain.verify().ok
    assert cli("verify", "--data-dir", str(tmp_path)) == 0
    capsys.readouterr()
    assert cli("verify", "--data-dir", str(tmp_path), "--head", str(head)) == 1
    err = capsys.readouterr().err
    assert "a head taken earlier counted 6" in err and "removed from the end" in err


def test_a_head_kept_elsewhere_catches_a_rewritten_history(chain, tmp_path):
    earlier = chain.verify()
    # Rebuild the whole chain with one record changed: every hash is consistent again.
    records = [
        json.loads(r)
        for (r,) in sqlite3.connect(tmp_path / "bagserve.sqlite3").execute(
            "SELECT record FROM audit ORDER BY seq"
        )
    ]
    sql(tmp_path, "DELETE FROM audit")
    sql(tmp_path, "UPDATE audit_head SET seq = 0, last_hash = '" + "0" * 64 + "'")
    for r in records:
        fields = {k: v for k, v in r.items() if k not in ("time", "prev", "hash")}
        if fields.get("request_id") == "r2":
            fields["status"] = 500
        chain.append(**fields)
    assert chain.verify().ok
    result = chain.verify((earlier.lines, earlier.last_hash))
    assert not result.ok and "record 6 is not the one the head taken earlier names" in (
        result.problem
    )


def test_an_exported_file_is_checked_against_an_earlier_head(chain, tmp_path, capsys):
    exported = tmp_path / "trail.jsonl"
    assert chain.export(exported).ok
    head = tmp_path / "kept.json"
    head.write_text(json.dumps({"lines": 6, "last_hash": verify(exported).last_hash}))
    lines = exported.read_text().splitlines(keepends=True)
    exported.write_text("".join(lines[:4]))
    (tmp_path / "trail.jsonl.head").unlink()  # the sidecar went with the cut
    assert verify(exported).ok
    assert cli("verify", str(exported), "--head", str(head)) == 1
    assert "counted 6" in capsys.readouterr().err


def test_audit_output_keeps_flags_and_statuses_and_values_only_when_asked(monkeypatch):
    """What an audit record keeps of an answer: per bag its status, domain flag and
    score; the patient's values (or class counts) only with BAGSERVE_AUDIT_VALUES."""
    import numpy as np
    from bagserve.core.domain import DomainReport
    from bagserve.core.policy import statuses
    from bagserve.core.results import RegressionPrediction
    from bagserve.service.prediction import Outcome
    from bagserve.service.settings import Settings

    flags = np.array([False, True])
    domain = DomainReport(
        score=np.array([0.5, 7.25]),
        out_of_range=flags,
        nearest=np.array([[0], [1]]),
        similarities=np.array([[0.9], [0.01]]),
        distance=np.array([0.1, 3.0]),
    )
    result = RegressionPrediction(
        np.array([100, 200]),
        values=np.array([0.25, -1.5]),
        domain=domain,
        status=statuses("withhold", flags, 2),
    )
    outcome = Outcome(None, ["a", "b"], result, [], "0" * 64)  # type: ignore[arg-type]
    kept = outcome.summary(Settings().audit_values)
    assert kept == {
        "n_bags": 2,
        "status": ["final", "withheld"],
        "out_of_range": [False, True],
        "domain_score": [0.5, 7.25],
    }
    monkeypatch.setenv("BAGSERVE_AUDIT_VALUES", "true")
    assert outcome.summary(Settings().audit_values) == {**kept, "values": [0.25, -1.5]}


# ----------------------------------------------------------------- group commit
def _held_log(tmp_path, **kwargs):
    """A log whose writer stops after its first commit until ``release`` is set: the
    records submitted meanwhile queue up, and the next commit takes them together."""
    release, sizes = threading.Event(), []

    def on_commit(records: int, seconds: float) -> None:
        sizes.append(records)
        if len(sizes) == 1:
            release.wait(30)

    log = AuditLog(Database(None, tmp_path, pool_size=1), on_commit=on_commit, **kwargs)
    log.submit({"request_id": "r0", "api_key_id": None, "status": 200})
    deadline = time.monotonic() + 30
    while not sizes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sizes == [1]
    return log, release, sizes


def test_records_waiting_for_a_commit_share_the_next_one_and_chain_in_order(tmp_path):
    log, release, sizes = _held_log(tmp_path)
    futures = [
        log.submit({"request_id": f"r{i}", "api_key_id": None, "status": 200}) for i in range(1, 20)
    ]
    assert not any(f.done() for f in futures)  # nobody is released before the commit
    release.set()
    records = [f.result(30) for f in futures]
    assert sizes == [1, 19]  # one transaction (one fsync) for the 19 waiting records
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(1, 20)]
    assert all(b["prev"] == a["hash"] for a, b in itertools.pairwise(records))
    assert log.count() == 20 and log.verify().ok
    log.close()
    log.db.close()


def test_a_record_that_cannot_be_written_fails_alone(tmp_path):
    log, release, _ = _held_log(tmp_path)
    good = [log.submit({"request_id": f"g{i}", "status": 200}) for i in range(3)]
    bad = log.submit({"request_id": "bad", "status": object()})  # not JSON
    more = log.submit({"request_id": "g3", "status": 200})
    release.set()
    with pytest.raises(TypeError):
        bad.result(30)
    assert [f.result(30)["request_id"] for f in [*good, more]] == ["g0", "g1", "g2", "g3"]
    assert log.count() == 5 and log.verify().ok
    log.close()
    log.db.close()


def test_an_append_abandoned_by_its_task_is_written_all_the_same(tmp_path):
    log = AuditLog(Database(None, tmp_path, pool_size=1))

    async def abandon() -> None:
        task = asyncio.ensure_future(log.append_async(request_id="gone", status=499))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(abandon())
    log.close()  # writes what was queued
    assert [r["request_id"] for r in log.recent(5)] == ["gone"] and log.verify().ok
    with pytest.raises(RuntimeError):
        log.append(request_id="late")
    log.db.close()


def test_concurrent_appends_from_threads_and_the_event_loop_all_end_up_chained(tmp_path):
    log = AuditLog(Database(None, tmp_path, pool_size=1))

    async def from_the_loop() -> list[dict]:
        return await asyncio.gather(
            *(log.append_async(request_id=f"a{i}", status=200) for i in range(40))
        )

    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda i: log.append(request_id=f"t{i}", status=200), range(40)))
        awaited = asyncio.run(from_the_loop())
    assert log.count() == 80 and log.verify().ok
    kept = {r["request_id"]: r["hash"] for r in log.recent(100)}
    assert all(kept[r["request_id"]] == r["hash"] for r in [*threaded, *awaited])
    log.close()
    log.db.close()


def test_a_failing_commit_callback_releases_the_callers_all_the_same(tmp_path):
    def broken(records: int, seconds: float) -> None:
        raise RuntimeError("metrics are down")

    log = AuditLog(Database(None, tmp_path, pool_size=1), on_commit=broken)
    assert log.append(request_id="r0", status=200)["request_id"] == "r0"
    assert log.count() == 1 and log.verify().ok
    log.close()
    log.db.close()


def _refusing_log(tmp_path, monkeypatch) -> tuple[AuditLog, Future, list[int]]:
    """An audit log whose database refuses every commit after its timeout, with a
    first record already under way, and the sizes of the commits tried."""
    log = AuditLog(Database(None, tmp_path, pool_size=1))
    started, attempts = threading.Event(), []

    def down(batch: list) -> list:
        attempts.append(len(batch))
        started.set()
        time.sleep(0.3)  # the database's timeout
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(log.writer, "_transaction", down)
    first = log.submit({"request_id": "a", "status": 200})
    assert started.wait(10)
    return log, first, attempts


def test_records_queued_behind_a_commit_the_database_refused_fail_with_it(tmp_path, monkeypatch):
    """A database that does not answer is noticed within one timeout by every caller,
    not one timeout per batch queued ahead of it."""
    log, first, attempts = _refusing_log(tmp_path, monkeypatch)
    later = [log.submit({"request_id": f"b{i}", "status": 200}) for i in range(5)]
    for future in [first, *later]:
        with pytest.raises(sqlite3.OperationalError):
            future.result(10)
    assert attempts == [1]  # the queued records were not tried again
    monkeypatch.undo()
    assert log.append(request_id="c", status=200)["prev"] == "0" * 64 and log.count() == 1
    log.close()
    log.db.close()


def test_callers_on_an_event_loop_are_woken_once_per_commit(tmp_path):
    """The writer wakes an event loop once per transaction for all of the loop's
    callers in it: every wake-up is a turn of a busy loop. A future wrapped per caller
    (``asyncio.wrap_future``) woke it once per record."""
    log, release, sizes = _held_log(tmp_path)
    wakeups: list[int] = []

    async def twenty() -> tuple[list[dict], int]:
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            wakeups.append(threading.get_ident())
            return plain(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        tasks = [
            asyncio.ensure_future(log.append_async(request_id=f"r{i}", status=200))
            for i in range(1, 21)
        ]
        deadline = time.monotonic() + 30
        while len(log.writer._pending) < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        release.set()
        records = await asyncio.gather(*tasks)
        return records, len(wakeups)

    records, woken = asyncio.run(twenty())
    assert sizes == [1, 20]  # the 20 records committed together
    assert woken == 1
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(1, 21)]
    assert all(b["prev"] == a["hash"] for a, b in itertools.pairwise(records))
    assert log.count() == 21 and log.verify().ok
    log.close()
    log.db.close()


def test_records_queued_in_one_turn_of_the_loop_wake_an_idle_writer_once(tmp_path):
    """The records an event loop queues in one turn reach an idle writer together, at
    the turn's end, and share its next commit: the writer is not woken per record to
    commit the first alone (here the GIL is let go between them, as a busy loop's turn
    does, which let the woken writer take the first at once)."""
    sizes: list[int] = []
    log = AuditLog(
        Database(None, tmp_path, pool_size=1), on_commit=lambda n, seconds: sizes.append(n)
    )

    async def scenario() -> list[dict]:
        await log.append_async(request_id="r0", status=200)  # the writer now waits, idle

        async def one(i: int) -> dict:
            time.sleep(0.1)  # other work in the same turn; the GIL is free meanwhile
            return await log.append_async(request_id=f"r{i}", status=200)

        return await asyncio.gather(*(one(i) for i in range(1, 4)))

    records = asyncio.run(scenario())
    assert sizes == [1, 3]
    assert [r["request_id"] for r in records] == ["r1", "r2", "r3"]
    assert all(b["prev"] == a["hash"] for a, b in itertools.pairwise(records))
    assert log.count() == 4 and log.verify().ok
    log.close()
    log.db.close()


def test_awaited_records_queued_behind_a_refused_commit_fail_with_it(tmp_path, monkeypatch):
    """Callers on an event loop hear of a database that does not answer as the
    threads' callers do: at once, with the commit's error."""
    log, first, attempts = _refusing_log(tmp_path, monkeypatch)

    async def five() -> list:
        calls = (log.append_async(request_id=f"b{i}", status=200) for i in range(5))
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)

    outcomes = asyncio.run(five())
    assert [type(o) for o in outcomes] == [sqlite3.OperationalError] * 5
    with pytest.raises(sqlite3.OperationalError):
        first.result(10)
    assert attempts == [1]  # the queued records were not tried again
    monkeypatch.undo()
    assert log.append(request_id="c", status=200)["prev"] == "0" * 64 and log.count() == 1
    log.close()
    log.db.close()


#: Tampering with the chain's head and table, and what ``audit verify`` must say of it
#: (each a clear message and exit 1, never a traceback).
HEAD_TAMPERING = [
    (
        ["DELETE FROM audit_head"],
        ["head", "is missing", "tampering", "The 6 record(s) in the table are chained correctly"],
    ),
    (["DELETE FROM audit_head", "DELETE FROM audit"], ["is missing", "The 0 record(s)"]),
    (
        [
            "DELETE FROM audit_head",
            "UPDATE audit SET record = replace(record, '\"r2\"', '\"r9\"') WHERE seq = 3",
        ],
        ["is missing", "record 3 was edited"],
    ),
    (["DELETE FROM audit"], ["the chain ends at record 0 but 6 record(s) were written"]),
    (["UPDATE audit_head SET seq = 7"], ["the chain ends at record 6 but 7 record(s)"]),
    (
        ["UPDATE audit_head SET last_hash = '" + "f" * 64 + "'"],
        ["the head or the last record was replaced"],
    ),
    (["UPDATE audit_head SET last_hash = 'x'"], ["head", "is not valid", "tampering"]),
    (["DROP TABLE audit_head"], ["cannot read the audit chain", "audit_head"]),
]


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def engine(request):
    """A way to make fresh databases on each engine: ``make(name)`` gives the command
    line's arguments naming one and a function that runs SQL in it."""
    if request.param == "sqlite":

        def make_sqlite(directory):
            def run(statement):
                with sqlite3.connect(directory / "bagserve.sqlite3") as conn:
                    conn.execute(statement)

            return ["--data-dir", str(directory)], Database(None, directory), run

        yield make_sqlite
        return
    import psycopg

    from .postgres import postgres_server

    with postgres_server() as pg:

        def make_postgres(directory):
            name = f"d{time.time_ns()}"
            with psycopg.connect(pg, autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE {name}")
            url = pg.rsplit("/", 1)[0] + "/" + name

            def run(statement):
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(statement)

            return ["--database", url], Database(url, directory, pool_size=1), run

        yield make_postgres


def outcome(capsys, *args: str) -> tuple[int, str]:
    """Exit code and standard error of a command line, as the shell would see them."""
    try:
        code = cli(*args)
    except SystemExit as exc:  # raised with the message, which Python prints
        print(exc.code, file=sys.stderr)
        code = 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("statements", "says"), HEAD_TAMPERING)
def test_a_missing_or_edited_head_is_named_without_a_traceback(
    engine, statements, says, tmp_path, capsys
):
    where, db, run = engine(tmp_path)
    log = AuditLog(db)
    try:
        for i in range(6):
            log.append(request_id=f"r{i}", api_key_id=None, route="/v1/x", status=200)
    finally:
        log.close()
        db.close()
    assert outcome(capsys, "verify", *where)[0] == 0
    for statement in statements:
        run(statement)
    code, err = outcome(capsys, "verify", *where)
    assert code == 1 and err.startswith("error: "), err
    assert all(part in err for part in says), err
    assert "Traceback" not in err
    # Nothing is taken from, or written of, a chain that does not verify.
    exported = tmp_path / "trail.jsonl"
    assert outcome(capsys, "export", str(exported), *where)[0] == 1
    assert outcome(capsys, "head", "--output", str(tmp_path / "head.json"), *where)[0] == 1
    assert not exported.exists() and not (tmp_path / "head.json").exists()
