"""Group commit: the writes that wait together share one transaction and one fsync.

The audit records (:mod:`.audit`) and the idempotency records (:mod:`.idempotency`) of
a process go through one :class:`GroupCommit`. Its writer thread takes every write
waiting when it becomes free, runs them in order in one transaction, commits (one fsync
on SQLite with ``synchronous=FULL``, one WAL flush on PostgreSQL), and only then
releases each caller with its result. A lone write is committed at once: nothing is
waited for on purpose, and the writes arriving during a commit form the next one. The
writes an event loop queues in one turn wake an idle writer once, as that turn ends
(:meth:`GroupCommit.run`): under 8 clients a wake-up per record was 6 % of the event
loop's time (the thread's futex, then the GIL handed to the writer and back).

A write is a function of the transaction (:class:`Transaction`): it runs its
statements on ``tx.cur`` and returns its result. Writes that keep state across one
transaction (the audit chain's head, read once and moved once per transaction) ask for
it with :meth:`Transaction.shared`. A write may be run again, alone, in a transaction of
its own (when the group's transaction failed for another reason than the database), so
it must not change anything outside the database before its transaction commits.

On PostgreSQL every group transaction first takes one advisory lock: the group
transactions of every replica run one after the other, so two of them never take the
same rows' locks in opposite orders (a deadlock). They would wait for each other on the
audit chain's head row anyway. A server, database or role configured with
``synchronous_commit=off`` (commits acknowledged before their WAL is flushed) gets
``local`` for these transactions: the rule that an answer leaves only once its record
is durable does not depend on the server's configuration. Stronger settings (``on``,
``remote_apply``: waiting for standbys) are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .database import Cursor, Database, unavailable

log = logging.getLogger("bagserve.commit")

__all__ = ["SWITCH_INTERVAL", "GroupCommit", "Transaction", "Write", "prompt_threads"]

T = TypeVar("T")
S = TypeVar("S")

#: Any fixed number: the advisory lock that orders the group transactions of replicas.
_GROUP_LOCK = 0x6261677367726F75
#: Seconds a thread waits for the GIL, at most, while the serving process's event loop
#: runs Python (the interpreter's default is 5 ms): see :func:`prompt_threads`.
SWITCH_INTERVAL = 0.0005


@contextlib.contextmanager
def prompt_threads(interval: float = SWITCH_INTERVAL) -> Iterator[None]:
    """Within the block, a thread waiting for the GIL gets it after ``interval``
    seconds at most (unless it is shorter already); the previous interval after.

    The writer thread takes the GIL back after every SQLite call (BEGIN, the head,
    the rows, the commit's fsync) and to release its callers; while the event loop
    runs Python it gets it only when the loop blocks or the interval forces a
    switch. Under 8 concurrent clients the interpreter's 5 ms made the wait for a
    record of a few hundred microseconds' work several milliseconds
    (``bench/README.md``). A shorter interval costs only when a thread does wait.
    """
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, interval))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@dataclass
class Transaction:
    """One group's transaction as its writes see it.

    Attributes
    ----------
    cur : Cursor
        The transaction's statements.
    """

    cur: Cursor
    _shared: dict[str, Any] = field(default_factory=dict)
    _finish: list[Callable[[Cursor], None]] = field(default_factory=list)

    def shared(
        self, key: str, make: Callable[[Cursor], S], finish: Callable[[Cursor, S], None]
    ) -> S:
        """State under ``key`` shared by this transaction's writes: ``make(cur)`` for
        the first that asks, ``finish(cur, state)`` once after the last write, before
        the commit."""
        if key not in self._shared:
            state = self._shared[key] = make(self.cur)
            self._finish.append(lambda cur: finish(cur, state))
        return self._shared[key]  # type: ignore[no-any-return]


@dataclass
class Write(Generic[T]):
    """A write waiting for its group: the function, the bytes it writes (for the
    transaction's deadline) and what its caller waits on: a thread's future, or an
    event loop's (:meth:`GroupCommit.run`)."""

    run: Callable[[Transaction], T]
    size: int
    future: Future[T] | None
    waiter: asyncio.Future[T] | None = None


class GroupCommit:
    """One writer thread per instance that commits the writes waiting together in one
    transaction; thread-safe.

    Parameters
    ----------
    db : Database
    max_batch : int, default=512
        Writes in one transaction at most.
    on_commit : callable, optional
        Called after each commit with the number of writes it held and its seconds
        (the service's metrics).
    idle : float, default=30
        Seconds without a write after which the writer thread ends (the next write
        starts another): a short-lived user leaves no thread behind.
    """

    def __init__(
        self,
        db: Database,
        *,
        max_batch: int = 512,
        on_commit: Callable[[int, float], None] | None = None,
        idle: float = 30.0,
    ) -> None:
        self.db = db
        self.max_batch = max_batch
        self.on_commit = on_commit
        self.idle = idle
        self._pending: deque[Write[Any]] = deque()
        self._wake = threading.Condition()
        self._writer: threading.Thread | None = None
        self._closed = False
        #: The loops at the end of whose turn a wake-up of the writer is due (:meth:`run`).
        self._notifying: set[asyncio.AbstractEventLoop] = set()

    def submit(self, run: Callable[[Transaction], T], size: int = 0) -> Future[T]:
        """Queue one write; the future holds its result once its transaction committed.

        Cancelling the future does not withdraw the write: what was submitted is
        written. ``size``: the bytes it writes, when large (a stored answer), so that
        its transaction is given the time to write them.

        Raises
        ------
        RuntimeError
            The writer was closed.
        """
        future: Future[T] = Future()
        self._queue(Write(run, size, future))
        return future

    async def run(self, run: Callable[[Transaction], T], size: int = 0) -> T:
        """:meth:`submit` for the event loop: waits for the commit without a thread.

        The write is done even if the awaiting task is cancelled (there is nothing to
        shield: a cancelled wait withdraws nothing). The writes queued in one turn of
        the loop wake the writer once, at the turn's end (the loop's next callback);
        the writer wakes the loop once per transaction for all of the loop's callers,
        and each caller's task resumes in the loop's next turn. On a busy loop every
        turn takes a while: a future wrapped per caller (``asyncio.wrap_future``) woke
        the loop once per record, and the shielded coroutine the prediction awaited
        took two more turns (``bench/README.md``).

        Raises
        ------
        RuntimeError
            The writer was closed.
        """
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[T] = loop.create_future()
        self._queue(Write(run, size, None, waiter), notify=False)
        if loop not in self._notifying:
            # The writes queued in this turn of the loop wake the writer once, at its
            # end: one wake-up (a context switch, and the GIL handed over) rather
            # than one per write.
            self._notifying.add(loop)
            loop.call_soon(self._notify, loop)
        return await waiter

    def _queue(self, write: Write[Any], notify: bool = True) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("the database writer is closed")
            self._pending.append(write)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._run, name="bagserve-commit", daemon=True
                )
                self._writer.start()
            if notify:
                self._wake.notify()

    def _notify(self, loop: asyncio.AbstractEventLoop) -> None:
        self._notifying.discard(loop)
        with self._wake:
            self._wake.notify()

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the writer (later writes raise)."""
        with self._wake:
            self._closed = True
            writer = self._writer
            self._wake.notify()
        if writer is not None:
            writer.join(timeout)

    def _run(self) -> None:
        """The writer thread: take what is waiting, commit it, release its callers."""
        try:
            while True:
                with self._wake:
                    if not self._pending and not self._closed:
                        self._wake.wait(self.idle)
                    if not self._pending:
                        # Idle or closed: end; a later write starts another writer. The
                        # thread's SQLite connection goes with it (before a new writer
                        # can open its own).
                        self.db.close_thread_connection()
                        self._writer = None
                        return
                    n = min(len(self._pending), self.max_batch)
                    batch = [self._pending.popleft() for _ in range(n)]
                # Futures cancelled meanwhile are written all the same, just not answered.
                for item in batch:
                    if item.future is not None and not item.future.set_running_or_notify_cancel():
                        item.future = None
                self._commit(batch)
        finally:
            # A writer that fails for good closes its connection too.
            self.db.close_thread_connection()

    def _commit(self, batch: list[Write[Any]]) -> None:
        t0 = time.perf_counter()
        try:
            results = self._transaction(batch)
        except BaseException as exc:
            down = unavailable(exc)
            if len(batch) > 1 and not down:
                # Not the database: one write may be at fault (a record that is not
                # JSON): each alone, so that the others are still written and only its
                # caller fails.
                for item in batch:
                    self._commit([item])
                return
            if down:
                # The writes that queued up meanwhile fail with these, at once: each
                # caller hears within one database timeout, not one per batch ahead.
                with self._wake:
                    queued = list(self._pending)
                    self._pending.clear()
                for item in queued:
                    if item.future is not None and not item.future.set_running_or_notify_cancel():
                        item.future = None
                    batch.append(item)
            _release(batch, [None] * len(batch), exc)
            if not isinstance(exc, Exception):
                raise
            return
        if self.on_commit is not None:
            try:
                self.on_commit(len(batch), time.perf_counter() - t0)
            except Exception:
                # Only the metrics fail: the writes are in, and their callers go on.
                log.exception("commit callback failed")
        _release(batch, results)

    def _transaction(self, batch: list[Write[Any]]) -> list[Any]:
        """Run the writes in order in one transaction; their results once committed."""
        size = sum(item.size for item in batch)
        timeout = self.db.write_timeout(size) if size else None
        with self.db.transaction(timeout=timeout) as cur:
            if self.db.dialect == "postgresql":
                (sync,) = cur.execute(
                    "SELECT current_setting('synchronous_commit') FROM pg_advisory_xact_lock(%s)",
                    (_GROUP_LOCK,),
                ).fetchone() or ("on",)
                if sync == "off":
                    # An answer leaves once its record is durable: never on a commit
                    # the server acknowledges before flushing it.
                    cur.execute("SET LOCAL synchronous_commit = local")
            tx = Transaction(cur)
            results = [item.run(tx) for item in batch]
            for finish in tx._finish:
                finish(cur)
        return results


def _release(batch: list[Write[Any]], results: list[Any], exc: BaseException | None = None) -> None:
    """Release the callers of a committed (or failed) batch: the threads' futures here,
    each event loop's waiters in one call on that loop."""
    woken: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
    for item, result in zip(batch, results, strict=True):
        if item.future is not None:
            if exc is None:
                item.future.set_result(result)
            else:
                item.future.set_exception(exc)
        if item.waiter is not None:
            woken.setdefault(item.waiter.get_loop(), []).append((item.waiter, result))
    for loop, waiters in woken.items():
        # A closed loop (RuntimeError) has no caller waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, waiters, exc)


def _settle(waiters: list[tuple[asyncio.Future[Any], Any]], exc: BaseException | None) -> None:
    """On the waiters' loop: each one's result (or the batch's error), unless its caller
    stopped waiting (a cancelled task)."""
    for waiter, result in waiters:
        if waiter.done():
            continue
        if exc is None:
            waiter.set_result(result)
        else:
            waiter.set_exception(exc)
