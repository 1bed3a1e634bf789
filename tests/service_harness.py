"""Start the real service under uvicorn on 127.0.0.1 (a subprocess) for the HTTP tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bagserve.core import (
    Bags,
    ConditionalMeanEmbedding,
    DensityFeatures,
    DistributionRidge,
    DistributionRidgeClassifier,
    MeanEmbedding,
    SlicedWasserstein,
    save,
)
from bagserve.core.demo import build_demo_models
from bagserve.core.io import Panel, Preprocessing, read_sample
from bagserve.service.audit import AuditLog
from bagserve.service.database import Database

from .conftest import SHARED_DATA

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_slow_model(directory: Path) -> DistributionRidge:
    """``slow/1``: exact MMD against 40,000 training points, so that a 20,000-cell bag
    takes seconds (for queue, timeout and cancellation tests)."""
    rng = np.random.default_rng(0)
    train = [rng.normal(loc=i / 10, size=(2000, 3)) for i in range(20)]
    slow = DistributionRidge(MeanEmbedding(bandwidth=1.0), gamma=1.0, alpha=1e-3)
    slow.fit(train, np.arange(20.0))
    save(
        slow,
        directory / "slow" / "1",
        name="slow",
        version="1",
        panel=Panel(("a", "b", "c")).to_json(),
        preprocessing=Preprocessing().to_json(),
    )
    return slow


def build_models(directory: Path) -> Path:
    """Demo models, a deliberately slow model, and one broken artifact."""
    build_demo_models(directory)
    slow = build_slow_model(directory)
    yeast_files = sorted((SHARED_DATA / "cytoflow_yeast" / "dose_response").glob("Yeast_B*.fcs"))
    panel = Panel(("FSC-A", "SSC-A", "FITC-A"), {"FITC-A": ("GFP",)})
    bags = [panel.select(read_sample(f)) for f in yeast_files]
    pre = Preprocessing(transform="arcsinh", cofactor=150.0)
    yeast_bags = pre.apply(Bags.from_arrays(bags), list(panel.markers))
    dose_index = np.arange(len(bags), dtype=float)

    def keep(model: Any, name: str, version: str = "1") -> None:
        save(
            model,
            directory / name / version,
            name=name,
            version=version,
            panel=panel.to_json(),
            preprocessing=pre.to_json(),
        )

    yeast = DistributionRidge(SlicedWasserstein(n_directions=20, n_levels=20, random_state=0))
    yeast.fit(yeast_bags, dose_index)
    keep(yeast, "yeast", "1")
    keep(yeast, "yeast", "2")
    # Paper 001's density features with the random-feature (primal) path of the ridge.
    density = DistributionRidge(
        DensityFeatures(divergence="hellinger", n_basis=6, n_integration=500, random_state=0),
        n_components=300,
        random_state=0,
    )
    keep(density.fit(yeast_bags, dose_index), "density")
    # A bag classifier: conformal prediction sets and calibrated probabilities.
    level = np.where(dose_index > np.median(dose_index), "high", "low")
    classifier = DistributionRidgeClassifier(
        SlicedWasserstein(n_directions=20, n_levels=20, random_state=0)
    )
    keep(classifier.fit(yeast_bags, level), "yeast-level")
    # Paper 002: the conditional distribution of the dose index given a sample.
    cme = ConditionalMeanEmbedding(
        SlicedWasserstein(n_directions=20, n_levels=20), gamma=1.0, alpha=1e-3, random_state=0
    )
    keep(cme.fit(yeast_bags, dose_index), "cme")
    # Raw cytometry: each FCS file compensated with its own spillover matrix, then
    # logicle; trained on parts of one real uncompensated sample.
    raw = read_sample(SHARED_DATA / "flowsom_example" / "not_preprocessed.fcs")
    comp_panel = Panel(("CD4", "CD8", "CD19", "CD3"))
    comp_pre = Preprocessing(compensation="file", transform="logicle")
    parts = np.array_split(np.random.default_rng(1).permutation(raw.points.shape[0]), 8)
    comp_bags = Bags.from_arrays(
        [
            comp_panel.select(comp_pre.compensate(replace(raw, points=raw.points[rows])))
            for rows in parts
        ]
    )
    comp_bags = comp_pre.apply(comp_bags, list(comp_panel.markers))
    comp_model = DistributionRidge(SlicedWasserstein(n_directions=10, n_levels=10, random_state=0))
    comp_model.fit(comp_bags, np.arange(8.0))
    save(
        comp_model,
        directory / "raw-comp" / "1",
        name="raw-comp",
        version="1",
        panel=comp_panel.to_json(),
        preprocessing=comp_pre.to_json(),
    )
    # On points, not bags: refused by the registry with its reason.
    save(
        ConditionalMeanEmbedding(gamma=1.0, alpha=0.1).fit(np.eye(3), np.arange(3.0)),
        directory / "points-cme" / "1",
    )
    broken = save(slow, directory / "broken" / "1", name="broken", version="1")
    victim = sorted((broken / "arrays").glob("*.npy"))[0]
    victim.write_bytes(victim.read_bytes()[:-8])
    return directory


class ServiceURL(str):
    """The base URL of a running service, with the server's process id (``pid``)."""

    pid: int


