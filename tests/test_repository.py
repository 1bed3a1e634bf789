"""Model repository operations, Triton's configuration and statistics, and the
protocol details a lab's tools trip over, against the real service."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from bagserve.core.demo import build_demo_models, demo_samples
from bagserve.core.hashing import json_sha256

from bagserve import __version__

from .service_harness import logged, running_service


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("repo") / "models"
    build_demo_models(directory)
    return directory


def dose_body(seed: int = 3) -> dict:
    bags, _, markers = demo_samples("dose", 1, seed)
    return {"bags": [{"id": "b", "markers": markers, "points": np.asarray(bags[0]).tolist()}]}


def states(url: str) -> dict[str, tuple[str, str]]:
    rows = httpx.post(f"{url}/v2/repository/index", timeout=30).json()
    return {f"{r['name']}/{r['version']}": (r["state"], r["reason"]) for r in rows}


#: Wait for the load to finish, however loaded the machine (the default wait is 0.5 s).
WAIT = {"Prefer": "wait=60"}


def rewrite_manifest(version: Path, change: Callable[[dict], None]) -> str:
    """Change an artifact's manifest in place, with a valid digest, as retraining under
    the same version would; returns its new sha256."""
    path = version / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["manifest_sha256"] = json_sha256(manifest, exclude=("manifest_sha256",))
    path.write_text(json.dumps(manifest))
    return manifest["manifest_sha256"]


def name_an_unlisted_array(manifest: dict) -> None:
    """Make the model refer to an array its manifest does not list: the files still
    verify, but no worker can open the model."""

    def first_array(node: object) -> dict | None:
        if isinstance(node, dict):
            if "__array__" in node:
                return node
            return next(filter(None, map(first_array, node.values())), None)
        if isinstance(node, list):
            return next(filter(None, map(first_array, node)), None)
        return None

    found = first_array(manifest["model"])
    assert found is not None
    found["__array__"] = "model.not_listed"


def poll_load(url: str, name: str, timeout: float = 60.0) -> dict:
    """The load's status once it is not LOADING any more (polled with a deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/v2/repository/models/{name}/load/status", timeout=10)
        assert r.status_code == 200, r.text
        if r.json()["state"] != "LOADING":
            return r.json()
        assert time.monotonic() < deadline, f"load of {name} not done: {r.json()}"
        time.sleep(0.05)


