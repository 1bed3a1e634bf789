"""The wire format between the service and its worker processes: no pickled arrays.

A message is a small header (a dict) and named arrays. The arrays never get pickled as
arrays: small ones cross the pipe as raw bytes (up to ``COALESCE_MAX_BYTES`` in all
inside the header's own write, so that a small request or answer is one write and one
read; beyond that a ``send_bytes`` of each buffer; ``frombuffer`` on the other side);
from ``MEMFD_MIN_BYTES`` on, on Linux, they go through an anonymous
memory file (``memfd``) whose descriptor is passed over the socket, and the receiver
maps it (no stream of socket chunks, and no ``/dev/shm`` size limit to hit in a
container). Requests use a pool of such files that are reused (:class:`BufferPool`),
which the workers keep mapped; a request body read straight into one (large NPY
uploads) reaches the worker with no copy at all. The models cross the control pipe the
same way (:func:`send_with_descriptors`): a description, and the descriptor of the
sealed memory file that holds a model's verified bytes, which each worker maps
read-only.
"""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

__all__ = [
    "BUFFER_STEP",
    "MEMFD_MIN_BYTES",
    "WORKER_MAPPINGS",
    "BufferPool",
    "SharedBuffer",
    "fits_one_write",
    "head_is_whole",
    "recv_head",
    "recv_message",
    "recv_rest",
    "recv_with_descriptors",
    "send_message",
    "send_with_descriptors",
]

#: Messages with at least this many bytes of arrays go through a memory file.
MEMFD_MIN_BYTES = 1 << 20
#: Arrays crossing the pipe ride inside the header's own write up to this many bytes in
#: all: a small request or answer is one write and one read, not one per array (each
#: array's write could wake the reader, on a busy machine a context switch apiece).
COALESCE_MAX_BYTES = 64 << 10
#: Shared buffers are sized in whole steps of this many bytes, so that bodies of
#: similar sizes reuse one another's buffers.
BUFFER_STEP = 1 << 20
#: Mappings of the server's shared buffers a worker keeps between requests.
WORKER_MAPPINGS = 4


#: The place of an array that rides inside the header's message (its index there).
_INLINE = -1


def _raw(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1)).cast("B")


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, np.uint8).__array_interface__["data"][0])


