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
  for the large bag also bagserve with the binary tensor extension (the same bag as
  raw float64 after a JSON header) against MLServer's JSON;
* 8 concurrent clients (httpx, one connection each): requests per second and p99;
* bagserve's own ``Server-Timing`` stages (read, parse, queue, transfer, compute,
  audit, encode, app), median per request with one client and mean under 8;
* under 8 clients, the CPU each server's processes take per request (bagserve's split
  into its event loop's thread, its other threads and its worker processes), the
  benchmark client's own, and how busy the machine's cores were (Linux, from
  ``/proc``): on a 2-core machine the client and both servers' processes share the
  cores, and when they are all busy the requests per second follow the CPU per request
  rather than any one stage's wait;
* the latency of one ``fdatasync`` in bagserve's data directory, before and after the
  cases: the floor of each audit commit, which is the disk's (``--data-dir`` on a
  tmpfs takes the disk out, to tell the disk's share from the code's).

Ratios are bagserve / MLServer. The run ends with the rows of issue 47's table, each
against its goal, and the machine's load average (1 minute) before and after each
case: on 2 shared cores the other work on the machine moves every figure. Writes
``bench/results/bench_mlserver.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
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


def start_bagserve(stack: ExitStack, models: Path, data_dir: Path) -> tuple[str, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BAGSERVE_")}
    env.update(BAGSERVE_DATA_DIR=str(data_dir), BAGSERVE_QUEUE_SIZE="64")
    exe = str(Path(sys.executable).parent / "bagserve")
    cmd = [exe, "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--models", str(models), "--workers", str(WORKERS)]
    url = f"http://127.0.0.1:{port}"
    proc = stack.enter_context(process(cmd, env, f"{url}/readyz"))
    return f"{url}/v2/models/{MODEL}/infer", proc.pid


def start_mlserver(stack: ExitStack, bin_dir: Path, models: Path, tmp: Path) -> tuple[str, int]:
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
    proc = stack.enter_context(process(cmd, env, f"{url}/v2/models/{MODEL}/ready", cwd=folder))
    return f"{url}/v2/models/{MODEL}/infer", proc.pid


#: The rows of issue 47's table: the ratio's key, the case (0: small bag, 1: large
#: bag), the goal's comparison and value (None: keep what it was).
GOALS = [
    ("small bag (100x3) overhead, one client", "overhead_ratio", 0, "<=", 1.0),
    (f"{CLIENTS} clients, small bag: requests/s", "throughput_ratio", 0, ">=", 1.2),
    (f"{CLIENTS} clients, small bag: p99", "p99_ratio", 0, "<=", 1.0),
    ("large bag (10^5x3) overhead, JSON", "overhead_ratio", 1, "<=", 0.5),
    ("large bag, binary vs MLServer JSON", "binary_overhead_ratio", 1, "keep", None),
]
JSON_HEADERS = {"content-type": "application/json"}


def body(points: np.ndarray) -> bytes:
    """One bag as an Open Inference Protocol JSON request (the same bytes to both)."""
    doc = {
        "inputs": [
            {"name": "points", "datatype": "FP64", "shape": list(points.shape), "data": points}
        ]
    }
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def binary_body(points: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """The same bag with the binary tensor extension: a JSON header, then the raw
    little-endian float64 values; with the headers that say so."""
    raw = np.ascontiguousarray(points, dtype="<f8").tobytes()
    head = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "points",
                    "datatype": "FP64",
                    "shape": list(points.shape),
                    "parameters": {"binary_data_size": len(raw)},
                }
            ]
        }
    )
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(head)),
    }
    return head + raw, headers


def load_average() -> float:
    """The machine's load average over the last minute."""
    return os.getloadavg()[0]


