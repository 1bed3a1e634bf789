"""Jobs per second through one and two replicas, on SQLite and on PostgreSQL.

Each case starts the replicas (``bagserve serve`` on 127.0.0.1, one compute worker
each) on one shared database, submits ``--jobs`` small prediction jobs (a 200-cell bag
of the demo dose model, so that the job machinery, not the computation, is measured)
from 4 client threads spread over the replicas, and times from the first submission
until the database counts every job succeeded. Reported: submissions per second,
jobs finished per second, and each case's ratio to the first case of the same run
(SQLite, one replica). PostgreSQL is a private server started like the tests'
(``tests/postgres.py``; needs Debian's postgresql package).

Run with ``make bench`` or ``.venv/bin/python bench/bench_jobs.py [--jobs 300]``.
Writes bench/results/bench_jobs.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bagserve.core.demo import build_demo_models, demo_samples  # noqa: E402
from bagserve.service.database import Database  # noqa: E402

from bench._report import report  # noqa: E402
from tests.postgres import postgres_server  # noqa: E402
from tests.service_harness import running_service  # noqa: E402


@contextmanager
def replicas(models: Path, database: str, n: int, root: Path) -> Iterator[list[str]]:
    """``n`` replicas (the tests' launcher), one compute worker each, on ``database``."""
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                running_service(
                    models,
                    BAGSERVE_DATA_DIR=str(root / f"data-{i}"),
                    BAGSERVE_DATABASE_URL=database,
                    BAGSERVE_WORKERS="1",
                    BAGSERVE_LOG_LEVEL="warning",
                )
            )
            for i in range(n)
        ]


def succeeded(database: str) -> int:
    db = Database(database, Path(tempfile.gettempdir()), pool_size=1)
    try:
        with db.transaction(write=False) as cur:
            row = cur.execute("SELECT count(*) FROM jobs WHERE status = 'succeeded'").fetchone()
        return int(row[0]) if row else 0
    finally:
        db.close()


def run_case(urls: list[str], database: str, n_jobs: int, body: dict[str, Any]) -> dict:
    before = succeeded(database)
    failures: list[str] = []
    counter = iter(range(n_jobs))
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(timeout=60) as http:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                url = urls[(i + k) % len(urls)]
                r = http.post(f"{url}/v1/jobs", params={"model": "demo-dose"}, json=body)
                if r.status_code != 202:
                    failures.append(r.text)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    submitted = time.perf_counter() - t0
    assert not failures, failures[:3]
    deadline = time.monotonic() + 600
    while succeeded(database) - before < n_jobs:
        assert time.monotonic() < deadline, "jobs did not finish"
        time.sleep(0.02)
    total = time.perf_counter() - t0
    return {
        "jobs": n_jobs,
        "submitted_per_s": n_jobs / submitted,
        "finished_per_s": n_jobs / total,
        "seconds": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="few jobs, nothing written")
    args = parser.parse_args()
    n_jobs = 20 if args.smoke else args.jobs
    bags, _, markers = demo_samples("dose", 1, 3)
    body = {"bags": [{"markers": markers, "points": np.asarray(bags[0])[:200].tolist()}]}
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bagserve-bench-jobs-") as tmp:
        root = Path(tmp)
        models = root / "models"
        build_demo_models(models)
        with postgres_server() as pg:
            for engine, n in (("sqlite", 1), ("sqlite", 2), ("postgresql", 1), ("postgresql", 2)):
                case_root = root / f"{engine}-{n}"
                case_root.mkdir()
                database = f"sqlite:///{case_root / 'state.sqlite3'}" if engine == "sqlite" else pg
                with replicas(models, database, n, case_root) as urls:
                    run_case(urls, database, 10, body)  # warm-up: imports, first claims
                    figures = run_case(urls, database, n_jobs, body)
                results.append({"case": f"{engine}, {n} replica(s)", **figures})
    baseline = results[0]["finished_per_s"]
    for r in results:
        r["ratio_to_sqlite_1_replica"] = r["finished_per_s"] / baseline
    report(results, "bench_jobs", save=not args.smoke)


if __name__ == "__main__":
    main()