class Hammer:
    """Predictions on the latest demo-dose in a loop, in a thread: the status, version
    and sha256 of every answer, in order."""

    def __init__(self, url: str) -> None:
        self.url, self.body = url, dose_body()
        self.seen: list[tuple[int, str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.stop.is_set():
            r = httpx.post(f"{self.url}/v1/models/demo-dose/predict", json=self.body, timeout=60)
            version = r.headers.get("x-model-version", "")
            self.seen.append((r.status_code, version, r.headers.get("x-model-sha256", "")))

    def __enter__(self) -> Hammer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def until(self, answer: tuple[str, str], timeout: float = 60.0) -> None:
        """Until an answer from that version and sha256 came back."""
        deadline = time.monotonic() + timeout
        while not any((v, s) == answer for _, v, s in list(self.seen)):
            assert time.monotonic() < deadline, f"no answer from {answer}: {self.seen[-3:]}"
            time.sleep(0.05)


def test_models_load_reload_and_unload_while_serving(models, tmp_path):
    """New and changed models are served after a load, and an unloaded one is not,
    without a restart and without a failed request meanwhile; SIGHUP reloads all."""
    repo = tmp_path / "models"
    shutil.copytree(models, repo)
    with running_service(repo) as url:
        assert states(url) == {"demo-dose/1": ("READY", ""), "demo-gating/1": ("READY", "")}
        # New artifacts on disk are listed, not served, until loaded.
        shutil.copytree(repo / "demo-dose" / "1", repo / "demo-dose" / "2")
        shutil.copytree(repo / "demo-dose" / "1", repo / "extra" / "1")
        assert states(url)["extra/1"] == ("UNAVAILABLE", "not loaded yet (load it)")
        assert httpx.get(f"{url}/v1/models/extra").status_code == 404

        # Requests keep flowing while the workers load the new versions.
        body = dose_body()
        with Hammer(url) as hammer:
            r = httpx.post(f"{url}/v2/repository/models/extra/load", headers=WAIT, timeout=120)
            assert r.status_code == 200 and r.json()["served"] == ["extra/1"], r.text
            r = httpx.post(f"{url}/v2/repository/models/demo-dose/load", headers=WAIT, timeout=120)
            assert r.json()["served"] == ["demo-dose/1", "demo-dose/2"]
        statuses = [status for status, _, _ in hammer.seen]
        assert statuses and set(statuses) == {200}, statuses
        extra = httpx.post(f"{url}/v1/models/extra/predict", json=body, timeout=60)
        assert extra.status_code == 200
        assert httpx.get(f"{url}/v1/models/demo-dose").json()["latest"] == "2"
        assert httpx.get(f"{url}/readyz").json()["workers"]["alive"] == 2

        # Unload: answered 404 at once, listed as unloaded, served again after a load.
        assert httpx.post(f"{url}/v2/repository/models/demo-gating/unload").status_code == 200
        gone = httpx.get(f"{url}/v1/models/demo-gating")
        assert gone.status_code == 404 and "unknown model" in gone.json()["detail"]
        assert states(url)["demo-gating/1"] == ("UNAVAILABLE", "unloaded")
        assert httpx.post(
            f"{url}/v2/repository/models/demo-gating/load", headers=WAIT, timeout=120
        ).is_success
        assert httpx.get(f"{url}/v1/models/demo-gating").status_code == 200
        # Loading what is not there is refused with the reason, in the protocol's form.
        missing = httpx.post(f"{url}/v2/repository/models/nope/load")
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/json"
        assert "no servable version of model 'nope'" in missing.json()["error"]

        # SIGHUP: everything on disk, at once.
        shutil.copytree(repo / "demo-dose" / "1", repo / "late" / "1")
        os.kill(url.pid, signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "late/1" not in httpx.get(f"{url}/readyz").json()["models"]:
            assert time.monotonic() < deadline, "SIGHUP did not load the new model"
            time.sleep(0.3)
        assert httpx.post(f"{url}/v1/models/late/predict", json=body, timeout=60).is_success


def test_a_load_answers_within_a_second_and_the_old_version_serves_until_the_switch(
    models, tmp_path
):
    """A client with a 1 s timeout gets its answer (done, or 202 to poll); the new
    version serves once the status says READY, and until then the version served
    before answers every request: never an error, never a half-loaded version, and
    never the old version again after the new one answered."""
    repo = tmp_path / "models"
    shutil.copytree(models, repo)
    with running_service(repo) as url:
        first = httpx.post(f"{url}/v1/models/demo-dose/predict", json=dose_body(), timeout=60)
        old = ("1", first.headers["x-model-sha256"])
        shutil.copytree(repo / "demo-dose" / "1", repo / "demo-dose" / "2")
        version_2 = f"{url}/v2/models/demo-dose/versions/2"
        assert httpx.get(f"{version_2}/ready").status_code == 404  # on disk, not served
        with Hammer(url) as hammer:
            hammer.until(old)
            # A new version, asked for by a client that gives up after one second.
            r = httpx.post(f"{url}/v2/repository/models/demo-dose/load", timeout=1.0)
            assert r.status_code in (200, 202), r.text
            if r.status_code == 202:
                assert r.headers["location"] == "/v2/repository/models/demo-dose/load/status"
                assert r.json()["state"] == "LOADING" and r.headers["retry-after"] == "1"
            status = poll_load(url, "demo-dose")
            assert status["state"] == "READY" and status["reason"] == "", status
            assert status["served"] == ["demo-dose/1", "demo-dose/2"]
            assert status["versions"] == ["demo-dose/2"]
            assert httpx.get(f"{version_2}/ready").json() == {"name": "demo-dose", "ready": True}
            new = ("2", old[1])  # a copy: the same files under another version
            hammer.until(new)
            # Retrained in place (same version, new files): 202 at once when asked so.
            sha = rewrite_manifest(
                repo / "demo-dose" / "2",
                lambda m: m["metadata"].update(description="retrained in place"),
            )
            assert states(url)["demo-dose/2"] == (
                "READY",
                "the artifact on disk changed: load it again",
            )
            r = httpx.post(
                f"{url}/v2/repository/models/demo-dose/load",
                headers={"Prefer": "respond-async"},
                timeout=1.0,
            )
            assert r.status_code == 202 and r.headers["preference-applied"] == "respond-async"
            assert r.json()["state"] == "LOADING"
            assert poll_load(url, "demo-dose")["state"] == "READY"
            retrained = ("2", sha)
            hammer.until(retrained)
        order = [old, new, retrained]
        assert all(status == 200 for status, _, _ in hammer.seen), hammer.seen
        answered = [order.index((v, s)) for _, v, s in hammer.seen]
        assert answered == sorted(answered), "an older version answered after a newer one"
        assert states(url)["demo-dose/2"] == ("READY", "")
        assert httpx.get(f"{url}/readyz").json()["workers"]["loading"] == []


def test_a_load_the_workers_cannot_finish_is_reported_and_nothing_served_is_lost(models, tmp_path):
    repo = tmp_path / "models"
    shutil.copytree(models, repo)
    with running_service(repo) as url:
        before = httpx.post(f"{url}/v1/models/demo-dose/predict", json=dose_body(), timeout=60)
        # A new version whose files verify but that no worker can open.
        shutil.copytree(repo / "demo-dose" / "1", repo / "demo-dose" / "2")
        rewrite_manifest(repo / "demo-dose" / "2", name_an_unlisted_array)
        r = httpx.post(f"{url}/v2/repository/models/demo-dose/load", headers=WAIT, timeout=90)
        assert r.status_code == 500, r.text
        assert "could not load demo-dose/2" in r.json()["error"]
        assert "not_listed" in r.json()["errors"][0]
        status = poll_load(url, "demo-dose")
        assert status["state"] == "UNAVAILABLE" and status["served"] == ["demo-dose/1"]
        state, reason = states(url)["demo-dose/2"]
        assert state == "UNAVAILABLE" and "not_listed" in reason
        assert httpx.get(f"{url}/v2/models/demo-dose/versions/2/ready").status_code == 404
        # The version served before, changed in place the same way: still served, from
        # the files it was loaded from.
        shutil.rmtree(repo / "demo-dose" / "2")
        rewrite_manifest(repo / "demo-dose" / "1", name_an_unlisted_array)
        r = httpx.post(f"{url}/v2/repository/models/demo-dose/load", headers=WAIT, timeout=90)
        assert r.status_code == 500, r.text
        after = httpx.post(f"{url}/v1/models/demo-dose/predict", json=dose_body(), timeout=60)
        assert after.status_code == 200
        assert after.headers["x-model-sha256"] == before.headers["x-model-sha256"]
        assert after.json()["predictions"] == before.json()["predictions"]
        assert httpx.get(f"{url}/readyz").status_code == 200


def test_triton_model_config_and_statistics(models):
    with running_service(models) as url:
        config = httpx.get(f"{url}/v2/models/demo-dose/config").json()
        assert config["name"] == "demo-dose" and config["max_batch_size"] == 0
        assert config["input"][0] == {"name": "points", "data_type": "TYPE_FP64", "dims": [-1, 3]}
        assert [o["name"] for o in config["output"]][:1] == ["prediction"]
        assert (
            config["parameters"]["sha256"]["string_value"]
            == httpx.get(f"{url}/v2/models/demo-dose").json()["parameters"]["sha256"]
        )
        for _ in range(2):
            httpx.post(f"{url}/v1/models/demo-dose/predict", json=dose_body(), timeout=60)
        bad = dose_body()
        bad["bags"][0]["points"] = [[1.0, 2.0]]
        httpx.post(f"{url}/v1/models/demo-dose/predict", json=bad, timeout=60)
        (stats,) = httpx.get(f"{url}/v2/models/demo-dose/stats").json()["model_stats"]
        inference = stats["inference_stats"]
        assert stats["version"] == "1" and stats["execution_count"] == 2
        assert inference["success"]["count"] == 2 and inference["fail"]["count"] == 1
        assert inference["compute_infer"]["ns"] > 0 and stats["last_inference"] > 0
        every = httpx.get(f"{url}/v2/models/stats").json()["model_stats"]
        assert [s["name"] for s in every] == ["demo-dose", "demo-gating"]
        one = httpx.get(f"{url}/v2/models/demo-dose/versions/1/stats").json()
        assert one["model_stats"][0]["execution_count"] == 2
        assert httpx.get(f"{url}/v2/models/nope/stats").status_code == 404


def test_protocol_details_lab_tools_rely_on(models, tmp_path):
    from bagserve.service.client import Client

    with running_service(models) as url:
        # /v2 errors: application/json, the whole message in "error" (KServe, Triton).
        r = httpx.post(
            f"{url}/v2/models/demo-dose/infer",
            json={
                "inputs": [
                    {"name": "points", "datatype": "FP64", "shape": [1, 2], "data": [1.0, 2.0]}
                ]
            },
        )
        assert r.status_code == 422 and r.headers["content-type"] == "application/json"
        assert "the model takes 3" in r.json()["error"]
        # /v1 errors stay RFC 9457 problem details.
        r = httpx.get(f"{url}/v1/models/nope")
        assert r.headers["content-type"] == "application/problem+json"
        # The client takes any array layout (a column slice is not C-contiguous).
        bags, _, markers = demo_samples("dose", 1, 3)
        wide = np.hstack([np.asarray(bags[0]), np.zeros((bags[0].shape[0], 1))])
        with Client(url) as client:
            sliced = client.predict("demo-dose", [wide[:, :3]], markers=markers)
            packed = client.predict("demo-dose", [np.asarray(bags[0])], markers=markers)
        assert sliced["predictions"][0]["prediction"] == packed["predictions"][0]["prediction"]
        # `bagserve predict --url` names an unknown model.
        sample = tmp_path / "s.csv"
        sample.write_text(",".join(markers) + "\n" + "1,2,3\n4,5,6\n")
        exe = Path(sys.executable).parent / "bagserve"
        done = subprocess.run(
            [str(exe), "predict", "--url", url, "no-such-model", str(sample)],
            capture_output=True,
            text=True,
        )
        assert done.returncode != 0 and "unknown model 'no-such-model'" in done.stderr
        for _ in range(3):
            httpx.get(f"{url}/healthz")
            httpx.get(f"{url}/readyz")
        httpx.get(f"{url}/v1/models", headers={"x-request-id": "logged-request"})
        log_path = models.parent / f"serve-{url.rsplit(':', 1)[1]}.log"
        logged(lambda: [log_path], lambda r: r.get("request_id") == "logged-request")
        log = log_path.read_text()
    # JSON-only logs, uvicorn's own lines included; probes not logged by default.
    lines = [x for x in log.splitlines() if x.strip()]
    records = [json.loads(x) for x in lines]  # fails on any plain-text line
    assert any(r["logger"].startswith("uvicorn") for r in records)
    paths = [r.get("path") for r in records if r.get("message") == "request"]
    assert "/v1/models" in paths and "/healthz" not in paths and "/readyz" not in paths
    # --version
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    assert done.stdout.strip() == f"bagserve {__version__}"
