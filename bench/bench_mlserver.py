"""bagserve against Seldon's MLServer 1.7.1 on the same Open Inference Protocol bodies.

Both servers run on 127.0.0.1 with 2 inference worker processes, started by this script,
and serve the demo dose model (``bagserve demo``): bagserve as it ships, MLServer through
``bench/mlserver_runtime.py``, a custom runtime that calls the same
:meth:`ModelRuntime.predict` on the same artifact with one BLAS thread and answers the
same outputs (prediction, status, out-of-range flag, domain score). The model's work is
thus identical and small (under a millisecond for 100 points): what differs is each
server's own cost around it, which is what the comparison is about. bagserve does more
there (validation of the bag against the model's panel and limits, the input's sha256,
an audit record committed before the answer), and the figures include it.

Both keep their default logging (an access line per request). MLServer lives in its
own venv (``~/.cache/bagserve-bench/mlserver-venv``, or ``$BAGSERVE_BENCH_CACHE``),
created on first use with ``pip install mlserver==1.7.1`` and this checkout of bagserve
without its service dependencies.

Measured, every figure beside the other server's in the same run, requests interleaved
(one to each server in turn; throughput rounds alternate which server goes first):

* single client: latency median and p99 of a 100 x 3 and a 10^5 x 3 bag, and the
  overhead (latency minus the in-process compute of the same bag, timed in between);
* 8 concurrent clients (httpx, one connection each): requests per second and p99.

Ratios are bagserve / MLServer. Writes ``bench/results/bench_mlserver.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from bagserve.core.bags import Bags
from bagserve.core.datasets import make_dose_response_bags
from bagserve.core.demo import build_demo_models
from bagserve.core.runtime import ModelRuntime
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import report
from bench_service import free_port, process

ROOT = Path(__file__).resolve().parents[1]
MLSERVER = "mlserver==1.7.1"
#: What the MLServer venv needs besides MLServer: bagserve's model code and its numerics,
#: and uvloop 0.21 (MLServer 1.7.1's time): with uvloop 0.22 on, asyncio.get_event_loop()
#: raises in MLServer's worker processes, which exit at start.
MODEL_DEPS = ["scipy", "scikit-learn", "threadpoolctl", "joblib", "uvloop==0.21.0"]
MODEL = "demo-dose"
WORKERS = 2
CLIENTS = 8


def mlserver_venv() -> Path:
    """The bin directory of MLServer's venv, created (or brought up to date) first."""
    cache = Path(os.environ.get("BAGSERVE_BENCH_CACHE", Path.home() / ".cache" / "bagserve-bench"))
    venv = cache / "mlserver-venv"
    marker = venv / ".bagserve-bench"
    wanted = f"{MLSERVER} {' '.join(MODEL_DEPS)} bagserve@{ROOT}\n"
    if marker.exists() and marker.read_text() == wanted:
        return venv / "bin"
    print(f"creating {venv} ({MLSERVER}) ...", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, MLSERVER, *MODEL_DEPS], check=True)
    # The model code only (bagserve.core): MLServer's own FastAPI and pydantic stay.
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
    marker.write_text(wanted)
    return venv / "bin"


def start_bagserve(stack: ExitStack, models: Path, tmp: Path) -> str:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BAGSERVE_")}
    env.update(BAGSERVE_DATA_DIR=str(tmp / "bagserve-data"), BAGSERVE_QUEUE_SIZE="64")
    exe = str(Path(sys.executable).parent / "bagserve")
    cmd = [exe, "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--models", str(models), "--workers", str(WORKERS)]
    url = f"http://127.0.0.1:{port}"
    stack.enter_context(process(cmd, env, f"{url}/readyz"))
    return f"{url}/v2/models/{MODEL}/infer"


