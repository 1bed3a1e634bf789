"""How soon a service instance serves: start to ready, and a model load to serving.

Run with ``make bench`` (or ``.venv/bin/python bench/bench_start.py [--quick]
[--against COMMIT]``). Two cases, timed from outside, as an orchestrator sees the
service:

* **start to ready**: ``bagserve serve`` started (process start) until ``/readyz``
  answers 200, for the two demo models and for ten models (the demo models and eight
  copies under other names, in a temporary models directory); also when the server
  first answered at all (``listening``);
* **load to serving**: in a running service (two workers), a new version copied into
  the models directory, then ``POST /v2/repository/models/demo-dose/load`` until the
  first successful prediction on that version (asked for again until it answers 200,
  whether the load answered 200 or 202); also how long the load request itself took
  to answer.

Every case runs ``--rounds`` times (5), the cases taking turns (round robin, in the
reverse order every other round) so that a burst of load on this shared machine hits
all of them alike; medians (with the minimum and maximum) are reported
beside the baseline measured in the same rounds: ``python -c "import
bagserve.service.app"``, the time to import the app and nothing else. With
``--against COMMIT`` the same cases also run for that commit's code (extracted with
``git archive`` and put first on ``PYTHONPATH``), in the same rounds: the "before"
column. Writes ``bench/results/bench_start.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import httpx
from _report import report
from bench_service import free_port

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def make_models(root: Path) -> dict[int, Path]:
    """Models directories by number of models: the two demo models, and ten (the demo
    models and four copies of each under other names)."""
    from bagserve.core.demo import build_demo_models

    two = root / "models-2"
    build_demo_models(two)
    ten = root / "models-10"
    shutil.copytree(two, ten)
    for i in range(4):
        for name in ("demo-dose", "demo-gating"):
            shutil.copytree(two / name, ten / f"{name}-copy{i}")
    return {2: two, 10: ten}


def extract(commit: str, root: Path) -> Path:
    """The package of ``commit`` laid out as installed (``bagserve``, ``bagserve.core``,
    ``bagserve.service``) under a directory to put first on ``PYTHONPATH``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "bagserve", "core", "service"],
        check=True,
        capture_output=True,
    ).stdout
    src = root / f"src-{commit}"
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    pkg = root / f"pkg-{commit}"
    shutil.copytree(src / "bagserve", pkg / "bagserve")
    shutil.copytree(src / "core", pkg / "bagserve" / "core")
    shutil.copytree(src / "service", pkg / "bagserve" / "service")
    return pkg


