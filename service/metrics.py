"""Prometheus metrics (prometheus-client), one registry per app.

* ``bagserve_requests_total{route, model, status}``
* ``bagserve_stage_seconds{stage}``: read, parse, validate, queue, transfer, compute,
  audit (waiting for the audit record's group commit), encode
* ``bagserve_audit_commit_records``, ``bagserve_audit_commit_seconds``: records (audit
  and idempotency) per group-commit transaction and its time (several requests share one)
* ``bagserve_queue_depth``, ``bagserve_busy_workers``, ``bagserve_alive_workers``
* ``bagserve_points_per_bag``: histogram of the size of predicted bags
* ``bagserve_model_load_failures``: artifacts that failed verification at start-up
* ``bagserve_domain_score{model}``: histogram of the applicability-domain score of each
  predicted bag (about 1 for bags like the training data: a shift shows as drift)
* ``bagserve_out_of_range_total{model}``: bags answered outside the model's domain
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

STAGES = ("read", "parse", "validate", "queue", "transfer", "compute", "audit", "encode")


class Metrics:
    """The service's Prometheus metrics, in a registry of their own (see the module)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "bagserve_requests",
            "HTTP requests",
            ["route", "model", "status"],
            registry=self.registry,
        )
        self.stage = Histogram(
            "bagserve_stage_seconds",
            "time per stage of a prediction",
            ["stage"],
            buckets=(
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
                60,
            ),
            registry=self.registry,
        )
        # Each stage's series looked up once: labels() takes a lock and hashes its
        # key, eight times per prediction.
        self._stage_children = {s: self.stage.labels(s) for s in STAGES}
        self.points = Histogram(
            "bagserve_points_per_bag",
            "points in each predicted bag",
            buckets=(10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000),
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "bagserve_queue_depth", "requests waiting for a worker", registry=self.registry
        )
        self.busy = Gauge("bagserve_busy_workers", "workers computing", registry=self.registry)
        self.alive = Gauge("bagserve_alive_workers", "workers running", registry=self.registry)
        self.domain_score = Histogram(
            "bagserve_domain_score",
            "applicability-domain score of each predicted bag (about 1 in the training data)",
            ["model"],
            buckets=(0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 5, 10, 100),
            registry=self.registry,
        )
        self.out_of_range = Counter(
            "bagserve_out_of_range",
            "predicted bags outside their model's applicability domain",
            ["model"],
            registry=self.registry,
        )
        self.audit_records = Histogram(
            "bagserve_audit_commit_records",
            "audit and idempotency records committed in one transaction (group commit)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=self.registry,
        )
        self.audit_seconds = Histogram(
            "bagserve_audit_commit_seconds",
            "time of one group-commit transaction (audit, idempotency), its fsync included",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.load_failures = Gauge(
            "bagserve_model_load_failures", "artifacts refused at start-up", registry=self.registry
        )

    def observe_stages(self, timings: dict[str, float]) -> None:
        """Record seconds per prediction stage (read, parse, validate, ...)."""
        children = self._stage_children
        for stage, seconds in timings.items():
            child = children.get(stage)
            if child is not None:
                child.observe(seconds)

    def observe_audit_commit(self, records: int, seconds: float) -> None:
        """One group-commit transaction: how many records (audit, idempotency) it held
        and how long it took (called from the writer's thread; prometheus-client is
        thread-safe)."""
        self.audit_records.observe(records)
        self.audit_seconds.observe(seconds)

    def render(self, pool_status: dict[str, Any], failures: int) -> bytes:
        """The metrics in the Prometheus text format, with the pool's gauges updated."""
        self.queue_depth.set(pool_status["waiting"])
        self.busy.set(pool_status["busy"])
        self.alive.set(pool_status["alive"])
        self.load_failures.set(failures)
        return generate_latest(self.registry)
