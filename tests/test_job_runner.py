"""A stored job waits out refusals that pass (503) and fails on those that do not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from bagserve.service import job_runner
from bagserve.service.errors import Problem
from bagserve.service.job_runner import JobRunner


class _Store:
    """The parts of a JobStore the runner uses, for one stored job."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, str, dict]] = []

    def meta(self, job_id: str) -> dict:
        return {
            "model": "m",
            "version": "1",
            "request_id": "r",
            "api_key_id": None,
            "options": None,
            "content_type": "application/json",
            "input_sha256": "0" * 64,
        }

    def body(self, job_id: str) -> bytes:
        return b"{}"

    def finish(self, job_id: str, status: str, result: dict) -> None:
        self.finished.append((job_id, status, result))


class _Predictor:
    """Refuses with each of ``problems`` in turn (the last one for ever)."""

    settings = SimpleNamespace(hl7_forward=None)

    def __init__(self, *problems: Problem) -> None:
        self.problems = list(problems)
        self.tries = 0

    async def run(self, *args, **kwargs):
        self.tries += 1
        raise self.problems[min(self.tries, len(self.problems)) - 1]


def _run(predictor: _Predictor) -> _Store:
    store = _Store()
    registry = SimpleNamespace(get=lambda name, version: object())
    asyncio.run(JobRunner(store, registry, predictor)("job"))
    return store


def test_a_job_waits_out_busy_workers_then_fails_on_a_lasting_problem(monkeypatch):
    monkeypatch.setattr(job_runner.asyncio, "sleep", _no_sleep)
    busy = Problem(503, "all workers are busy and the queue is full; retry later")
    loading = Problem(503, "model m/1 is being loaded into the workers; retry shortly")
    bad = Problem(422, "bag 'a': column 'CD3' is missing", errors=["bag 'a': no CD3"])
    predictor = _Predictor(busy, loading, busy, bad)
    store = _run(predictor)
    assert predictor.tries == 4
    ((_, status, result),) = store.finished
    assert status == "failed" and result["status"] == 422
    assert result["errors"] == ["bag 'a': no CD3"]


def test_a_job_refused_for_longer_than_its_patience_fails_with_the_refusal(monkeypatch):
    monkeypatch.setattr(job_runner.asyncio, "sleep", _no_sleep)
    monkeypatch.setattr(job_runner, "TRANSIENT_PATIENCE", 0.0)
    predictor = _Predictor(Problem(503, "all workers are busy and the queue is full"))
    store = _run(predictor)
    assert predictor.tries == 1
    ((_, status, result),) = store.finished
    assert status == "failed" and result["status"] == 503


@pytest.mark.parametrize("status", [400, 404, 413, 422, 500, 504])
def test_other_problems_fail_the_job_at_once(monkeypatch, status):
    monkeypatch.setattr(job_runner.asyncio, "sleep", _no_sleep)
    predictor = _Predictor(Problem(status, "no"))
    store = _run(predictor)
    assert predictor.tries == 1 and store.finished[0][2]["status"] == status


async def _no_sleep(seconds: float) -> None:
    return None