class Server:
    """``bagserve serve`` on 127.0.0.1 in a subprocess (``pythonpath``: another
    commit's package first)."""

    def __init__(
        self, models: Path, data: Path, pythonpath: Path | None = None, workers: int = 2
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BAGSERVE_")}
        env.update(
            BAGSERVE_MODELS_DIR=str(models),
            BAGSERVE_HOST="127.0.0.1",
            BAGSERVE_PORT=str(self.port),
            BAGSERVE_DATA_DIR=str(data / f"data-{self.port}"),
            BAGSERVE_WORKERS=str(workers),
            BAGSERVE_LOG_LEVEL="warning",
        )
        if pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath)
        self.t0 = time.perf_counter()
        # Another directory than the source tree: `python -m` puts the working directory
        # first on the path, where the repository's bagserve/ (without core/) is.
        self.proc = subprocess.Popen(
            [PY, "-m", "bagserve", "serve"],
            env=env,
            cwd=data,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 300.0) -> tuple[float, float]:
        """Seconds from the start until the first answer, and until ``/readyz`` is 200."""
        first = None
        deadline = self.t0 + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the service exited with {self.proc.returncode}")
                try:
                    r = client.get(f"{self.url}/readyz")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                now = time.perf_counter() - self.t0
                first = now if first is None else first
                if r.status_code == 200:
                    return first, now
                time.sleep(0.02)
        raise TimeoutError("the service did not get ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def time_import(pythonpath: Path | None, cwd: Path) -> float:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    t0 = time.perf_counter()
    subprocess.run([PY, "-c", "import bagserve.service.app"], check=True, env=env, cwd=cwd)
    return time.perf_counter() - t0


def load_to_serving(server: Server, models: Path, version: str) -> tuple[float, float, int]:
    """A new version of demo-dose on disk, loaded: seconds until the load request
    answered, until the first successful prediction on the version, and the load's
    status code."""
    from bagserve.core.demo import demo_samples

    bags, _, markers = demo_samples("dose", 1, 3)
    body = {"bags": [{"id": "b", "markers": markers, "points": bags[0].tolist()}]}
    shutil.copytree(models / "demo-dose" / "1", models / "demo-dose" / version)
    predict = f"{server.url}/v1/models/demo-dose/versions/{version}/predict"
    with httpx.Client(timeout=300.0) as client:
        t0 = time.perf_counter()
        r = client.post(f"{server.url}/v2/repository/models/demo-dose/load")
        answered = time.perf_counter() - t0
        if r.status_code not in (200, 202):
            raise RuntimeError(f"load answered {r.status_code}: {r.text}")
        while True:
            if client.post(predict, json=body).status_code == 200:
                return answered, time.perf_counter() - t0, r.status_code
            if time.perf_counter() - t0 > 300:
                raise TimeoutError("the new version was not served")
            time.sleep(0.01)


def _turn(items: list[Any], round_: int) -> list[Any]:
    """``items`` in round ``round_``'s order: as given, reversed every other round."""
    return items if round_ % 2 == 0 else items[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 round (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each case (5)")
    parser.add_argument("--against", metavar="COMMIT", help="also time this commit's code")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = make_models(root)
        variants: dict[str, Path | None] = {"now": None}
        if args.against:
            variants["before"] = extract(args.against, root)
        times: dict[tuple[str, str], list[float]] = {}

        def add(variant: str, case: str, seconds: float) -> None:
            times.setdefault((variant, case), []).append(seconds)

        for path in variants.values():  # untimed: the OS caches the files
            time_import(path, root)
        for r in range(rounds):
            # Every other round in the reverse order: what follows what evens out.
            for variant, path in _turn(list(variants.items()), r):
                add(variant, "import", time_import(path, root))
                for n, directory in _turn(list(models.items()), r):
                    server = Server(directory, root, path)
                    try:
                        first, ready = server.wait_ready()
                    finally:
                        server.stop()
                    add(variant, f"listening {n}", first)
                    add(variant, f"ready {n}", ready)
                # Load to serving: a fresh service on its own copy of the two models.
                own = root / f"load-{variant}-{r}"
                shutil.copytree(models[2], own)
                server = Server(own, root, path)
                try:
                    server.wait_ready()
                    answered, serving, status = load_to_serving(server, own, "2")
                finally:
                    server.stop()
                add(variant, "load answered", answered)
                add(variant, "load to serving", serving)
                add(variant, f"load status {status}", 1.0)

    def median(variant: str, case: str) -> float | None:
        found = times.get((variant, case))
        return statistics.median(found) if found else None

    def spread(variant: str, case: str) -> list[float]:
        found = times.get((variant, case)) or [float("nan")]
        return [round(min(found), 3), round(max(found), 3)]

    results: list[dict[str, Any]] = []
    labels = {
        "ready 2": "start to ready, 2 demo models",
        "ready 10": "start to ready, 10 models",
        "listening 2": "start to first answer, 2 demo models",
        "listening 10": "start to first answer, 10 models",
        "load answered": "load request answered (one new version)",
        "load to serving": "load to serving (one new version)",
    }
    base = median("now", "import")
    assert base is not None
    results.append({"case": 'python -c "import bagserve.service.app"', "median_s": base})
    for key, label in labels.items():
        row: dict[str, Any] = {"case": label, "median_s": median("now", key)}
        row["min_max_s"] = spread("now", key)
        row["ratio_to_import"] = row["median_s"] / base
        before = median("before", key)
        if before is not None:
            row.update(
                before_median_s=before,
                before_min_max_s=spread("before", key),
                before_import_s=median("before", "import"),
                speedup=before / row["median_s"],
            )
        row["rounds"] = rounds
        results.append(row)
    statuses = {
        case: len(v)
        for (variant, case), v in times.items()
        if variant == "now" and case.startswith("load status")
    }
    results.append({"case": "load answers (now)", **statuses})
    report(results, "bench_start", save=not args.quick)
    print(
        f"\n{'case':42s}  median s (min-max)     x import"
        + ("  before s (min-max)     speed-up" if args.against else "")
    )
    for row in results[1:-1]:
        low, high = row["min_max_s"]
        line = f"{row['case']:42s}  {row['median_s']:6.3f} ({low:.2f}-{high:.2f})"
        line += f"  {row['ratio_to_import']:8.2f}"
        if "before_median_s" in row:
            low, high = row["before_min_max_s"]
            line += f"  {row['before_median_s']:6.3f} ({low:.2f}-{high:.2f})  {row['speedup']:8.1f}"
        print(line)
    print(f"{'baseline: import bagserve.service.app':42s}  {base:8.3f}")


if __name__ == "__main__":
    main()
