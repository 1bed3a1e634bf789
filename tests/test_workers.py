"""The pool's wire format: raw buffers over the pipe, or a memfd for large messages."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from service import workers
from service.workers import recv_message, send_message


def _echo(conn) -> None:  # runs in a spawned process
    while True:
        try:
            header, arrays = recv_message(conn)
        except EOFError:
            return
        send_message(conn, {**header, "writable": [a.flags.writeable for a in arrays]}, arrays)


@pytest.mark.parametrize("big", [False, True])
def test_messages_round_trip_exactly_through_a_process(big):
    rng = np.random.default_rng(0)
    n = 200_000 if big else 100  # 16 MB: the memfd path; 8 kB: the pipe
    arrays = [
        rng.normal(size=(n, 10)),
        np.array([0, n // 3, n], dtype=np.int64),
        np.zeros(0),
        np.arange(6, dtype=np.int32).reshape(2, 3).T,  # not contiguous
    ]
    assert (sum(a.nbytes for a in arrays) >= workers.MEMFD_MIN_BYTES) == big
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_echo, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        send_message(parent, {"id": 7}, arrays)
        header, back = recv_message(parent)
    finally:
        parent.close()
        proc.join(timeout=30)
    assert header["id"] == 7
    # Read-only views of the received buffer, on both sides.
    assert header["writable"] == [False] * 4
    for a, b in zip(arrays, back, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == np.ascontiguousarray(b).tobytes()
