"""The service's shared state in a database: SQLite (embedded) or PostgreSQL.

Jobs, idempotency records and the audit trail live in one database, so that every
replica of the service sees the same jobs, replays the same answers and extends the
same audit chain. Two engines behind one small interface:

* SQLite, the default: one file, ``DATA_DIR/bagserve.sqlite3``, in WAL mode (readers
  never wait for the writer), ``synchronous=FULL`` (a committed job or audit line
  survives a power cut). Writers are serialised by ``BEGIN IMMEDIATE``; replicas on one
  host may share the file.
* PostgreSQL (``BAGSERVE_DATABASE_URL=postgresql://...``), through psycopg 3 and its
  connection pool, for replicas on several hosts. Queue claims use row locks
  (``FOR UPDATE SKIP LOCKED``).

SQL is written once with ``%s`` placeholders; for SQLite they become ``?``. The schema
is created and migrated in code (:data:`MIGRATIONS`), under a lock, by whichever replica
starts first.

Neither engine may hold a request for as long as the database does not answer: every
call has a client-side deadline, ``timeout`` seconds (2 by default,
``BAGSERVE_DATABASE_TIMEOUT``), and past it raises an error that :func:`unavailable`
recognises, which the service answers with 503 and ``Retry-After``. On PostgreSQL a
connection is waited for that long, a new one is given up after that long (libpq's
``connect_timeout``), a statement is cancelled by the server after that long
(``statement_timeout``; transactions that write large bodies get more, in proportion),
and a server that does not answer a round trip at all (frozen: stopped processes, a
paused VM, while its kernel still acknowledges TCP) is given up by the client a second
later, its connection closed rather than pooled (:mod:`.postgres`). On SQLite the only
way to "not answer" is another process holding the file's lock: a transaction waits
that long for it (``busy_timeout``).
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal

from .database_errors import DatabaseError, DatabaseTimeout

__all__ = [
    "GENESIS",
    "MIGRATIONS",
    "Database",
    "DatabaseError",
    "DatabaseTimeout",
    "from_database",
    "unavailable",
]

#: The ``prev`` of the first audit record.
GENESIS = "0" * 64

#: Schema versions in order: each a list of statements; ``{blob}``, ``{real}`` and
#: ``{bigint}`` are the engine's types.
MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE jobs (
            id TEXT PRIMARY KEY,
            status TEXT NOT NULL,
            created {real} NOT NULL,
            updated {real} NOT NULL,
            meta TEXT NOT NULL,
            body {blob} NOT NULL,
            result TEXT,
            owner TEXT,
            lease_until {real},
            attempts INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX jobs_by_status ON jobs (status, created)",
        """CREATE TABLE idempotency (
            key_hash TEXT PRIMARY KEY,
            fingerprint TEXT NOT NULL,
            created {real} NOT NULL,
            stored {real},
            owner TEXT,
            lease_until {real},
            status INTEGER,
            headers TEXT,
            body {blob}
        )""",
        """CREATE TABLE audit (
            seq {bigint} PRIMARY KEY,
            api_key_id TEXT,
            record TEXT NOT NULL
        )""",
        "CREATE INDEX audit_by_key ON audit (api_key_id, seq)",
        """CREATE TABLE audit_head (
            id INTEGER PRIMARY KEY,
            seq {bigint} NOT NULL,
            last_hash TEXT NOT NULL
        )""",
        f"INSERT INTO audit_head (id, seq, last_hash) VALUES (1, 0, '{GENESIS}')",
        """CREATE TABLE imports (
            source TEXT PRIMARY KEY,
            done {real} NOT NULL,
            summary TEXT NOT NULL
        )""",
    ],
    # HL7 forwarding as a delivery queue (service/hl7_delivery.py): one message per job.
    [
        """CREATE TABLE hl7_deliveries (
            job_id TEXT PRIMARY KEY,
            request_id TEXT NOT NULL,
            api_key_id TEXT,
            peer TEXT NOT NULL,
            control_id TEXT NOT NULL,
            message TEXT NOT NULL,
            status TEXT NOT NULL,
            tries INTEGER NOT NULL DEFAULT 0,
            created {real} NOT NULL,
            updated {real} NOT NULL,
            next_try {real} NOT NULL,
            give_up {real} NOT NULL,
            owner TEXT,
            lease_until {real},
            ack TEXT,
            error TEXT
        )""",
        "CREATE INDEX hl7_deliveries_due ON hl7_deliveries (status, next_try)",
    ],
]

_TYPES = {
    "sqlite": {"blob": "BLOB", "real": "REAL", "bigint": "INTEGER"},
    "postgresql": {"blob": "BYTEA", "real": "DOUBLE PRECISION", "bigint": "BIGINT"},
}
#: Any fixed number: the advisory lock that serialises migrations across replicas.
_MIGRATION_LOCK = 0x6261677365727665


#: Seconds a PostgreSQL round trip may take beyond the statement timeout before the
#: client gives the server up: a live server's own cancellation comes first.
_GRACE = 1.0
#: Seconds to wait at start-up for a PostgreSQL server that is still starting.
_STARTUP_WAIT = 30.0


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached or used right now (a lost
    connection, a deadline passed, a locked or unreadable SQLite file), as opposed to a
    bug: the service answers 503 for those."""
    if isinstance(exc, DatabaseTimeout | sqlite3.OperationalError):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, psycopg.OperationalError)


