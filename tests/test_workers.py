"""The pool's wire format (raw buffers over the pipe, or a memfd for large messages),
and how the pool loads models into its workers."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from bagserve.core.artifacts import read_verified
from bagserve.core.demo import build_demo_models
from bagserve.service import wire
from bagserve.service.errors import Problem
from bagserve.service.pool import WorkerPool, model_id
from bagserve.service.settings import Settings
from bagserve.service.wire import BufferPool, recv_message, send_message

from .test_repository import name_an_unlisted_array, rewrite_manifest


def _echo(conn) -> None:  # runs in a spawned process
    mappings = OrderedDict()  # as a worker keeps them
    while True:
        try:
            header, arrays = recv_message(conn, mappings)
        except EOFError:
            return
        send_message(
            conn,
            {
                **header,
                "writable": [a.flags.writeable for a in arrays.values()],
                "mapped": len(mappings),
            },
            arrays,
        )


@pytest.fixture
def echo():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_echo, args=(child,), daemon=True)
    proc.start()
    child.close()
    yield parent
    parent.close()
    proc.join(timeout=30)


@pytest.mark.parametrize("n", [100, 2000, 200_000])
def test_messages_round_trip_exactly_through_a_process(n):
    # 8 kB: inside the header's message; 160 kB: the pipe, one message per array;
    # 16 MB: the memfd path.
    big = n == 200_000
    rng = np.random.default_rng(0)
    arrays = {
        "points": rng.normal(size=(n, 10)),
        "offsets": np.array([0, n // 3, n], dtype=np.int64),
        "empty": np.zeros(0),
        "strided": np.arange(6, dtype=np.int32).reshape(2, 3).T,  # not contiguous
        "labels": np.array(["CD4", "CD8", "B"]),
    }
    total = sum(a.nbytes for a in arrays.values())
    assert (total >= wire.MEMFD_MIN_BYTES) == big
    assert (total <= wire.COALESCE_MAX_BYTES) == (n == 100)
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
    assert header["writable"] == [False] * 5
    assert list(back) == list(arrays)  # names, in order
    for a, b in zip(arrays.values(), back.values(), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == np.ascontiguousarray(b).tobytes()


def test_shared_buffers_are_reused_lent_without_copy_and_never_reused_when_tainted(echo):
    """Requests reuse the pool's buffers and the worker's mappings of them; every
    message must still arrive exactly, whatever the previous content of the buffer."""
    rng = np.random.default_rng(1)
    pool = BufferPool(max_idle=2, max_idle_bytes=64 << 20)
    offsets = np.array([0, 7, 150_000], dtype=np.int64)
    seen = []
    for n in (150_000, 100_000, 150_000):  # 12, 8, 12 MB: the second fits the first buffer
        points = rng.normal(size=(n, 10))
        taken = send_message(echo, {"n": n}, {"points": points, "offsets": offsets}, pool)
        assert len(taken) == 1 and taken[0].capacity >= points.nbytes + offsets.nbytes
        header, back = recv_message(echo)
        assert header["n"] == n and header["writable"] == [False, False]
        np.testing.assert_array_equal(back["points"], points)
        np.testing.assert_array_equal(back["offsets"], offsets)
        seen.append(taken[0].id)
        pool.give_back(taken[0])
    assert seen[0] == seen[1] == seen[2]  # one buffer, reused
    assert header["mapped"] == 1  # and mapped once by the receiver
    # An array already in a lent buffer is sent by reference: nothing taken from the pool.
    lent = pool.lease(8 * 200_000 * 3)
    inside = np.frombuffer(lent.map, np.float64, 200_000 * 3).reshape(200_000, 3)
    inside[:] = rng.normal(size=inside.shape)
    assert send_message(echo, {}, {"points": inside, "offsets": offsets}, pool, [lent]) == []
    _, back = recv_message(echo)
    np.testing.assert_array_equal(back["points"], inside)
    # Rewritten in place for the next request: the receiver sees the new values.
    inside[:] = rng.normal(size=inside.shape)
    assert send_message(echo, {}, {"points": inside[1:], "offsets": offsets}, pool, [lent]) == []
    _, back = recv_message(echo)
    np.testing.assert_array_equal(back["points"], inside[1:])
    # A buffer whose request failed may still be read by its worker: closed, not reused.
    lent.tainted = True
    pool.give_back(lent)
    assert lent.fd == -1 and pool.lease(8).id != lent.id


def test_buffer_pool_bounds_what_it_keeps():
    pool = BufferPool(max_idle=2, max_idle_bytes=8 << 20)
    small = [pool.lease(1000) for _ in range(3)]
    assert len({b.id for b in small}) == 3 and all(b.capacity == wire.BUFFER_STEP for b in small)
    for b in small:
        pool.give_back(b)
    assert [b.fd == -1 for b in small] == [True, False, False]  # the oldest went
    big = pool.lease(9 << 20)  # more than the idle budget on its own
    assert big.capacity == 9 << 20
    pool.give_back(big)
    assert big.fd == -1
    again = pool.lease(10)  # the big one did not push the small ones out
    assert again.id in {small[1].id, small[2].id}
    other = small[2] if again is small[1] else small[1]
    pool.close()
    assert other.fd == -1 and again.fd >= 0
    again.close()


def _answer_with(conn) -> None:  # runs in a spawned process
    """Answers each request with ``header["n"]`` float64 values, after ``header["wait"]``
    seconds; ``header["die"]`` ends the process without an answer."""
    while True:
        try:
            header, _ = recv_message(conn)
        except EOFError:
            return
        time.sleep(header.get("wait", 0))
        if header.get("die"):
            os._exit(3)
        n = header["n"]
        send_message(conn, {"ok": True, "n": n}, {"values": np.arange(n, dtype=np.float64)})


@contextlib.contextmanager
def _answering_worker() -> Iterator[tuple[Any, Any, Any]]:
    """A spawned :func:`_answer_with` process, its request pipe's end and a control
    pipe's end; both pipes closed and the process joined after (it exits 3 once told
    to die)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    control, control_child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_answer_with, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        yield proc, parent, control
    finally:
        parent.close()
        control.close()
        control_child.close()
        proc.join(timeout=30)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_small_requests_are_exchanged_on_the_event_loop(loop):
    """A request that is one write goes to the worker and back on the loop's thread:
    answers whole in their first write, followed by arrays, or in a memory file all
    arrive exactly; the worker's death and the timeout are told apart; and the socket
    stays blocking for the thread's exchanges of large requests (uvloop makes the
    descriptors it watches non-blocking). The loop watches the worker's pipe and
    sentinel once, not per request, and stops when it died."""
    import uvloop
    from bagserve.service.worker_handle import WorkerHandle as _Worker
    from bagserve.service.worker_handle import WorkerLost, WorkerTimeout

    rest = ThreadPoolExecutor(1)

    async def scenario(proc: Any, parent: Any, control: Any) -> None:
        worker = _Worker(0, proc, parent, control)
        request = {"body": np.zeros(1000, np.uint8)}
        assert wire.fits_one_write(request)
        # 800 B: inside the first write; 160 kB: arrays after it; 16 MB: a memory file.
        for n in (100, 20_000, 2_000_000):
            header, arrays = await worker.send_in_loop({"n": n}, request, 30, rest)
            assert header["n"] == n
            np.testing.assert_array_equal(arrays["values"], np.arange(n, dtype=np.float64))
            assert os.get_blocking(parent.fileno())
            if n == 100:  # watched from now on, not registered again per request
                assert worker._watcher is asyncio.get_running_loop()
        # The thread's exchange of a large request still works on the same socket.
        worker.unwatch()
        big = {"body": np.zeros(wire.COALESCE_MAX_BYTES + 1, np.uint8)}
        assert not wire.fits_one_write(big)
        header, _, _ = await asyncio.get_running_loop().run_in_executor(
            rest, worker.exchange, {"n": 5}, big, 30
        )
        assert header["n"] == 5
        with pytest.raises(WorkerTimeout):
            await worker.send_in_loop({"n": 1, "wait": 2}, request, 0.2, rest)
        parent.recv_bytes()  # the late answer, so that the next exchange is in step
        with pytest.raises(WorkerLost, match="died"):
            await worker.send_in_loop({"n": 1, "die": True}, request, 30, rest)
        # A dead worker's sentinel stays readable: no longer watched once nothing waits
        # for it, so that the loop does not spin on it until the worker is replaced.
        await _until(lambda: worker._watcher is None, timeout=10)

    with _answering_worker() as (proc, parent, control):
        try:
            if loop == "uvloop":
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    runner.run(scenario(proc, parent, control))
            else:
                asyncio.run(scenario(proc, parent, control))
        finally:
            rest.shutdown()
    assert proc.exitcode == 3


