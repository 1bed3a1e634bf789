"""Service overhead and throughput, on loopback only, each against a baseline of the same run.

1. A 10^5 x 10 bag: end-to-end time minus the same run's in-process compute (load the
   artifact, preprocess, predict), for an NPY body and a JSON body.
2. The same JSON request against a naive FastAPI endpoint (pydantic list[list[float]],
   compute in the event loop; bench/naive_app.py): the ratio of end-to-end times.
3. Tiny requests at concurrency 1: readiness and a 100-point bag, p50 and p99 latency.
4. Throughput on 10^4-point bags with 1 and 2 workers (concurrency 4), and the ratio.

Every figure is the median of several runs; run with ``make bench`` or
``.venv/bin/python bench/bench_service.py``. Writes bench/results/bench_service.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from bagserve.core import DistributionRidge, SlicedWasserstein, load, save
from bagserve.core.io import Panel, Preprocessing
from threadpoolctl import threadpool_limits

RESULTS = Path(__file__).resolve().parent / "results"
MARKERS = [f"m{i}" for i in range(10)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def process(
    cmd: list[str],
    env: dict[str, str],
    ready_url: str,
    cwd: str | Path | None = None,
    timeout: float = 300.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """A server process (the benchmarks' one way to run one), until ``ready_url``
    answers 200; stopped by SIGTERM on leaving, killed if it lingers. Yields the
    process."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(ready_url)
            time.sleep(0.2)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def service(models: Path, workers: int):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BAGSERVE_")}
    env.update(
        BAGSERVE_MODELS_DIR=str(models),
        BAGSERVE_PORT=str(port),
        BAGSERVE_WORKERS=str(workers),
        BAGSERVE_LOG_LEVEL="warning",
        BAGSERVE_QUEUE_SIZE="64",
    )
    exe = str(Path(sys.executable).parent / "bagserve")
    url = f"http://127.0.0.1:{port}"
    return url, process([exe, "serve"], env, f"{url}/readyz")


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def build_model(directory: Path) -> Path:
    rng = np.random.default_rng(0)
    bags = [rng.normal(loc=rng.normal(size=10) * 0.3, size=(500, 10)) for _ in range(200)]
    y = np.array([b[:, 0].mean() for b in bags])
    model = DistributionRidge(SlicedWasserstein(random_state=0), gamma=1.0, alpha=1e-3).fit(bags, y)
    return save(
        model,
        directory / "bench" / "1",
        name="bench",
        version="1",
        panel=Panel(tuple(MARKERS)).to_json(),
        preprocessing=Preprocessing().to_json(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=8.0, help="per throughput run")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bagserve-bench-"))
    models = tmp / "models"
    artifact = build_model(models)
    rng = np.random.default_rng(1)
    bag = rng.normal(size=(100_000, 10))
    buf = io.BytesIO()
    np.save(buf, bag)
    npy_body = buf.getvalue()
    json_body = orjson.dumps(
        {"bags": [{"id": "b", "markers": MARKERS, "points": bag}]},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
    naive_body = orjson.dumps(
        {"bags": [{"id": "b", "points": bag}]}, option=orjson.OPT_SERIALIZE_NUMPY
    )
    results: dict[str, Any] = {"bag": "100000 x 10", "json_mib": len(json_body) / 2**20}

    model = load(artifact)
    pre = Preprocessing()
    from bagserve.core import Bags

    def in_process() -> None:
        # The workers run with one BLAS thread each: so does the baseline.
        with threadpool_limits(1):
            model.predict(pre.apply(Bags.from_arrays([bag]), MARKERS))

    url, ctx = service(models, 1)
    with ctx, httpx.Client(base_url=url, timeout=120) as c:
        path = "/v1/models/bench/predict"

        stages: dict[str, list[dict[str, float]]] = {"npy": [], "json": []}

        def server_timing(r: httpx.Response, kind: str) -> None:
            assert r.status_code == 200, r.text
            parts = (p.split(";dur=") for p in r.headers["server-timing"].split(", "))
            stages[kind].append({k: float(v) for k, v in parts})

        def post_npy() -> None:
            r = c.post(
                path,
                content=npy_body,
                params={"markers": ",".join(MARKERS)},
                headers={"content-type": "application/x-npy"},
            )
            server_timing(r, "npy")

        def post_json() -> None:
            r = c.post(path, content=json_body, headers={"content-type": "application/json"})
            server_timing(r, "json")

        post_npy(), post_json(), in_process()  # warm up
        # Interleaved, so that the machine's drift hits baseline and requests alike.
        times: dict[str, list[float]] = {"compute": [], "npy": [], "json": []}
        for _ in range(args.repeat):
            for key, fn in (("compute", in_process), ("npy", post_npy), ("json", post_json)):
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
        compute, e2e_npy, e2e_json = (
            float(np.median(times[k])) for k in ("compute", "npy", "json")
        )
        results.update(
            in_process_compute_ms=1000 * compute,
            e2e_npy_ms=1000 * e2e_npy,
            e2e_json_ms=1000 * e2e_json,
            overhead_npy_ms=1000 * (e2e_npy - compute),
            overhead_json_ms=1000 * (e2e_json - compute),
        )
        # The server's own account of the same requests (Server-Timing, medians), and the
        # overhead against the worker's own compute time, which is free of the noise
        # between two processes' compute.
        for kind, runs in stages.items():
            for stage in runs[0]:
                results[f"server_{kind}_{stage}_ms"] = float(np.median([r[stage] for r in runs]))
        for kind, e2e in (("npy", times["npy"]), ("json", times["json"])):
            worker = [r["compute"] / 1000 for r in stages[kind][-args.repeat :]]
            results[f"overhead_vs_worker_compute_{kind}_ms"] = 1000 * float(
                np.median(np.subtract(e2e, worker))
            )
        small = {
            "bags": [{"id": "s", "markers": MARKERS, "points": rng.normal(size=(100, 10)).tolist()}]
        }
        lat = {"readyz": [], "predict_100_points": []}
        for _ in range(300):
            t0 = time.perf_counter()
            c.get("/readyz")
            lat["readyz"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            c.post(path, json=small)
            lat["predict_100_points"].append(time.perf_counter() - t0)
        for k, v in lat.items():
            results[f"{k}_p50_ms"] = 1000 * float(np.percentile(v, 50))
            results[f"{k}_p99_ms"] = 1000 * float(np.percentile(v, 99))

    port = free_port()
    env = {**os.environ, "BAGSERVE_NAIVE_MODEL": str(artifact)}
    naive_cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "bench.naive_app:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    with process(naive_cmd, env, f"http://127.0.0.1:{port}/docs"), httpx.Client(timeout=300) as c:

        def post_naive() -> None:
            r = c.post(
                f"http://127.0.0.1:{port}/predict",
                content=naive_body,
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 200, r.text

        def post_sink() -> None:
            r = c.post(
                f"http://127.0.0.1:{port}/sink",
                content=npy_body,
                headers={"content-type": "application/x-npy"},
            )
            assert r.status_code == 200, r.text

        post_naive(), post_sink()
        e2e_naive = median_time(post_naive, max(3, args.repeat // 2))
        floor = median_time(post_sink, args.repeat)
        results.update(
            transport_floor_npy_ms=1000 * floor,
            overhead_npy_above_floor_ms=1000 * (e2e_npy - compute - floor),
        )
        results.update(
            naive_json_ms=1000 * e2e_naive,
            speedup_json_vs_naive=e2e_naive / e2e_json,
            speedup_npy_vs_naive=e2e_naive / e2e_npy,
        )

    medium = rng.normal(size=(10_000, 10))
    buf = io.BytesIO()
    np.save(buf, medium)
    medium_body = buf.getvalue()

    def hammer(url: str, stop: float, done: list[int]) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while time.monotonic() < stop:
                r = c.post(
                    "/v1/models/bench/predict",
                    content=medium_body,
                    headers={"content-type": "application/x-npy"},
                )
                if r.status_code == 200:
                    done.append(1)

    for workers in (1, 2):
        url, ctx = service(models, workers)
        with ctx:
            done: list[int] = []
            t0 = time.monotonic()
            threads = [
                threading.Thread(target=hammer, args=(url, t0 + args.seconds, done))
                for _ in range(4)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            results[f"throughput_{workers}_workers_per_s"] = len(done) / (time.monotonic() - t0)
    results["throughput_ratio_2_to_1"] = (
        results["throughput_2_workers_per_s"] / results["throughput_1_workers_per_s"]
    )

    for k, v in results.items():
        print(f"{k:34s} {v:.4g}" if isinstance(v, float) else f"{k:34s} {v}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_service.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'bench_service.json'}")


if __name__ == "__main__":
    main()