def from_database(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the database (it cannot be opened, reached or read: a
    missing table, a lost connection, a deadline) rather than from a bug."""
    if isinstance(exc, DatabaseError | DatabaseTimeout | sqlite3.Error):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, psycopg.Error)


class Cursor:
    """One transaction's statements, the same on both engines."""

    def __init__(self, raw: Any, dialect: str, run: Callable[..., Any] | None = None) -> None:
        self._raw = raw
        self._sqlite = dialect == "sqlite"
        # How a round trip is made: under the connection's deadline on PostgreSQL.
        self._run = run or (lambda fn, *args: fn(*args))

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        if self._sqlite:
            sql = sql.replace("%s", "?")
        self._run(self._raw.execute, sql, tuple(params))
        return self

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> Cursor:
        """One statement for many parameter rows (psycopg pipelines them: one round trip)."""
        if self._sqlite:
            sql = sql.replace("%s", "?")
        self._run(self._raw.executemany, sql, [tuple(r) for r in rows])
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._raw.fetchone()

    def fetchall(self) -> list[tuple[Any, ...]]:
        return list(self._raw.fetchall())

    @property
    def rowcount(self) -> int:
        return int(self._raw.rowcount)


#: Seconds between two checkpoints of SQLite's WAL into the database file.
CHECKPOINT_INTERVAL = 0.5


class _Checkpointer:
    """Copies SQLite's WAL into the database file every :data:`CHECKPOINT_INTERVAL`
    seconds, on a connection and a thread of its own (``PRAGMA
    wal_checkpoint(PASSIVE)``: it waits for no reader or writer).

    SQLite's automatic checkpoint runs inside the commit that takes the WAL past 1,000
    pages: about one audit transaction in 200 also wrote some 4 MB into the database
    file and flushed it, with every answer waiting on the group behind it (issue 47,
    the 8-client p99). Durability is unchanged: a commit is durable once its WAL
    frames are flushed (``synchronous=FULL``); a checkpoint cut short is redone from
    the WAL.
    """

    def __init__(self, path: Path, timeout: float) -> None:
        self._stop = threading.Event()
        self._conn = sqlite3.connect(
            path, isolation_level=None, timeout=timeout, check_same_thread=False
        )
        self._thread = threading.Thread(target=self._run, name="bagserve-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(CHECKPOINT_INTERVAL):
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()


class Database:
    """A connection (pool) to the state database; thread-safe.

    Parameters
    ----------
    url : str or None
        ``postgresql://...`` for PostgreSQL; otherwise ``sqlite:///PATH`` or None.
    data_dir : Path
        Where the SQLite file goes when ``url`` is None.
    pool_size : int
        PostgreSQL connections at most.
    timeout : float
        Seconds after which a database that does not answer (a connection, a
        statement, a lock) counts as unavailable.
    """

    #: Bytes per second a slow but healthy server is expected to take in a large write.
    WRITE_RATE = 16 << 20

    def __init__(
        self, url: str | None, data_dir: Path, *, pool_size: int = 8, timeout: float = 2.0
    ) -> None:
        self.dialect: Literal["sqlite", "postgresql"]
        self.timeout = timeout
        if url and url.startswith(("postgresql://", "postgres://")):
            self.dialect = "postgresql"
            self._open_postgres(url, pool_size)
            self.where = _redact(url)
        else:
            self.dialect = "sqlite"
            path = Path(url[len("sqlite:///") :]) if url else Path(data_dir) / "bagserve.sqlite3"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.path = path
            self.where = str(path)
            self._local = threading.local()
            self._connections: list[sqlite3.Connection] = []
            self._lock = threading.Lock()
            self._checkpoints = _Checkpointer(path, self.timeout)
        self.migrate()

    # ------------------------------------------------------------------ engines
    def _open_postgres(self, url: str, pool_size: int) -> None:
        try:
            from .postgres import ConnectionPool
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise DatabaseError(
                "BAGSERVE_DATABASE_URL names PostgreSQL but psycopg is not installed: "
                "pip install 'bagserve[postgres]'"
            ) from exc
        ms = max(1, round(1000 * self.timeout))
        connection = {
            # libpq counts whole seconds and takes 2 as its least meaningful value.
            "connect_timeout": max(2, math.ceil(self.timeout)),
            "options": f"-c statement_timeout={ms}",
            # A peer that is gone (not merely frozen) is found by the kernel.
            "keepalives": 1,
            "keepalives_idle": max(1, math.ceil(self.timeout)),
            "keepalives_interval": 1,
            "keepalives_count": 2,
            "tcp_user_timeout": ms,
        }
        self._pool = ConnectionPool(url, pool_size, self.timeout, connection)
        # A server still starting (containers started together) is waited for.
        deadline = time.monotonic() + _STARTUP_WAIT
        while True:
            try:
                with self._pool.connection():
                    return
            except Exception as exc:
                if time.monotonic() > deadline:
                    self._pool.close()
                    raise DatabaseError(f"cannot connect to {_redact(url)}: {exc}") from exc
                time.sleep(0.5)

    def _sqlite_connection(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # Autocommit mode: transactions are begun explicitly below. A lock held by
            # another process is waited for ``timeout`` seconds, then "database is
            # locked" (503).
            conn = sqlite3.connect(
                self.path, isolation_level=None, timeout=self.timeout, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            # The WAL is copied into the database file by a thread of its own
            # (_Checkpointer), never by a commit an answer waits for.
            conn.execute("PRAGMA wal_autocheckpoint=0")
            conn.execute(f"PRAGMA busy_timeout={max(1, round(1000 * self.timeout))}")
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def write_timeout(self, size: int) -> float:
        """Seconds to allow a transaction that writes ``size`` bytes (a job's body, a
        stored answer): the usual limit, plus the time a slow server takes to write them."""
        return self.timeout + size / self.WRITE_RATE

    @contextlib.contextmanager
    def transaction(self, *, write: bool = True, timeout: float | None = None) -> Iterator[Cursor]:
        """One transaction, committed when the block ends, rolled back on an error.

        ``write=True`` on SQLite takes the write lock at once (``BEGIN IMMEDIATE``), so
        that a read-then-write (a queue claim, the audit head) is never interleaved
        with another writer; PostgreSQL uses row locks in the statements instead.
        ``timeout`` (PostgreSQL): the statement timeout of this transaction, when it
        must differ from the connection's (see :meth:`write_timeout`); each round trip
        is given up a second after it.

        Raises
        ------
        DatabaseTimeout
            No free connection, or no answer, within the deadline.
        """
        if self.dialect == "postgresql":
            with self._postgres_transaction(timeout) as cur:
                yield cur
            return
        conn = self._sqlite_connection()
        cur = conn.cursor()
        cur.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield Cursor(cur, self.dialect)
        except BaseException:
            conn.rollback()
            raise
        else:
            conn.commit()
        finally:
            cur.close()

    @contextlib.contextmanager
    def _postgres_transaction(self, timeout: float | None) -> Iterator[Cursor]:
        limit = (self.timeout if timeout is None else timeout) + _GRACE
        with self._pool.connection() as conn:
            run = partial(conn.call, limit)
            try:
                with conn.raw.cursor() as cur:
                    if timeout is not None:
                        # SET takes no parameters; the value is a number formatted here.
                        ms = max(1, round(1000 * timeout))
                        run(cur.execute, f"SET LOCAL statement_timeout = {ms}")
                    yield Cursor(cur, self.dialect, run)
                run(conn.raw.commit)
            except BaseException:
                if not conn.raw.closed:
                    # One that cannot roll back is closed, not pooled (Connection.usable).
                    with contextlib.suppress(Exception):
                        run(conn.raw.rollback)
                raise

    def ping(self) -> None:
        """Raise unless the database answers within its deadline and, on SQLite, its
        write lock can be taken: what every prediction needs for its audit record."""
        with self.transaction() as cur:
            cur.execute("SELECT 1")

    def close_thread_connection(self) -> None:
        """Close the calling thread's SQLite connection, if it has one (a thread that
        ends: its connection would otherwise stay open until :meth:`close`)."""
        if self.dialect != "sqlite":
            return
        conn = getattr(self._local, "conn", None)
        if conn is None:
            return
        self._local.conn = None
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        with contextlib.suppress(sqlite3.Error):
            conn.close()

    def close(self) -> None:
        if self.dialect == "postgresql":
            self._pool.close()
            return
        self._checkpoints.close()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._connections.clear()
        self._local = threading.local()

    # ------------------------------------------------------------------ schema
    def migrate(self) -> int:
        """Bring the schema to the latest version; returns the version."""
        types = _TYPES[self.dialect]
        try:
            with self.transaction() as cur:
                if self.dialect == "postgresql":
                    cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                cur.execute("CREATE TABLE IF NOT EXISTS bagserve_schema (version INTEGER NOT NULL)")
                row = cur.execute("SELECT max(version) FROM bagserve_schema").fetchone()
                current = int(row[0]) if row and row[0] is not None else 0
                if current > len(MIGRATIONS):
                    raise DatabaseError(
                        f"{self.where}: schema version {current} is newer than this bagserve "
                        f"({len(MIGRATIONS)}); upgrade bagserve"
                    )
                for version in range(current + 1, len(MIGRATIONS) + 1):
                    for statement in MIGRATIONS[version - 1]:
                        cur.execute(statement.format(**types))
                    cur.execute("INSERT INTO bagserve_schema (version) VALUES (%s)", (version,))
                return len(MIGRATIONS)
        except DatabaseError:
            raise
        except Exception as exc:
            raise DatabaseError(
                f"{self.where}: cannot create or migrate the schema: {exc}"
            ) from exc


def _redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    head, sep, tail = url.partition("://")
    if "@" not in tail:
        return url
    credentials, _, host = tail.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{head}{sep}{user}:***@{host}"