def test_a_worker_s_answer_hands_it_to_the_next_request_in_the_same_callback():
    """A small request's answer is read in the loop's reader callback, which hands the
    worker to the next request in line and sends it there and then: when the answered
    request's task resumes, the worker computes the next one already (it used to wait
    idle for that task, one loop turn or, on a busy loop, several). A request given up
    in line leaves it without touching the worker; one given up while computing, one
    that overruns and one whose worker dies have the worker replaced."""
    from bagserve.service.pool_dispatch import Dispatch
    from bagserve.service.worker_handle import WorkerHandle as _Worker
    from bagserve.service.worker_handle import WorkerLost, WorkerTimeout

    replaced: list[int] = []
    request = {"body": np.zeros(1000, np.uint8)}

    async def scenario(proc: Any, parent: Any, control: Any) -> None:
        worker = _Worker(0, proc, parent, control)
        dispatch = Dispatch({0: worker}, 4, 2, None, lambda *_: True, replaced.append)
        dispatch.start()
        dispatch.release(0)
        seen = []

        async def first() -> dict:
            header, _, _, _ = await dispatch.submit({"n": 1, "wait": 0.3}, request, 30)
            seen.append((dispatch.busy, dispatch.waiting))  # as the answered task resumes
            return header

        try:
            a = asyncio.create_task(first())
            await _until(lambda: dispatch.busy == 1)
            b = asyncio.create_task(
                dispatch.submit({"n": 2, "wait": 0.3}, request, 30, meanwhile=lambda: "aside")
            )
            await _until(lambda: dispatch.waiting == 1)
            assert (await a)["n"] == 1
            assert seen == [(1, 0)], "the worker waited for the answered request's task"
            header, arrays, queued, aside = await b
            assert header["n"] == 2 and queued > 0.1 and aside == "aside"
            np.testing.assert_array_equal(arrays["values"], [0.0, 1.0])
            assert dispatch.busy == 0 and replaced == []

            # Given up in line: it leaves the line, the worker computes on undisturbed.
            c = asyncio.create_task(dispatch.submit({"n": 3, "wait": 0.3}, request, 30))
            await _until(lambda: dispatch.busy == 1)
            d = asyncio.create_task(dispatch.submit({"n": 4}, request, 30))
            await _until(lambda: dispatch.waiting == 1)
            d.cancel()
            with pytest.raises(asyncio.CancelledError):
                await d
            assert dispatch.waiting == 0
            assert (await c)[0]["n"] == 3
            assert dispatch.busy == 0 and replaced == []

            # Given up while computing: its answer would come out of turn.
            e = asyncio.create_task(dispatch.submit({"n": 5, "wait": 0.3}, request, 30))
            await _until(lambda: dispatch.busy == 1)
            e.cancel()
            with pytest.raises(asyncio.CancelledError):
                await e
            assert replaced == [0] and dispatch.busy == 0
            # (A replacement would be a new worker; this one is reused once in step.)
            await asyncio.to_thread(parent.recv_bytes)
            dispatch.release(0)
            with pytest.raises(WorkerTimeout):
                await dispatch.submit({"n": 6, "wait": 2}, request, 0.2)
            assert replaced == [0, 0] and dispatch.busy == 0
            await asyncio.to_thread(parent.recv_bytes)
            dispatch.release(0)
            with pytest.raises(WorkerLost, match="died"):
                await dispatch.submit({"n": 7, "die": True}, request, 30)
            assert replaced == [0, 0, 0] and dispatch.busy == 0
        finally:
            dispatch.close()

    with _answering_worker() as (proc, parent, control):
        asyncio.run(scenario(proc, parent, control))
    assert proc.exitcode == 3