@contextmanager
def running_service(models: Path, **env: str) -> Iterator[ServiceURL]:
    """``bagserve serve`` with BAGSERVE_* settings; yields its base URL.

    The data directory (jobs, idempotency, audit) defaults to a fresh one beside the
    models; pass BAGSERVE_DATA_DIR to share one across restarts.
    """
    port = free_port()
    env.setdefault("BAGSERVE_DATA_DIR", str(models.parent / f"data-{port}"))
    # A loaded CI machine (two test processes, each with a service and its workers)
    # can take several times the usual time for the deliberately slow requests: the
    # tests that check the timeout set their own.
    env.setdefault("BAGSERVE_REQUEST_TIMEOUT", "300")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BAGSERVE_")}
    environ.update(
        {
            "BAGSERVE_MODELS_DIR": str(models),
            "BAGSERVE_HOST": "127.0.0.1",
            "BAGSERVE_PORT": str(port),
            "BAGSERVE_WORKERS": "2",
            "BAGSERVE_LOG_FORMAT": "json",
            **env,
        }
    )
    exe = Path(sys.executable).parent / "bagserve"
    log = open(models.parent / f"serve-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(exe), "serve"], env=environ, stdout=log, stderr=subprocess.STDOUT)
    url = ServiceURL(f"http://127.0.0.1:{port}")
    url.pid = proc.pid
    try:
        wait_ready(url, proc)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def wait_ready(
    url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 120.0
) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the service exited with code {proc.returncode}")
        try:
            r = httpx.get(f"{url}/readyz", timeout=2)
            last = r
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"service not ready: {None if last is None else last.text}")


#: The stages a prediction's ``Server-Timing`` names, in the order it names them.
PREDICTION_STAGES = [
    "read",
    "parse",
    "validate",
    "queue",
    "transfer",
    "compute",
    "audit",
    "encode",
    "app",
]


def server_timing(response: Any) -> dict[str, float]:
    """An answer's ``Server-Timing`` header as milliseconds per stage, in its order,
    checked: every stage is a duration of at least 0, and ``app`` holds the others."""
    parts = (part.split(";dur=") for part in response.headers["server-timing"].split(", "))
    stages = {name: float(dur) for name, dur in parts}
    assert all(v >= 0 for v in stages.values())
    assert stages["app"] >= sum(v for k, v in stages.items() if k != "app")
    return stages


def logged(
    paths: Callable[[], Iterable[Path]], found: Callable[[dict], bool], timeout: float = 10.0
) -> list[dict]:
    """The JSON log records of ``paths()`` once one of them is ``found`` (all records).

    A server writes a request's log line after the client has its answer (nginx in its
    log phase, the service after the response), so a test waits for the line instead of
    racing it. Only complete lines are read: one being written may be cut."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [ln for p in paths() for ln in p.read_text().split("\n")[:-1]]
        records = [json.loads(ln) for ln in lines if ln.startswith("{")]
        if any(found(r) for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def metric_samples(url: str, name: str) -> list[Any]:
    """The samples called ``name`` (``bagserve_requests_total``, ...) in the service's
    ``/metrics``, parsed by prometheus-client."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    return [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def stage_counts(url: str) -> dict[str, float]:
    """How many observations each prediction stage has in the service's ``/metrics``
    (every stage's series exists from the start: a test compares counts, not names)."""
    return {s.labels["stage"]: s.value for s in metric_samples(url, "bagserve_stage_seconds_count")}


def audit_log(data_dir: Path) -> AuditLog:
    """The audit chain of a service whose state is SQLite in ``data_dir``."""
    return AuditLog(Database(None, data_dir, pool_size=1))


def audit_count(data_dir: Path) -> int:
    """Records in that chain (0 before the service made its database)."""
    if not (data_dir / "bagserve.sqlite3").exists():
        return 0
    log = audit_log(data_dir)
    try:
        return log.count()
    finally:
        log.db.close()