def start_mlserver(stack: ExitStack, bin_dir: Path, models: Path, tmp: Path) -> str:
    folder = tmp / "mlserver"
    (folder / MODEL).mkdir(parents=True)
    http, grpc, metrics = free_port(), free_port(), free_port()
    settings = {
        "host": "127.0.0.1",
        "http_port": http,
        "grpc_port": grpc,
        "metrics_port": metrics,
        "parallel_workers": WORKERS,
    }
    (folder / "settings.json").write_bytes(orjson.dumps(settings))
    model = {
        "name": MODEL,
        "implementation": "mlserver_runtime.BagRuntime",
        "parameters": {"uri": str(models / MODEL / "1"), "version": "1"},
    }
    (folder / MODEL / "model-settings.json").write_bytes(orjson.dumps(model))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLSERVER_", "BAGSERVE_"))}
    # The runtime module, importable by MLServer and by its worker processes.
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent)
    url = f"http://127.0.0.1:{http}"
    cmd = [str(bin_dir / "mlserver"), "start", str(folder)]
    stack.enter_context(process(cmd, env, f"{url}/v2/models/{MODEL}/ready", cwd=folder))
    return f"{url}/v2/models/{MODEL}/infer"


def body(points: np.ndarray) -> bytes:
    """One bag as an Open Inference Protocol JSON request (the same bytes to both)."""
    doc = {
        "inputs": [
            {"name": "points", "datatype": "FP64", "shape": list(points.shape), "data": points}
        ]
    }
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def stages(header: str | None) -> dict[str, float]:
    """bagserve's ``Server-Timing`` as milliseconds per stage."""
    if not header:
        return {}
    parts = (p.split(";dur=") for p in header.split(", "))
    return {k: float(v) for k, v in parts}


async def post(client: httpx.AsyncClient, url: str, content: bytes) -> httpx.Response:
    r = await client.post(url, content=content, headers={"content-type": "application/json"})
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
    return r


async def latencies(
    urls: dict[str, str], content: bytes, n: int, compute: Any
) -> dict[str, list[float]]:
    """``n`` requests to each server from one client, in turn (the order alternating),
    with the in-process compute of the same bag timed between them."""
    out: dict[str, list[float]] = {name: [] for name in [*urls, "compute", "audit"]}
    async with httpx.AsyncClient(timeout=300) as client:
        for name in urls:  # warm up: connections, the workers' first call
            for _ in range(3):
                await post(client, urls[name], content)
        for i in range(n):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            for name in order:
                t0 = time.perf_counter()
                r = await post(client, urls[name], content)
                out[name].append(time.perf_counter() - t0)
                if name == "bagserve":  # its audit record's commit, in seconds
                    out["audit"].append(stages(r.headers.get("server-timing"))["audit"] / 1000)
            t0 = time.perf_counter()
            compute()
            out["compute"].append(time.perf_counter() - t0)
    return out


async def load(url: str, content: bytes, total: int) -> tuple[float, list[float], list[dict]]:
    """``total`` requests from :data:`CLIENTS` concurrent clients: requests per second,
    each request's latency and (bagserve) its stages."""
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    lat: list[float] = []
    timings: list[dict[str, float]] = []
    left = total
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.gather(*(post(client, url, content) for _ in range(CLIENTS)))

        async def one_client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                r = await post(client, url, content)
                lat.append(time.perf_counter() - t0)
                timings.append(stages(r.headers.get("server-timing")))

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(CLIENTS)))
        elapsed = time.perf_counter() - t0
    return total / elapsed, lat, timings


def ms(seconds: list[float], q: float) -> float:
    return 1000 * float(np.percentile(seconds, q))