def _cpu_of(stat: Path) -> float:
    """User + system CPU seconds in a ``/proc`` ``stat`` file (0 if it is gone)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(pid: int) -> np.ndarray:
    """CPU seconds used so far by server process ``pid``: its main thread (the event
    loop), its other threads, and its descendants (worker processes), from ``/proc``
    (Linux; zeros elsewhere). A descendant that exited meanwhile is not counted."""
    proc = Path(f"/proc/{pid}")
    if not proc.exists():
        return np.zeros(3)
    main = _cpu_of(proc / "task" / str(pid) / "stat")
    whole = _cpu_of(proc / "stat")
    descendants, todo = 0.0, [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            descendants += sum(_cpu_of(Path(f"/proc/{c}/stat")) for c in children)
            todo += children
    return np.array([main, whole - main, descendants])


def machine_cpu() -> np.ndarray:
    """Busy and total CPU seconds of the whole machine so far (``/proc/stat``; zeros
    elsewhere)."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return np.zeros(2)
    idle = ticks[3] + ticks[4]  # idle, iowait
    return np.array([sum(ticks) - idle, sum(ticks)]) / os.sysconf("SC_CLK_TCK")


def flush_latency(directory: Path, n: int = 200) -> tuple[float, float]:
    """Median and 90th percentile, in ms, of one ``fdatasync`` after rewriting five
    pages of a file in ``directory``: what the disk under bagserve's database takes
    for the one flush of each audit commit (SQLite rewrites its WAL in place once
    it has wrapped), measured beside the servers rather than inside them."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "flush-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        page = b"\x00" * (5 * 4096)
        os.write(fd, page * n)
        os.fdatasync(fd)
        seconds = []
        for i in range(n):
            os.pwrite(fd, page, i * len(page))
            t0 = time.perf_counter()
            os.fdatasync(fd)
            seconds.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return ms(seconds, 50), ms(seconds, 90)


def stages(header: str | None) -> dict[str, float]:
    """bagserve's ``Server-Timing`` as milliseconds per stage."""
    if not header:
        return {}
    parts = (p.split(";dur=") for p in header.split(", "))
    return {k: float(v) for k, v in parts}