class SharedBuffer:
    """An anonymous memory file mapped read-write here, lent to one request at a time.

    Allocating and faulting in the pages of a fresh memory file costs more than
    copying the data (about 4 ms for 8 MB, against under 1 ms to copy into pages
    that exist): buffers are therefore reused, and a worker keeps its own mapping of
    each (keyed by ``id``), so that sending a buffer costs neither.

    Parameters
    ----------
    capacity : int
        Size in bytes; the pages are allocated at once.
    """

    _ids = itertools.count()

    def __init__(self, capacity: int) -> None:
        self.id = f"{os.getpid()}-{next(self._ids)}"
        self.capacity = capacity
        self.fd = os.memfd_create("bagserve-buffer", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, capacity)
            self.map = mmap.mmap(self.fd, capacity, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.address = _address(self.map)
        #: Set when a worker may still read the buffer (its request failed): never reused.
        self.tainted = False

    def offset_of(self, a: np.ndarray) -> int | None:
        """Where the contiguous array ``a`` lies in this buffer, or None if elsewhere."""
        start = int(a.__array_interface__["data"][0]) - self.address
        return start if start >= 0 and start + a.nbytes <= self.capacity else None

    def close(self) -> None:
        # The mapping itself goes when the last view of it does.
        """Close the memory file's descriptor (the mapping goes with its last view)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BufferPool:
    """Shared buffers for requests to the workers, reused once their request is over.

    Parameters
    ----------
    max_idle : int
        Idle buffers kept for reuse; more are closed.
    max_idle_bytes : int
        Total size of the idle buffers kept.
    """

    def __init__(self, max_idle: int, max_idle_bytes: int) -> None:
        self.max_idle = max_idle
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[SharedBuffer] = []
        self._lock = threading.Lock()

    def lease(self, size: int) -> SharedBuffer:
        """A buffer of at least ``size`` bytes for the caller's sole use until returned."""
        with self._lock:
            fits = [b for b in self._idle if b.capacity >= size]
            if fits:
                best = min(fits, key=lambda b: b.capacity)
                self._idle.remove(best)
                return best
        return SharedBuffer(max(BUFFER_STEP, -(-size // BUFFER_STEP) * BUFFER_STEP))

    def give_back(self, buffer: SharedBuffer) -> None:
        """Return a leased buffer; a tainted one, or one too many, is closed."""
        if buffer.tainted or buffer.fd < 0 or buffer.capacity > self.max_idle_bytes:
            buffer.close()
            return
        with self._lock:
            self._idle.append(buffer)
            # The oldest go first: the most recently used are mapped by the workers.
            while self._idle and (
                len(self._idle) > self.max_idle
                or sum(b.capacity for b in self._idle) > self.max_idle_bytes
            ):
                self._idle.pop(0).close()

    def close(self) -> None:
        """Close every idle buffer."""
        with self._lock:
            for b in self._idle:
                b.close()
            self._idle.clear()


def send_message(
    conn: Connection,
    header: dict[str, Any],
    arrays: Mapping[str, np.ndarray],
    pool: BufferPool | None = None,
    lent: Sequence[SharedBuffer] = (),
) -> list[SharedBuffer]:
    """A small header, then the named arrays' raw buffers (no pickling of the data).

    Arrays that already lie in one of the ``lent`` shared buffers are sent by
    reference (the buffer's descriptor and their offset), without a copy. The others
    cross the pipe when small, inside the header's message while they total at most
    ``COALESCE_MAX_BYTES`` (one write for the whole message), else each as a message
    of its own; from ``MEMFD_MIN_BYTES`` on they are copied into a buffer of ``pool``
    (or, without one, into a fresh memory file).

    Returns
    -------
    list of SharedBuffer
        The buffers taken from ``pool``: the caller returns them once the receiver
        is done with the message.
    """
    names = list(arrays)
    arrays = [np.ascontiguousarray(arrays[n]) for n in names]
    places: list[tuple[int, int] | None] = []
    for a in arrays:
        place = None
        for k, buf in enumerate(lent):
            offset = buf.offset_of(a) if a.size else None
            if offset is not None:
                place = (k, offset)
                break
        places.append(place)
    buffers: list[tuple[str | None, int]] = [(b.id, b.capacity) for b in lent]
    fds = [b.fd for b in lent]
    taken: list[SharedBuffer] = []
    rest = [i for i, p in enumerate(places) if p is None]
    total = sum(arrays[i].nbytes for i in rest)
    fresh = -1
    try:
        if total >= MEMFD_MIN_BYTES and hasattr(os, "memfd_create"):
            if pool is not None:
                scratch = pool.lease(total)
                taken.append(scratch)
                target, fd, name = scratch.map, scratch.fd, scratch.id
            else:
                fresh = os.memfd_create("bagserve-arrays", os.MFD_CLOEXEC)
                target, fd, name = None, fresh, None
            k, offset = len(buffers), 0
            for i in rest:
                view = _raw(arrays[i])
                if target is not None:
                    target[offset : offset + len(view)] = view
                else:
                    while view:
                        view = view[os.write(fresh, view) :]
                places[i] = (k, offset)
                offset += arrays[i].nbytes
            buffers.append((name, offset if name is None else taken[-1].capacity))
            fds.append(fd)
        inline: list[bytes] = []
        if sum(arrays[i].nbytes for i, p in enumerate(places) if p is None) <= COALESCE_MAX_BYTES:
            for i, p in enumerate(places):
                if p is None:
                    places[i] = (_INLINE, len(inline))
                    inline.append(_raw(arrays[i]).tobytes())
        meta = [(n, a.dtype.str, a.shape, p) for n, a, p in zip(names, arrays, places, strict=True)]
        message = (header, meta, buffers, inline)
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        for fd in fds:
            reduction.send_handle(conn, fd, 0)  # the pid is only used on Windows
        for a, p in zip(arrays, places, strict=True):
            if p is None:
                conn.send_bytes(_raw(a) if a.size else b"")
    except BaseException:
        for buf in taken:
            buf.tainted = True
            pool.give_back(buf)  # type: ignore[union-attr]
        raise
    finally:
        if fresh >= 0:
            os.close(fresh)
    return taken


def fits_one_write(arrays: Mapping[str, np.ndarray]) -> bool:
    """Whether :func:`send_message` sends ``arrays`` (lending no buffer) inside the
    header's own write: a message that an idle receiver's socket buffer takes whole."""
    return sum(np.asarray(a).nbytes for a in arrays.values()) <= COALESCE_MAX_BYTES


def recv_head(conn: Connection) -> tuple[Any, ...]:
    """The first part of a :func:`send_message` message: the header, the arrays'
    places and the inline arrays (what :func:`recv_rest` completes)."""
    # Only ever exchanged between this process and its own workers.
    return tuple(pickle.loads(conn.recv_bytes()))


def head_is_whole(head: tuple[Any, ...]) -> bool:
    """Whether the message of ``head`` is complete: no descriptor and no array follows
    it on the connection (what a small answer is)."""
    _, meta, buffers, _ = head
    return not buffers and all(place is not None for *_, place in meta)


def recv_rest(
    conn: Connection,
    head: tuple[Any, ...],
    mappings: OrderedDict[str, mmap.mmap] | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and named arrays of the message that ``head`` began, reading from
    ``conn`` the descriptors and arrays that follow it (see :func:`recv_message`)."""
    header, meta, buffers, inline = head
    mapped = []
    for name, size in buffers:
        fd = reduction.recv_handle(conn)
        try:
            known = mappings.get(name) if mappings is not None and name is not None else None
            if known is not None and len(known) == size:
                mappings.move_to_end(name)  # type: ignore[union-attr]
                mapped.append(known)
                continue
            # Read-only and populated up front; the arrays keep the mapping alive.
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if mappings is not None and name is not None:
            mappings[name] = m
            while len(mappings) > WORKER_MAPPINGS:
                mappings.popitem(last=False)
        mapped.append(m)
    arrays = {}
    for name, dt, shape, place in meta:
        dtype = np.dtype(dt)
        if place is None:
            arrays[name] = np.frombuffer(conn.recv_bytes(), dtype=dtype).reshape(shape)
            continue
        k, offset = place
        if k == _INLINE:
            arrays[name] = np.frombuffer(inline[offset], dtype=dtype).reshape(shape)
            continue
        count = int(np.prod(shape, dtype=np.int64))
        arrays[name] = np.frombuffer(mapped[k], dtype, count, offset).reshape(shape)
    return header, arrays


def recv_message(
    conn: Connection, mappings: OrderedDict[str, mmap.mmap] | None = None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and named arrays of :func:`send_message`, the arrays read-only,
    viewing the shared buffers.

    ``mappings`` keeps this side's mapping of each reusable buffer by its id, so that
    a buffer sent again is not mapped again (at most ``WORKER_MAPPINGS`` of them).
    """
    return recv_rest(conn, recv_head(conn), mappings)


def send_with_descriptors(conn: Connection, message: dict[str, Any], fds: Sequence[int]) -> None:
    """A small message (pickled) and open descriptors to go with it (the receiver
    gets its own copies; the sender's stay open)."""
    conn.send({**message, "descriptors": len(fds)})
    for fd in fds:
        reduction.send_handle(conn, fd, 0)  # the pid is only used on Windows


def recv_with_descriptors(conn: Connection) -> tuple[dict[str, Any], list[int]]:
    """A message of :func:`send_with_descriptors` and the descriptors that came with it
    (the caller closes them)."""
    message = dict(conn.recv())
    return message, [reduction.recv_handle(conn) for _ in range(message.pop("descriptors", 0))]