def compare(
    urls: dict[str, str], points: np.ndarray, runtime: ModelRuntime, args: argparse.Namespace
) -> dict[str, Any]:
    """The single-client and 8-client figures of one bag size on both servers."""
    n = len(points)
    large = n > 10_000
    content = body(points)
    bags = Bags(points, np.array([0, n], dtype=np.int64), validate=False)

    def compute() -> None:
        runtime.predict(bags)

    case = f"{n} x {points.shape[1]} bag (JSON {len(content) / 1024:.0f} KiB)"
    print(f"{case}: single client ...", flush=True)
    single = asyncio.run(
        latencies(urls, content, args.large_repeat if large else args.repeat, compute)
    )
    floor = float(np.median(single["compute"]))
    out: dict[str, Any] = {"case": case, "in_process_compute_ms": 1000 * floor}
    for name in urls:
        out[f"{name}_latency_p50_ms"] = ms(single[name], 50)
        out[f"{name}_latency_p99_ms"] = ms(single[name], 99)
        out[f"{name}_overhead_ms"] = 1000 * (float(np.median(single[name])) - floor)
    # The durable audit record's share of bagserve's latency (one fsync at least).
    out["bagserve_audit_p50_ms"] = ms(single["audit"], 50)
    out["latency_p50_ratio"] = out["bagserve_latency_p50_ms"] / out["mlserver_latency_p50_ms"]
    out["overhead_ratio"] = out["bagserve_overhead_ms"] / out["mlserver_overhead_ms"]

    print(f"{case}: {CLIENTS} clients ...", flush=True)
    total = args.large_total if large else args.total
    rates: dict[str, list[float]] = {name: [] for name in urls}
    lats: dict[str, list[float]] = {name: [] for name in urls}
    timings: list[dict[str, float]] = []
    for r in range(args.rounds):
        for name in list(urls) if r % 2 == 0 else list(reversed(urls)):
            rate, lat, st = asyncio.run(load(urls[name], content, total))
            rates[name].append(rate)
            lats[name] += lat
            if name == "bagserve":
                timings += st
    for name in urls:
        out[f"{name}_{CLIENTS}_clients_req_per_s"] = float(np.median(rates[name]))
        out[f"{name}_{CLIENTS}_clients_p99_ms"] = ms(lats[name], 99)
    out["throughput_ratio"] = (
        out[f"bagserve_{CLIENTS}_clients_req_per_s"] / out[f"mlserver_{CLIENTS}_clients_req_per_s"]
    )
    out["p99_ratio"] = (
        out[f"bagserve_{CLIENTS}_clients_p99_ms"] / out[f"mlserver_{CLIENTS}_clients_p99_ms"]
    )
    # Where bagserve's time went under load: its own Server-Timing, mean per stage.
    for stage in timings[0]:
        out[f"bagserve_{CLIENTS}_clients_{stage}_mean_ms"] = float(
            np.mean([t.get(stage, 0.0) for t in timings])
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, help="demo models (default: trained anew)")
    parser.add_argument("--repeat", type=int, default=300, help="small-bag requests per server")
    parser.add_argument("--large-repeat", type=int, default=15)
    parser.add_argument("--total", type=int, default=600, help="small requests per load round")
    parser.add_argument("--large-total", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6, help="load rounds per server")
    parser.add_argument("--quick", action="store_true", help="a smoke run (not saved)")
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.large_repeat, args.total, args.large_total, args.rounds = 30, 3, 80, 8, 2

    bin_dir = mlserver_venv()
    # The in-process compute runs with one BLAS thread, as both servers' workers do (set
    # once: entering threadpool_limits costs milliseconds, more than the small bag's work).
    threadpool_limits(1)
    tmp = Path(tempfile.mkdtemp(prefix="bagserve-bench-mlserver-"))
    try:
        models = args.models
        if models is None:
            models = tmp / "models"
            build_demo_models(models)
        runtime = ModelRuntime.open(models / MODEL / "1", mmap=True)
        with ExitStack() as stack:
            urls = {
                "bagserve": start_bagserve(stack, models, tmp),
                "mlserver": start_mlserver(stack, bin_dir, models, tmp),
            }
            results = []
            for n, seed in ((100, 1), (100_000, 2)):
                bags, _, _ = make_dose_response_bags(1, n, random_state=[7, seed])
                points = np.ascontiguousarray(bags[0], dtype=np.float64)
                results.append(compare(urls, points, runtime, args))
        report(results, "bench_mlserver", save=not args.quick, width=40)
        small = results[0]
        print(
            f"\ngoals (small bag, {CLIENTS} clients): throughput ratio "
            f"{small['throughput_ratio']:.2f} (>= 1: "
            f"{'met' if small['throughput_ratio'] >= 1 else 'not met'}), p99 ratio "
            f"{small['p99_ratio']:.2f} (<= 2: {'met' if small['p99_ratio'] <= 2 else 'not met'})"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