async def post(
    client: httpx.AsyncClient, url: str, content: bytes, headers: dict[str, str] = JSON_HEADERS
) -> httpx.Response:
    r = await client.post(url, content=content, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
    return r


#: A request kind: the server's URL, the body and its headers.
Target = tuple[str, bytes, dict[str, str]]


async def latencies(
    targets: dict[str, Target], n: int, compute: Any
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """``n`` requests of each target from one client, in turn (the order alternating),
    with the in-process compute of the same bag timed between them; the seconds of
    each, and each bagserve answer's stages."""
    out: dict[str, list[float]] = {name: [] for name in [*targets, "compute"]}
    timings: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    async with httpx.AsyncClient(timeout=300) as client:
        for name in targets:  # warm up: connections, the workers' first call
            for _ in range(3):
                await post(client, *targets[name])
        for i in range(n):
            order = list(targets) if i % 2 == 0 else list(reversed(targets))
            for name in order:
                t0 = time.perf_counter()
                r = await post(client, *targets[name])
                out[name].append(time.perf_counter() - t0)
                timings[name].append(stages(r.headers.get("server-timing")))
            t0 = time.perf_counter()
            compute()
            out["compute"].append(time.perf_counter() - t0)
    return out, timings


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
    urls: dict[str, str],
    pids: dict[str, int],
    points: np.ndarray,
    runtime: ModelRuntime,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The single-client and 8-client figures of one bag size on both servers (``pids``:
    their server processes, for the CPU they take)."""
    n = len(points)
    large = n > 10_000
    content = body(points)
    bags = Bags(points, np.array([0, n], dtype=np.int64), validate=False)

    def compute() -> None:
        runtime.predict(bags)

    case = f"{n} x {points.shape[1]} bag (JSON {len(content) / 1024:.0f} KiB)"
    out: dict[str, Any] = {"case": case, "load_average_before": load_average()}
    print(f"{case}: single client (load average {out['load_average_before']:.2f}) ...", flush=True)
    targets: dict[str, Target] = {name: (url, content, JSON_HEADERS) for name, url in urls.items()}
    if large:
        targets["bagserve_binary"] = (urls["bagserve"], *binary_body(points))
    single, single_stages = asyncio.run(
        latencies(targets, args.large_repeat if large else args.repeat, compute)
    )
    floor = float(np.median(single["compute"]))
    out["in_process_compute_ms"] = 1000 * floor
    for name in targets:
        out[f"{name}_latency_p50_ms"] = ms(single[name], 50)
        out[f"{name}_latency_p99_ms"] = ms(single[name], 99)
        out[f"{name}_overhead_ms"] = 1000 * (float(np.median(single[name])) - floor)
    out["latency_p50_ratio"] = out["bagserve_latency_p50_ms"] / out["mlserver_latency_p50_ms"]
    out["overhead_ratio"] = out["bagserve_overhead_ms"] / out["mlserver_overhead_ms"]
    if large:
        out["binary_overhead_ratio"] = (
            out["bagserve_binary_overhead_ms"] / out["mlserver_overhead_ms"]
        )
    # Where bagserve's time went with one client: its Server-Timing, median per stage
    # (the audit stage is the durable record's commit, one fsync at least).
    for name in (n for n in targets if n.startswith("bagserve")):
        for stage in single_stages[name][0]:
            values = [t.get(stage, 0.0) for t in single_stages[name]]
            out[f"{name}_1_client_{stage}_p50_ms"] = float(np.median(values))

    print(f"{case}: {CLIENTS} clients ...", flush=True)
    total = args.large_total if large else args.total
    rates: dict[str, list[float]] = {name: [] for name in urls}
    lats: dict[str, list[float]] = {name: [] for name in urls}
    timings: list[dict[str, float]] = []
    # CPU seconds per server over its rounds: the server's (loop, other threads,
    # workers), the client's (this process), and the machine's (busy, total).
    cpu = {name: np.zeros(6) for name in urls}
    for r in range(args.rounds):
        for name in list(urls) if r % 2 == 0 else list(reversed(urls)):
            before = np.r_[server_cpu(pids[name]), time.process_time(), machine_cpu()]
            rate, lat, st = asyncio.run(load(urls[name], content, total))
            cpu[name] += np.r_[server_cpu(pids[name]), time.process_time(), machine_cpu()] - before
            rates[name].append(rate)
            lats[name] += lat
            if name == "bagserve":
                timings += st
    requests = args.rounds * (total + CLIENTS)  # each round warms up CLIENTS connections
    for name in urls:
        out[f"{name}_{CLIENTS}_clients_req_per_s"] = float(np.median(rates[name]))
        out[f"{name}_{CLIENTS}_clients_p99_ms"] = ms(lats[name], 99)
        per_request = 1000 * cpu[name] / requests
        out[f"{name}_{CLIENTS}_clients_server_cpu_ms"] = float(per_request[:3].sum())
        if name == "bagserve":
            for part, value in zip(("loop", "threads", "workers"), per_request[:3], strict=True):
                out[f"bagserve_{CLIENTS}_clients_server_cpu_{part}_ms"] = float(value)
        out[f"{name}_{CLIENTS}_clients_client_cpu_ms"] = float(per_request[3])
        busy, whole = cpu[name][4:]
        out[f"{name}_{CLIENTS}_clients_cores_busy"] = float(busy / whole) if whole else 0.0
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
    out["load_average_after"] = load_average()
    return out


def summary(
    results: list[dict[str, Any]], flushes: list[tuple[float, float]]
) -> tuple[dict[str, Any], str]:
    """The rows of issue 47's table from one run, each against its goal, as figures
    and as the text table printed last; ``flushes``: :func:`flush_latency` before and
    after the run."""
    rows: dict[str, Any] = {"case": "issue 47's table (bagserve / MLServer)"}
    lines = [f"{'row':44s} {'ratio':>7s}  goal"]
    for label, key, index, op, goal in GOALS:
        value = float(results[index][key])
        if goal is None:
            verdict = "keep"
        else:
            met = value <= goal if op == "<=" else value >= goal
            verdict = f"{op} {goal:g}: {'met' if met else 'NOT met'}"
        lines.append(f"{label:44s} {value:7.2f}  {verdict}")
        rows[label] = value
    loads = [r[k] for r in results for k in ("load_average_before", "load_average_after")]
    rows["load_average_min"], rows["load_average_max"] = min(loads), max(loads)
    rows["machine"] = f"{platform.platform()}, {os.cpu_count()} cores"
    lines.append(
        f"machine: {rows['machine']}; load average (1 min) "
        f"{rows['load_average_min']:.2f}-{rows['load_average_max']:.2f} during the run"
    )
    small = results[0]
    key = f"{CLIENTS}_clients"
    lines.append(
        f"{CLIENTS} clients, small bag, CPU ms per request: bagserve "
        f"{small[f'bagserve_{key}_server_cpu_ms']:.2f} (event loop "
        f"{small[f'bagserve_{key}_server_cpu_loop_ms']:.2f}, other threads "
        f"{small[f'bagserve_{key}_server_cpu_threads_ms']:.2f}, workers "
        f"{small[f'bagserve_{key}_server_cpu_workers_ms']:.2f}), MLServer "
        f"{small[f'mlserver_{key}_server_cpu_ms']:.2f}; the benchmark's client "
        f"{small[f'bagserve_{key}_client_cpu_ms']:.2f} / "
        f"{small[f'mlserver_{key}_client_cpu_ms']:.2f}; "
        f"cores busy {small[f'bagserve_{key}_cores_busy']:.0%} / "
        f"{small[f'mlserver_{key}_cores_busy']:.0%}"
    )
    for when, (p50, p90) in zip(("before", "after"), flushes, strict=True):
        rows[f"data_dir_fdatasync_{when}_p50_ms"] = p50
        rows[f"data_dir_fdatasync_{when}_p90_ms"] = p90
    lines.append(
        "bagserve's data directory, fdatasync (ms, median / p90): "
        + ", ".join(
            f"{when} the run {p50:.2f} / {p90:.2f}"
            for when, (p50, p90) in zip(("before", "after"), flushes, strict=True)
        )
    )
    return rows, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, help="demo models (default: trained anew)")
    parser.add_argument("--repeat", type=int, default=300, help="small-bag requests per server")
    parser.add_argument("--large-repeat", type=int, default=15)
    parser.add_argument("--total", type=int, default=600, help="small requests per load round")
    parser.add_argument("--large-total", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6, help="load rounds per server")
    parser.add_argument("--quick", action="store_true", help="a smoke run (not saved)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="bagserve's data directory (its database), e.g. on a tmpfs to take the disk "
        "out of the audit commit; default: a temporary directory (not saved when given)",
    )
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
        data_dir = (args.data_dir or tmp) / "bagserve-data"
        flushes = [flush_latency(data_dir)]
        with ExitStack() as stack:
            servers = {
                "bagserve": start_bagserve(stack, models, data_dir),
                "mlserver": start_mlserver(stack, bin_dir, models, tmp),
            }
            urls = {name: url for name, (url, _) in servers.items()}
            pids = {name: pid for name, (_, pid) in servers.items()}
            results = []
            for n, seed in ((100, 1), (100_000, 2)):
                bags, _, _ = make_dose_response_bags(1, n, random_state=[7, seed])
                points = np.ascontiguousarray(bags[0], dtype=np.float64)
                results.append(compare(urls, pids, points, runtime, args))
        flushes.append(flush_latency(data_dir))
        rows, table = summary(results, flushes)
        save = not args.quick and args.data_dir is None
        report([*results, rows], "bench_mlserver", save=save, width=44)
        print(f"\n{table}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if args.data_dir is not None:
            shutil.rmtree(args.data_dir / "bagserve-data", ignore_errors=True)


if __name__ == "__main__":
    main()
