"""PostgreSQL connections for the state database, each round trip under a deadline.

A server that is down is easy: the kernel refuses the connection, or closes the ones
there were. A server that is frozen (its processes stopped, a paused VM or container,
a hung disk) is not: its kernel still accepts connections and acknowledges what is
sent, so TCP keepalives and ``tcp_user_timeout`` never fire, the server's own
``statement_timeout`` never runs, and libpq waits for an answer for as long as the
freeze lasts. The client must give up by itself:

* a connection is made in the calling thread, within libpq's ``connect_timeout``;
* a round trip (a statement, a commit) that has not been answered by its deadline has
  its socket shut down by a watchdog thread: the waiting call fails at once, and the
  connection is closed instead of going back to the pool;
* a call waits at most ``timeout`` seconds for one of the ``size`` connections.

The pool connects on demand and never backs off: the first call after the server is
back makes a new connection (a pool that retries in the background with growing delays
left requests failing for 20 s and more after a restart). A pooled connection is checked
before it is lent, without a round trip: while idle, nothing may arrive on its socket,
so a readable socket is a connection the server closed or is closing (a restart, an
idle timeout, a dead peer found by keepalives); it is closed and the next one tried.
A connection found broken retires every idle one older than itself (after a crash of
the server they are all dead).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg import pq

from .database_errors import DatabaseTimeout

__all__ = ["Connection", "ConnectionPool"]

T = TypeVar("T")


class Connection:
    """A pooled psycopg connection whose round trips have deadlines (:meth:`call`).

    Parameters
    ----------
    raw : psycopg.Connection
    """

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw
        self.created = time.monotonic()
        # A duplicate of libpq's socket: shutting it down reaches the one libpq waits
        # on, and the number stays ours even after libpq closes its own.
        self._socket = socket.socket(fileno=os.dup(raw.pgconn.socket))
        self._lock = threading.Lock()
        self._deadline: float | None = None
        #: The watchdog gave up on this connection: it is never lent again.
        self.expired = False

    def call(self, limit: float, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a round trip to the server, given up after ``limit`` seconds.

        Raises
        ------
        DatabaseTimeout
            No answer within ``limit`` (the connection is then unusable).
        """
        with self._lock:
            if self.expired:
                raise DatabaseTimeout("the database connection was given up: no answer")
            self._deadline = time.monotonic() + limit
        try:
            return fn(*args)
        except Exception as exc:
            if self.expired:
                raise DatabaseTimeout(
                    f"the database did not answer within {limit:g} s (frozen or cut off?)"
                ) from exc
            raise
        finally:
            with self._lock:
                self._deadline = None

    def expire_if_due(self, now: float) -> None:
        """Shut the socket down if the round trip under way is past its deadline."""
        with self._lock:
            if self._deadline is None or self._deadline > now or self.expired:
                return
            self.expired = True
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)

    @property
    def usable(self) -> bool:
        """Open, idle (no transaction) and not given up."""
        raw = self.raw
        return (
            not self.expired
            and not raw.closed
            and raw.pgconn.status == pq.ConnStatus.OK
            and raw.pgconn.transaction_status == pq.TransactionStatus.IDLE
        )

    def quiet(self) -> bool:
        """Nothing arrived while idle (see the module's docstring); no round trip."""
        poller = select.poll()
        poller.register(self._socket, select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.raw.close()
        self._socket.close()


class ConnectionPool:
    """At most ``size`` connections to ``url``, made on demand, lent one per call.

    Parameters
    ----------
    url : str
    size : int
        Connections at most.
    timeout : float
        Seconds a call waits for a free connection.
    kwargs : dict
        Connection parameters (libpq's ``connect_timeout``, ``options``, keepalives).
    """

    def __init__(self, url: str, size: int, timeout: float, kwargs: dict[str, Any]) -> None:
        self.url = url
        self.size = size
        self.timeout = timeout
        self.kwargs = kwargs
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[Connection] = []
        self._lent: set[Connection] = set()
        self._lock = threading.Condition()
        self._closed = False
        # Often enough that a deadline is kept to within a quarter of the timeout.
        self._tick = min(0.25, timeout / 4)
        self._watchdog = threading.Thread(
            target=self._watch, name="bagserve-db-watchdog", daemon=True
        )
        self._watchdog.start()

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[Connection]:
        """A connection for one transaction; back to the pool after it if still usable.

        Raises
        ------
        DatabaseTimeout
            Every connection stayed busy for ``timeout`` seconds.
        psycopg.OperationalError
            A new connection could not be made (within libpq's ``connect_timeout``).
        """
        wait = self.timeout if timeout is None else timeout
        if not self._slots.acquire(timeout=wait):
            raise DatabaseTimeout(
                f"all {self.size} database connections stayed busy for {wait:g} s"
            )
        try:
            conn = self._idle_connection() or Connection(psycopg.connect(self.url, **self.kwargs))
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._lent.add(conn)
            if len(self._lent) == 1:
                self._lock.notify()  # the watchdog sleeps while nothing is lent
        try:
            yield conn
        finally:
            self._give_back(conn)

    def _idle_connection(self) -> Connection | None:
        while True:
            with self._lock:
                if self._closed:
                    raise DatabaseTimeout("the database connection pool is closed")
                if not self._idle:
                    return None
                conn = self._idle.pop()
            if conn.usable and conn.quiet():
                return conn
            conn.close()

    def _give_back(self, conn: Connection) -> None:
        usable = conn.usable
        retired = []
        with self._lock:
            self._lent.discard(conn)
            if usable and not self._closed:
                self._idle.append(conn)
            else:
                retired.append(conn)
                if not usable:
                    # Most likely the server crashed or restarted: the idle connections
                    # made before this one are as dead.
                    retired += [c for c in self._idle if c.created <= conn.created]
                    self._idle = [c for c in self._idle if c.created > conn.created]
        self._slots.release()
        for old in retired:
            old.close()

    def _watch(self) -> None:
        """Expire the round trips past their deadlines, every tick while any is lent."""
        with self._lock:
            while not self._closed:
                self._lock.wait(self._tick if self._lent else None)
                now = time.monotonic()
                for conn in list(self._lent):
                    conn.expire_if_due(now)

    def close(self) -> None:
        """Close the idle connections; lent ones are closed when given back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._lock.notify()
        for conn in idle:
            conn.close()
