"""Does the event loop stall while bodies are decoded? ``/healthz`` under heavy uploads.

Four clients upload 20 MB CSV bodies (about 600,000 cells x 3 markers each) to the demo
dose model as fast as they are answered, while a prober asks ``/healthz`` every 50 ms;
the prober's latencies (p50, p99, max) are what an orchestrator's liveness probe or
nginx's health check would see. Run twice in the same run, on the same models:

* before: the service as it was at ``--baseline`` (default ``afe8eac``, where bodies
  were decoded on the event loop), taken from git into a temporary directory and run
  with this virtualenv;
* after: this working tree (bodies decoded in the worker processes).

``.venv/bin/python bench/bench_event_loop.py`` (about two minutes); writes
bench/results/bench_event_loop.json. Loopback only.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from _report import report
from bagserve.core.demo import build_demo_models, demo_samples
from bench_service import free_port, process

ROOT = Path(__file__).resolve().parents[1]


def baseline_tree(revision: str, into: Path) -> Path:
    """An importable ``bagserve`` package of ``revision``: a directory to put first on
    PYTHONPATH (``core/`` and ``service/`` mapped under ``bagserve/`` as setuptools
    maps them)."""
    source = into / "source"
    source.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package = into / "path" / "bagserve"
    package.mkdir(parents=True)
    for f in (source / "bagserve").glob("*.py"):
        shutil.copy(f, package / f.name)
    (package / "core").symlink_to(source / "core")
    (package / "service").symlink_to(source / "service")
    return into / "path"


def csv_body(megabytes: float) -> bytes:
    bags, _, markers = demo_samples("dose", 1, 5)
    buf = io.StringIO()
    np.savetxt(buf, np.asarray(bags[0]), delimiter=",", fmt="%.6f")
    rows = buf.getvalue().encode()
    repeat = max(1, int(megabytes * 2**20 // len(rows)))
    return (",".join(markers) + "\n").encode() + rows * repeat


def measure(url: str, body: bytes, seconds: float, clients: int) -> dict[str, float]:
    stop = threading.Event()
    uploads: list[tuple[int, float]] = []
    probes: list[float] = []

    def upload() -> None:
        with httpx.Client(base_url=url, timeout=300) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                r = c.post(
                    "/v1/models/demo-dose/predict",
                    content=body,
                    headers={"content-type": "text/csv"},
                )
                uploads.append((r.status_code, time.perf_counter() - t0))

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=300) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                probes.append(time.perf_counter() - t0)
                time.sleep(0.05)

    threads = [threading.Thread(target=upload) for _ in range(clients)]
    threads.append(threading.Thread(target=probe))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    ms = 1000 * np.asarray(probes)
    ok = [s for code, s in uploads if code == 200]
    return {
        "healthz_probes": len(probes),
        "healthz_p50_ms": float(np.percentile(ms, 50)),
        "healthz_p99_ms": float(np.percentile(ms, 99)),
        "healthz_max_ms": float(ms.max()),
        "uploads_answered_200": len(ok),
        "uploads_other_status": len(uploads) - len(ok),
        "upload_median_s": float(np.median(ok)) if ok else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", default="afe8eac", help="git revision of 'before'")
    parser.add_argument("--seconds", type=float, default=45.0, help="per service")
    parser.add_argument("--megabytes", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a smoke run (not saved)")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.megabytes = 6.0, 2.0
    tmp = Path(tempfile.mkdtemp(prefix="bagserve-loop-"))
    models = tmp / "models"
    build_demo_models(models)
    body = csv_body(args.megabytes)
    base = baseline_tree(args.baseline, tmp / "baseline")
    results = []
    for name, pythonpath in ((f"before ({args.baseline})", str(base)), ("after", None)):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BAGSERVE_", "PYTHON"))}
        env.update(
            BAGSERVE_MODELS_DIR=str(models),
            BAGSERVE_PORT=str(port),
            BAGSERVE_WORKERS="2",
            BAGSERVE_LOG_LEVEL="warning",
            BAGSERVE_DATA_DIR=str(tmp / f"data-{port}"),
        )
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        url = f"http://127.0.0.1:{port}"
        # The console script, not ``python -m``: that would put the current directory
        # (this tree) before PYTHONPATH.
        cmd = [str(Path(sys.executable).parent / "bagserve"), "serve"]
        with process(cmd, env, f"{url}/readyz"):
            with httpx.Client(base_url=url, timeout=300) as c:  # warm up both workers
                for _ in range(2):
                    c.post(
                        "/v1/models/demo-dose/predict",
                        content=body,
                        headers={"content-type": "text/csv"},
                    )
            figures = measure(url, body, args.seconds, args.clients)
        results.append(
            {
                "case": f"{name}: {args.clients} clients x {len(body) / 2**20:.1f} MiB CSV, "
                f"{args.seconds:g} s",
                **figures,
            }
        )
    before, after = results
    results.append(
        {
            "case": "before / after",
            "healthz_p99_ratio": before["healthz_p99_ms"] / after["healthz_p99_ms"],
            "healthz_max_ratio": before["healthz_max_ms"] / after["healthz_max_ms"],
        }
    )
    report(results, "bench_event_loop", save=not args.quick)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