async def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_the_pool_loads_into_every_worker_and_a_replacement_holds_what_is_served(tmp_path):
    """Every worker loads the versions asked for; one no worker can open is reported
    and not served; a request for a version not served is refused before it reaches a
    worker; a replacement worker holds every served version before it takes requests;
    what is neither kept nor loaded again is dropped."""
    models = tmp_path / "models"
    build_demo_models(models)
    paths = {name: models / name / "1" for name in ("demo-dose", "demo-gating")}
    # Handed over as the workers get them: verified bytes in sealed memory.
    verified = {
        name: read_verified(path, shared=True, mapped=False) for name, path in paths.items()
    }
    ids = {name: model_id(f"{name}/1", v.sha256) for name, v in verified.items()}
    # One whose files verify but that names an array it does not list.
    shutil.copytree(paths["demo-dose"], tmp_path / "ghost")
    rewrite_manifest(tmp_path / "ghost", name_an_unlisted_array)
    unopenable = read_verified(tmp_path / "ghost", shared=True, mapped=False)
    ghost = model_id("ghost/1", unopenable.sha256)
    limits = Settings(models_dir=models).request_limits().to_json()

    async def scenario() -> None:
        pool = WorkerPool(2, 4, limits, start_timeout=60)
        await pool.start()
        try:
            wanted = {ids[name]: verified[name] for name in paths}
            failed = await pool.load({**wanted, ghost: unopenable})
            assert list(failed) == [ghost] and "not_listed" in failed[ghost]
            assert all(pool.serves(mid) for mid in wanted) and not pool.serves(ghost)
            await _until(lambda: pool.ready)
            workers = list(pool._workers.values())
            assert len(workers) == 2 and all(w.held == set(wanted) for w in workers)
            with pytest.raises(Problem) as refused:
                await pool.submit({"model": "ghost/1", "sha256": "0"}, {}, 5.0)
            assert refused.value.status == 503 and refused.value.slug == "model-loading"
            # A worker killed: its replacement joins holding every served version.
            victim = workers[0]
            os.kill(victim.pid, signal.SIGKILL)
            await _until(lambda: pool.ready and pool._workers.get(victim.index) is not victim)
            assert pool._workers[victim.index].held == set(wanted)
            # Loading again what is held is immediate; what is not kept is dropped.
            dose = ids["demo-dose"]
            assert await pool.load({dose: verified["demo-dose"]}) == {}
            assert pool.serves(dose) and not pool.serves(ids["demo-gating"])
            assert all(w.held == {dose} for w in pool._workers.values())
        finally:
            await pool.stop()

    asyncio.run(scenario())
