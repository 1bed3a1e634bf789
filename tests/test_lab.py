"""Lab integration, live: Open Inference Protocol, jobs, idempotency, audit trail, metrics."""

from __future__ import annotations

import asyncio
import csv
import json
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from bagserve.core.demo import demo_samples
from bagserve.service.audit import verify

from .conftest import SHARED_DATA
from .service_harness import (
    PREDICTION_STAGES,
    audit_count,
    audit_log,
    build_models,
    logged,
    running_service,
    server_timing,
    stage_counts,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("lab") / "models")


@pytest.fixture(scope="module")
def data_dir(models):
    return models.parent / "data"


@pytest.fixture(scope="module")
def url(models, data_dir):
    with running_service(models, BAGSERVE_DATA_DIR=str(data_dir)) as u:
        yield u


def dose_bags(n: int = 2, seed: int = 3):
    bags, _, markers = demo_samples("dose", n, seed)
    return [np.asarray(b) for b in bags], markers


def v1(url: str, bags: list[np.ndarray], markers: list[str]) -> list[float]:
    body = {"bags": [{"markers": markers, "points": b.tolist()} for b in bags]}
    return [
        p["prediction"]
        for p in httpx.post(f"{url}/v1/models/demo-dose/predict", json=body, timeout=60).json()[
            "predictions"
        ]
    ]


# ----------------------------------------------------------------- Open Inference Protocol
# A client written from the protocol's documentation only (kserve.github.io, "Open
# Inference Protocol (V2 Inference Protocol)"): JSON tensors, and the binary tensor data
# extension with the Inference-Header-Content-Length header.
def oip_infer(url, model, inputs, outputs=None, parameters=None, binary=False):
    request = {"id": "req-1", "inputs": [], "parameters": parameters or {}}
    blobs = []
    for name, array, params in inputs:
        array = np.asarray(array)
        datatype = {"f": "FP64", "i": "INT64"}[array.dtype.kind]
        spec = {
            "name": name,
            "shape": list(array.shape),
            "datatype": datatype,
            "parameters": dict(params),
        }
        if binary:
            raw = array.astype("<f8" if datatype == "FP64" else "<i8").tobytes()
            spec["parameters"]["binary_data_size"] = len(raw)
            blobs.append(raw)
        else:
            spec["data"] = array.reshape(-1).tolist()
        request["inputs"].append(spec)
    if outputs:
        request["outputs"] = [{"name": o, "parameters": {"binary_data": binary}} for o in outputs]
    head = json.dumps(request).encode()
    headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(head))
    r = httpx.post(
        f"{url}/v2/models/{model}/infer",
        content=head + b"".join(blobs),
        headers=headers,
        timeout=60,
    )
    return r


def oip_outputs(r: httpx.Response) -> dict:
    n = r.headers.get("inference-header-content-length")
    if n is None:
        doc = r.json()
        rest = b""
    else:
        doc = json.loads(r.content[: int(n)])
        rest = r.content[int(n) :]
    out = {}
    for o in doc["outputs"]:
        size = (o.get("parameters") or {}).get("binary_data_size")
        if size is None:
            out[o["name"]] = np.asarray(o["data"]).reshape(o["shape"])
            continue
        raw, rest = rest[:size], rest[size:]
        if o["datatype"] == "BYTES":
            values, i = [], 0
            while i < len(raw):
                (length,) = struct.unpack("<I", raw[i : i + 4])
                values.append(raw[i + 4 : i + 4 + length].decode())
                i += 4 + length
            out[o["name"]] = np.asarray(values).reshape(o["shape"])
        else:
            dtype = {"FP64": "<f8", "INT64": "<i8", "BOOL": "?"}[o["datatype"]]
            out[o["name"]] = np.frombuffer(raw, dtype=dtype).reshape(o["shape"])
    return {"doc": doc, "outputs": out}


def test_oip_metadata_and_health(url):
    server = httpx.get(f"{url}/v2").json()
    assert server["name"] == "bagserve" and "binary_tensor_data" in server["extensions"]
    assert httpx.get(f"{url}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200
    meta = httpx.get(f"{url}/v2/models/demo-dose").json()
    assert meta["name"] == "demo-dose" and meta["versions"] == ["1"]
    assert {i["name"] for i in meta["inputs"]} == {"points", "bag_sizes"}
    assert meta["inputs"][0]["shape"] == [-1, 3]
    assert httpx.get(f"{url}/v2/models/demo-dose/versions/1").status_code == 200
    assert httpx.get(f"{url}/v2/models/demo-dose/ready").json()["ready"] is True
    r = httpx.get(f"{url}/v2/models/unknown")
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("binary", [False, True])
def test_oip_infer_json_and_binary_equal_the_native_api(url, binary):
    bags, markers = dose_bags(3)
    points = np.concatenate(bags)
    sizes = np.array([b.shape[0] for b in bags], dtype=np.int64)
    before = stage_counts(url)
    r = oip_infer(
        url,
        "demo-dose",
        [("points", points, {"markers": markers}), ("bag_sizes", sizes, {})],
        outputs=["prediction"],
        binary=binary,
    )
    assert r.status_code == 200, r.text
    # Every stage of /v2 in the metrics too, the audit record's commit included.
    after = stage_counts(url)
    assert all(after[s] == before[s] + 1 for s in PREDICTION_STAGES if s != "app"), after
    parsed = oip_outputs(r)
    assert parsed["doc"]["model_name"] == "demo-dose" and parsed["doc"]["id"] == "req-1"
    assert parsed["doc"]["parameters"]["bag_sizes"] == sizes.tolist()
    np.testing.assert_array_equal(parsed["outputs"]["prediction"], v1(url, bags, markers))
    assert ("inference-header-content-length" in r.headers) is binary
    # Where the time went, stage by stage as on /v1, the audit record's commit included.
    assert list(server_timing(r)) == PREDICTION_STAGES


def test_oip_per_cell_model_and_errors(url):
    tasks, y, markers = demo_samples("gating", 1, 8)
    r = oip_infer(
        url,
        "demo-gating",
        [("points", np.asarray(tasks[0]), {})],
        parameters={"markers": markers},
        binary=True,
    )
    out = oip_outputs(r)["outputs"]
    assert out["labels"].shape == (tasks.n_points,) and np.mean(out["labels"] == y) > 0.8
    assert out["out_of_range"].tolist() == [False]
    bad = oip_infer(url, "demo-dose", [("points", np.zeros((4, 2)), {})])
    assert bad.status_code == 422 and "error" in bad.json()
    sizes = oip_infer(
        url, "demo-dose", [("points", np.zeros((4, 3)), {}), ("bag_sizes", np.array([1, 2]), {})]
    )
    assert sizes.status_code == 400 and "bag_sizes" in sizes.json()["error"]
    wrong = httpx.post(f"{url}/v2/models/demo-dose/infer", json={"inputs": []})
    assert wrong.status_code == 400 and wrong.json()["error"]


#: A value of every JSON type, for the fields that must not take it.
JSON_VALUES = {
    "object": {},
    "list": [],
    "number": 1,
    "true": True,
    "false": False,
    "null": None,
    "string": "FP64",
    "empty string": "",
}
#: Each field of an inference request (a path into it, list indices as numbers), the
#: JSON types it takes (any other is a type confusion), and values of the right type
#: whose items are wrong.
FIELDS: list[tuple[tuple, set[str], list]] = [
    (("id",), {"string", "empty string", "null"}, []),
    (("parameters",), {"object", "null"}, []),
    (("parameters", "interval"), {"number", "string", "empty string", "null"}, []),
    (("parameters", "binary_data_output"), {"true", "false", "null"}, []),
    (("inputs",), {"list"}, [[1], [[]]]),
    (("inputs", 0), {"object"}, []),
    (("inputs", 0, "name"), {"string"}, []),
    (("inputs", 0, "datatype"), {"string"}, ["fp64", "BYTES"]),
    (("inputs", 0, "shape"), {"list"}, [[10.5, 3], ["10", 3], [True, 3], [None, 3], [[10], 3]]),
    (("inputs", 0, "parameters"), {"object", "null"}, []),
    (
        ("inputs", 0, "parameters", "markers"),
        {"list", "string", "null"},
        [[], [1, 2, 3], [{}, [], None]],
    ),
    (("inputs", 0, "parameters", "binary_data_size"), {"number"}, [-1, 1.5]),
    (
        ("inputs", 0, "data"),
        {"list"},
        [["0.5"] * 30, [True] * 30, [None] * 30, [{}] * 30, [[0.5]] * 29 + [[0.5, 0.5]]],
    ),
    (("outputs",), {"list", "null"}, [[1], [[]]]),
    (("outputs", 0), {"object"}, []),
    (("outputs", 0, "name"), {"string"}, []),
    (("outputs", 0, "parameters"), {"object", "null"}, []),
    (("outputs", 0, "parameters", "binary_data"), {"true", "false", "null"}, []),
]


def _set(doc: dict, path: tuple, value) -> dict:
    doc = json.loads(json.dumps(doc))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def test_oip_type_confusions_are_refused_naming_the_field(url):
    """Every field of a /v2 inference request given a JSON type it does not take (an
    object or a list for a string, a string for a list, a string or a boolean for a
    number, ...) is refused with a 4xx problem that names the field (and the input),
    never a 500 and never an answer."""
    bags, markers = dose_bags(1)
    points = bags[0][:10]
    valid = {
        "id": "req-types",
        "parameters": {"interval": 0.9, "binary_data_output": False},
        "inputs": [
            {
                "name": "points",
                "datatype": "FP64",
                "shape": list(points.shape),
                "data": points.reshape(-1).tolist(),
                "parameters": {"markers": markers},
            }
        ],
        "outputs": [{"name": "prediction", "parameters": {"binary_data": False}}],
    }
    infer = f"{url}/v2/models/demo-dose/infer"
    assert httpx.post(infer, json=valid, timeout=60).status_code == 200
    failures = []
    with httpx.Client(timeout=60) as http:
        for path, takes, wrong_items in FIELDS:
            cases = [v for k, v in JSON_VALUES.items() if k not in takes] + wrong_items
            field = path[-1] if isinstance(path[-1], str) else path[-2]
            for value in cases:
                try:
                    r = http.post(infer, json=_set(valid, path, value))
                except httpx.TransportError as exc:  # the server dropped the connection
                    failures.append((path, value, type(exc).__name__))
                    continue
                error = (
                    r.json().get("error", "") if r.headers["content-type"].endswith("json") else ""
                )
                within = path[0] in ("inputs", "outputs") and len(path) > 1
                named = field in error and (not within or f"{path[0]}[0]" in error)
                if not (400 <= r.status_code < 500 and named):
                    failures.append((path, value, r.status_code, error[:200]))
    assert not failures, failures


# ----------------------------------------------------------------- jobs
def poll(url: str, location: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}{location}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise TimeoutError(location)


def test_job_lifecycle_and_cancel(url):
    bags, markers = dose_bags(2)
    body = {
        "bags": [
            {"id": f"j{i}", "markers": markers, "points": b.tolist()} for i, b in enumerate(bags)
        ]
    }
    r = httpx.post(f"{url}/v1/jobs", params={"model": "demo-dose"}, json=body)
    assert r.status_code == 202 and r.headers["location"].startswith("/v1/jobs/")
    job = poll(url, r.headers["location"])
    assert job["status"] == "succeeded"
    assert [p["prediction"] for p in job["result"]["predictions"]] == v1(url, bags, markers)
    # Two slow jobs on two workers, a third waits: cancel it while queued.
    slow = np.random.default_rng(0).normal(size=(30_000, 3)).tolist()
    slow_body = {"bags": [{"points": slow}]}
    locations = [
        httpx.post(f"{url}/v1/jobs", params={"model": "slow"}, json=slow_body).headers["location"]
        for _ in range(3)
    ]
    cancelled = httpx.delete(f"{url}{locations[2]}").json()
    assert cancelled["status"] == "cancelled"
    assert poll(url, locations[2])["status"] == "cancelled"
    for loc in locations[:2]:
        assert poll(url, loc, timeout=300)["status"] == "succeeded"
    assert httpx.get(f"{url}/v1/jobs/{'0' * 32}").status_code == 404
    assert httpx.post(f"{url}/v1/jobs", params={"model": "nope"}, json=body).status_code == 404


def test_accepted_jobs_survive_a_restart(models, tmp_path):
    data = tmp_path / "data"
    body = {"bags": [{"points": np.random.default_rng(1).normal(size=(30_000, 3)).tolist()}]}
    with running_service(models, BAGSERVE_DATA_DIR=str(data), BAGSERVE_WORKERS="1") as u:
        locations = [
            httpx.post(f"{u}/v1/jobs", params={"model": "slow"}, json=body).headers["location"]
            for _ in range(2)
        ]
        deadline = time.monotonic() + 30
        while (
            httpx.get(f"{u}{locations[0]}").json()["status"] != "running"
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        # Leaving the block stops the service while the first job runs.
    with running_service(models, BAGSERVE_DATA_DIR=str(data), BAGSERVE_WORKERS="1") as u:
        for loc in locations:
            job = poll(u, loc, timeout=300)
            assert job["status"] == "succeeded", job


# ----------------------------------------------------------------- idempotency
def test_idempotent_predict_and_jobs(url, data_dir):
    bags, markers = dose_bags(1, seed=11)
    body = {"bags": [{"markers": markers, "points": bags[0].tolist()}]}
    before = audit_count(data_dir)
    key = {"Idempotency-Key": "order-7f3a"}
    results = []

    def call():
        results.append(
            httpx.post(f"{url}/v1/models/demo-dose/predict", json=body, headers=key, timeout=60)
        )

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {r.status_code for r in results} == {200}
    assert len({r.content for r in results}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in results) == 3
    # Computed (and audited) once.
    assert audit_count(data_dir) == before + 1
    other = {"bags": [{"markers": markers, "points": (bags[0] + 1).tolist()}]}
    r = httpx.post(f"{url}/v1/models/demo-dose/predict", json=other, headers=key)
    assert r.status_code == 422 and r.json()["type"].endswith("idempotency-key-reused")
    j1 = httpx.post(
        f"{url}/v1/jobs",
        params={"model": "demo-dose"},
        json=body,
        headers={"Idempotency-Key": "job-1"},
    )
    j2 = httpx.post(
        f"{url}/v1/jobs",
        params={"model": "demo-dose"},
        json=body,
        headers={"Idempotency-Key": "job-1"},
    )
    assert (
        j1.status_code == j2.status_code == 202 and j1.headers["location"] == j2.headers["location"]
    )


def test_idempotency_and_jobs_with_large_npy_bodies(url, data_dir):
    """NPY bodies from 1 MiB on are read into shared buffers that are reused: a replay,
    a reused key and a job must all still see exactly the bytes that were sent."""
    import hashlib
    import io

    rng = np.random.default_rng(5)
    markers = "FSC-A,SSC-A,GFP"

    def npy(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()

    first, second = npy(rng.normal(size=(60_000, 3))), npy(rng.normal(size=(60_000, 3)))
    assert len(first) >= 1 << 20
    headers = {"content-type": "application/x-npy"}
    plain = [
        httpx.post(
            f"{url}/v1/models/demo-dose/predict",
            params={"markers": markers},
            content=body,
            headers=headers,
            timeout=60,
        )
        for body in (first, second)
    ]
    assert [r.status_code for r in plain] == [200, 200]
    keyed = {**headers, "Idempotency-Key": "npy-order-1"}
    answers = [
        httpx.post(
            f"{url}/v1/models/demo-dose/predict",
            params={"markers": markers},
            content=first,
            headers=keyed,
            timeout=60,
        )
        for _ in range(2)
    ]
    assert [r.status_code for r in answers] == [200, 200]
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert answers[0].content == answers[1].content
    assert answers[0].json()["predictions"] == plain[0].json()["predictions"]
    assert answers[0].headers["x-input-sha256"] == hashlib.sha256(first).hexdigest()
    # The key with another body of the same size (the buffer now holds other bytes).
    r = httpx.post(
        f"{url}/v1/models/demo-dose/predict",
        params={"markers": markers},
        content=second,
        headers=keyed,
        timeout=60,
    )
    assert r.status_code == 422 and r.json()["type"].endswith("idempotency-key-reused")
    # A job keeps the body on disk and computes it later.
    r = httpx.post(
        f"{url}/v1/jobs",
        params={"model": "demo-dose", "markers": markers},
        content=second,
        headers=headers,
    )
    assert r.status_code == 202
    job = poll(url, r.headers["location"])
    assert job["status"] == "succeeded", job
    assert job["result"]["predictions"] == plain[1].json()["predictions"]
    assert job["result"]["request_sha256"] == hashlib.sha256(second).hexdigest()
    assert job["result"]["predictions"][0]["input_sha256"] == hashlib.sha256(second).hexdigest()


# ----------------------------------------------------------------- audit, metrics
def test_concurrent_answers_are_each_recorded_once_and_the_chain_verifies(url, data_dir):
    """Group commit: requests that finish together share an audit transaction, and each
    is answered only once its own record is in the chain."""
    bags, _ = dose_bags(1, seed=21)
    n = 16  # 2 computing, the rest within the queue's 16 places
    before = audit_count(data_dir)

    async def crowd() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{url}/v2/models/demo-dose/infer",
                        json={
                            "inputs": [
                                {
                                    "name": "points",
                                    "datatype": "FP64",
                                    "shape": list(bags[0].shape),
                                    "data": bags[0].reshape(-1).tolist(),
                                }
                            ]
                        },
                        headers={"X-Request-ID": f"crowd-{i}"},
                    )
                    for i in range(n)
                )
            )

    answers = asyncio.run(crowd())
    assert [r.status_code for r in answers] == [200] * n
    assert audit_count(data_dir) == before + n
    recorded = [r["request_id"] for r in audit_log(data_dir).recent(n)]
    assert sorted(recorded) == sorted(f"crowd-{i}" for i in range(n))
    exe = str(Path(sys.executable).parent / "bagserve")
    assert subprocess.run([exe, "audit", "verify", "--data-dir", str(data_dir)]).returncode == 0
    text = httpx.get(f"{url}/metrics").text
    assert "bagserve_audit_commit_records_count" in text
    assert "bagserve_audit_commit_seconds_count" in text


def test_audit_trail_records_and_verification(url, data_dir, tmp_path):
    bags, markers = dose_bags(2, seed=5)
    body = {"bags": [{"markers": markers, "points": b.tolist()} for b in bags]}
    answer = httpx.post(f"{url}/v1/models/demo-dose/predict", json=body, timeout=60).json()
    httpx.post(f"{url}/v1/models/demo-dose/predict", json={"bags": [{"points": [[1.0, 2.0]]}]})
    bad, ok = audit_log(data_dir).recent(2)
    assert ok["status"] == 200 and ok["bag_sizes"] == [b.shape[0] for b in bags]
    assert ok["model"]["name"] == "demo-dose" and len(ok["model"]["sha256"]) == 64
    assert len(ok["request_sha256"]) == 64 and ok["request_id"]
    # Flags, scores and statuses; no patient value (BAGSERVE_AUDIT_VALUES is off).
    assert ok["output"] == {
        "n_bags": 2,
        "status": [p["status"] for p in answer["predictions"]],
        "out_of_range": [p["domain"]["out_of_range"] for p in answer["predictions"]],
        "domain_score": [round(p["domain"]["score"], 6) for p in answer["predictions"]],
    }
    assert ok["inputs"] == [p["input_sha256"] for p in answer["predictions"]]
    assert bad["status"] == 422 and "output" not in bad
    exe = str(Path(sys.executable).parent / "bagserve")
    where = ["--data-dir", str(data_dir)]
    assert subprocess.run([exe, "audit", "verify", *where]).returncode == 0
    exported = tmp_path / "audit.jsonl"
    out = subprocess.run(
        [exe, "audit", "export", str(exported), *where], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    text = exported.read_text()
    assert str(bags[0][0, 0]) not in text  # no point values
    assert json.loads(text.splitlines()[-1]) == bad
    assert subprocess.run([exe, "audit", "verify", str(exported)]).returncode == 0
    copy = tmp_path / "copy.jsonl"
    head = (tmp_path / "audit.jsonl.head").read_text()
    cases = {
        "edited": lambda ls: [ls[0].replace('"status":200', '"status":201'), *ls[1:]],
        "deleted": lambda ls: [ls[0], *ls[2:]],
        "truncated": lambda ls: ls[:-1],
    }
    for name, mutate in cases.items():
        copy.write_text("\n".join(mutate(text.splitlines())) + "\n")
        (tmp_path / "copy.jsonl.head").write_text(head)
        result = verify(copy)
        assert not result.ok, name
        out = subprocess.run([exe, "audit", "verify", str(copy)], capture_output=True, text=True)
        assert out.returncode == 1 and out.stderr.startswith("error:"), name


def test_prometheus_metrics(url):
    bags, markers = dose_bags(1)
    before = stage_counts(url)
    v1(url, bags, markers)
    after = stage_counts(url)
    for stage in ("read", "parse", "validate", "queue", "transfer", "compute", "audit", "encode"):
        assert after[stage] == before[stage] + 1, stage
    text = httpx.get(f"{url}/metrics").text
    assert (
        'bagserve_requests_total{model="demo-dose",route="/v1/models/{name}/predict",status="200"}'
        in text
    )
    assert "bagserve_points_per_bag_bucket" in text
    assert "bagserve_queue_depth 0.0" in text and "bagserve_busy_workers" in text
    # The broken artifact and the CME on points.
    assert "bagserve_model_load_failures 2.0" in text


def test_logs_are_json_with_request_ids(url, models):
    r = httpx.get(f"{url}/v1/models", headers={"x-request-id": "trace-abc"})
    assert r.headers["x-request-id"] == "trace-abc"

    def found(r: dict) -> bool:
        return r.get("request_id") == "trace-abc" and r.get("path") == "/v1/models"

    assert any(map(found, logged(lambda: models.parent.glob("serve-*.log"), found)))


# ----------------------------------------------------------------- applicability domain
def test_every_answer_says_whether_the_bag_is_in_the_models_domain(url, models):
    """v1 JSON, v2 tensors and parameters, and jobs carry the domain report; a bag unlike
    the training data is flagged, warned about (header and body) and counted."""
    from bagserve.core.runtime import ModelRuntime

    bags, markers = dose_bags(3, seed=21)
    foreign = bags[0] * 40.0 + 25.0  # same markers, another instrument's scale
    body = {
        "bags": [
            {"id": "usual", "markers": markers, "points": bags[1].tolist()},
            {"id": "foreign", "markers": markers, "points": foreign.tolist()},
        ]
    }
    r = httpx.post(f"{url}/v1/models/demo-dose/predict", json=body, timeout=60)
    assert r.status_code == 200
    usual, odd = r.json()["predictions"]
    assert usual["domain"]["out_of_range"] is False and odd["domain"]["out_of_range"] is True
    assert odd["domain"]["score"] > 5 * usual["domain"]["score"]
    # The same report as the runtime's, in process.
    runtime = ModelRuntime.open(models / "demo-dose" / "1")
    from bagserve.core import Bags

    local = runtime.predict(Bags.from_arrays([bags[1], foreign])).domain
    assert [usual["domain"]["score"], odd["domain"]["score"]] == local.score.tolist()
    assert len(odd["domain"]["nearest"]) == 3 and all(
        isinstance(n, str) for n in odd["domain"]["nearest"]
    )
    assert r.headers["warning"].startswith('299 bagserve "') and "foreign" in r.headers["warning"]
    assert "usual" not in r.headers["warning"]
    assert any("'foreign'" in w and "applicability domain" in w for w in r.json()["warnings"])
    quiet = httpx.post(
        f"{url}/v1/models/demo-dose/predict", json={"bags": body["bags"][:1]}, timeout=60
    )
    assert "warning" not in quiet.headers
    # Open Inference Protocol: tensors per bag, the report in the parameters.
    v2 = oip_infer(
        url,
        "demo-dose",
        [
            ("points", np.vstack([bags[1], foreign]), {"markers": markers}),
            ("bag_sizes", np.array([len(bags[1]), len(foreign)]), {}),
        ],
    )
    out = oip_outputs(v2)
    assert out["outputs"]["out_of_range"].tolist() == [False, True]
    np.testing.assert_array_equal(out["outputs"]["domain_score"], local.score)
    assert [d["out_of_range"] for d in out["doc"]["parameters"]["domain"]] == [False, True]
    assert "warning" in v2.headers
    # Jobs store the same answer.
    r = httpx.post(f"{url}/v1/jobs", params={"model": "demo-dose"}, json=body)
    job = poll(url, r.headers["location"])
    assert [p["domain"] for p in job["result"]["predictions"]] == [usual["domain"], odd["domain"]]
    # Drift shows on a dashboard.
    text = httpx.get(f"{url}/metrics").text
    assert 'bagserve_domain_score_count{model="demo-dose/1"}' in text
    flagged = [
        line
        for line in text.splitlines()
        if line.startswith('bagserve_out_of_range_total{model="demo-dose/1"}')
    ]
    assert flagged and float(flagged[0].split()[-1]) >= 3  # v1, v2 and the job


# ----------------------------------------------------------------- intervals and sets
def yeast_samples(n: int = 3) -> list[Path]:
    return sorted((SHARED_DATA / "cytoflow_yeast" / "dose_response").glob("*.fcs"))[:n]


def test_intervals_sets_and_probabilities_on_request(url, models):
    """?interval= adds the runtime's jackknife+ interval (regressors) or conformal set
    (classifiers), in JSON, CSV, /v2 and jobs; it is refused where no interval exists."""
    from bagserve.core.io import read_sample
    from bagserve.core.runtime import ModelRuntime

    files = yeast_samples()
    multipart = [("files", (f.name, f.read_bytes(), "application/octet-stream")) for f in files]
    runtime = ModelRuntime.open(models / "yeast" / "2")
    local = runtime.predict(runtime.align([read_sample(f) for f in files]), coverage=0.8)
    r = httpx.post(
        f"{url}/v1/models/yeast/predict", params={"interval": "0.8"}, files=multipart, timeout=60
    )
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert [p["interval"] for p in preds] == local.interval.tolist()
    for p in preds:
        lo, hi = p["interval"]
        assert lo <= p["prediction"] <= hi and "domain" in p
    csv_answer = httpx.post(
        f"{url}/v1/models/yeast/predict",
        params={"interval": "0.8"},
        files=multipart,
        headers={"accept": "text/csv"},
        timeout=60,
    ).text.splitlines()
    assert csv_answer[0] == (
        "id,prediction,interval_lo,interval_hi,status,out_of_range,domain_score,"
        "withheld_reason,input_sha256,model_sha256,warnings,error"
    )
    for line, p in zip(csv_answer[1:], preds, strict=True):
        assert [float(v) for v in line.split(",")[1:4]] == [p["prediction"], *p["interval"]]
    # A classifier: calibrated probabilities always, the prediction set on request.
    r = httpx.post(
        f"{url}/v1/models/yeast-level/predict",
        params={"interval": "0.9"},
        files=multipart,
        timeout=60,
    )
    for p in r.json()["predictions"]:
        assert set(p["probabilities"]) == {"high", "low"}
        assert sum(p["probabilities"].values()) == pytest.approx(1.0)
        assert max(p["probabilities"], key=p["probabilities"].get) == p["prediction"]
        assert set(p["set"]) <= {"high", "low"}
    # /v2: the request parameter, an interval tensor.
    points = [read_sample(f) for f in files]
    aligned = runtime.align(points)
    v2 = oip_infer(
        url,
        "yeast",
        [
            ("points", aligned.points, {"markers": list(runtime.info.markers)}),
            ("bag_sizes", aligned.sizes.astype(np.int64), {}),
        ],
        parameters={"interval": 0.8},
    )
    np.testing.assert_array_equal(oip_outputs(v2)["outputs"]["interval"], local.interval)
    # Jobs keep the option.
    r = httpx.post(f"{url}/v1/jobs", params={"model": "yeast", "interval": "0.8"}, files=multipart)
    job = poll(url, r.headers["location"])
    assert [p["interval"] for p in job["result"]["predictions"]] == local.interval.tolist()
    # Refused, with the reason, before any computation.
    for model, params, needle in [
        ("yeast", {"interval": "1.5"}, "strictly between 0 and 1"),
        ("yeast", {"interval": "abc"}, "a coverage such as 0.9"),
        ("demo-gating", {"interval": "0.9"}, "per-cell models"),
    ]:
        r = httpx.post(f"{url}/v1/models/{model}/predict", params=params, files=multipart)
        assert r.status_code == 422 and needle in r.json()["detail"], r.text


# ----------------------------------------------------------------- raw cytometry
def test_a_compensating_model_compensates_uploads_and_refuses_what_it_cannot(url, models):
    """The model compensates each FCS upload with the file's own spillover matrix, as
    the runtime does in process; cells without a matrix are refused unless the caller
    declares them compensated (and the audit trail records that)."""
    from bagserve.core.io import read_sample
    from bagserve.core.runtime import ModelRuntime

    fcs = SHARED_DATA / "flowsom_example" / "not_preprocessed.fcs"
    runtime = ModelRuntime.open(models / "raw-comp" / "1")
    sample = read_sample(fcs)
    local = runtime.predict(runtime.align([sample])).estimate
    r = httpx.post(
        f"{url}/v1/models/raw-comp/predict",
        files=[("files", (fcs.name, fcs.read_bytes(), "application/octet-stream"))],
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert [p["prediction"] for p in r.json()["predictions"]] == local.tolist()

    def csv_of(points: np.ndarray) -> bytes:
        lines = [",".join(sample.names)]
        lines += [",".join(f"{v:.17g}" for v in row) for row in points]
        return ("\n".join(lines) + "\n").encode()

    raw_csv = csv_of(sample.points)
    r = httpx.post(
        f"{url}/v1/models/raw-comp/predict",
        content=raw_csv,
        headers={"content-type": "text/csv"},
        params={"id": "patient-9"},
    )
    assert r.status_code == 422
    assert any("patient-9" in e and "spillover" in e for e in r.json()["errors"]), r.text
    compensated = runtime.info.preprocessing.compensate(sample).points
    r = httpx.post(
        f"{url}/v1/models/raw-comp/predict",
        content=csv_of(compensated),
        headers={"content-type": "text/csv", "x-request-id": "declared-compensated"},
        params={"compensated": "true"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["predictions"][0]["prediction"], local[0], rtol=1e-9)
    # The audit record is committed before the answer is sent.
    records = [
        r
        for r in audit_log(models.parent / "data").recent(50)
        if r["request_id"] == "declared-compensated"
    ]
    assert records and records[0]["compensated_by_caller"] is True


def test_per_cell_models_answer_a_population_summary(url, models):
    """Counts, percentages and mean calibrated probabilities per class and bag, labels
    optional (?cells=false), per-cell probabilities on request in JSON, CSV, NPY, /v2
    and jobs; each agrees with the runtime in process."""
    import io as _io

    from bagserve.core import Bags
    from bagserve.core.runtime import ModelRuntime

    tasks, _, markers = demo_samples("gating", 2, 5)
    bags = [np.asarray(tasks[i]) for i in range(2)]
    body = {
        "bags": [
            {"id": f"s{i}", "markers": markers, "points": b.tolist()} for i, b in enumerate(bags)
        ]
    }
    runtime = ModelRuntime.open(models / "demo-gating" / "1")
    local = runtime.predict(Bags.from_arrays(bags), probabilities=True)
    predict = f"{url}/v1/models/demo-gating/predict"
    full = httpx.post(predict, json=body, timeout=60).json()["predictions"]
    for i, p in enumerate(full):
        assert p["population"] == local.population(i)
        labels = np.asarray(p["labels"])
        assert [r["count"] for r in p["population"]] == [
            int(np.sum(labels == c)) for c in local.classes.tolist()
        ]
        assert sum(r["percent"] for r in p["population"]) == pytest.approx(100.0)
        assert all(0.0 <= r["mean_probability"] <= 1.0 for r in p["population"])
    summary = httpx.post(predict, json=body, params={"cells": "false"}, timeout=60).json()
    assert all("labels" not in p for p in summary["predictions"])
    assert [p["population"] for p in summary["predictions"]] == [p["population"] for p in full]
    csv_rows = list(
        csv.DictReader(
            _io.StringIO(
                httpx.post(
                    predict,
                    json=body,
                    params={"cells": "false"},
                    headers={"accept": "text/csv"},
                    timeout=60,
                ).text
            )
        )
    )
    # One row per bag, a column per class and quantity (tests/test_tables.py: the layout).
    assert len(csv_rows) == 2
    for row, p in zip(csv_rows, summary["predictions"], strict=True):
        assert int(row["n_cells"]) == p["n_points"]
        for r in p["population"]:
            assert int(row[f"count_{r['class']}"]) == r["count"]
            assert float(row[f"percent_{r['class']}"]) == r["percent"]
            assert float(row[f"mean_probability_{r['class']}"]) == r["mean_probability"]
    # Every cell's probabilities: JSON, CSV columns and NPY agree with the runtime.
    probs = httpx.post(predict, json=body, params={"probabilities": "true"}, timeout=60).json()
    first = probs["predictions"][0]["probabilities"]
    assert first["classes"] == local.classes.tolist()
    np.testing.assert_allclose(first["cells"], local.probabilities_of(0), rtol=1e-12)
    npy = httpx.post(
        predict,
        json=body,
        params={"probabilities": "true"},
        headers={"accept": "application/x-npy"},
        timeout=60,
    )
    assert json.loads(npy.headers["bagserve-classes"]) == local.classes.tolist()
    np.testing.assert_allclose(np.load(_io.BytesIO(npy.content)), local.probabilities, rtol=1e-12)
    csv_head = httpx.post(
        predict,
        json=body,
        params={"probabilities": "true"},
        headers={"accept": "text/csv"},
        timeout=60,
    ).text.splitlines()[0]
    assert csv_head.startswith("id,cell,label," + ",".join(f"p_{c}" for c in local.classes))
    # /v2: the counts tensor and the classes naming its columns.
    v2 = oip_infer(
        url,
        "demo-gating",
        [("points", np.vstack(bags), {}), ("bag_sizes", np.array([b.shape[0] for b in bags]), {})],
        parameters={"markers": markers},
    )
    parsed = oip_outputs(v2)
    np.testing.assert_array_equal(parsed["outputs"]["population_counts"], local.counts)
    assert parsed["doc"]["parameters"]["classes"] == local.classes.tolist()
    # Jobs keep the choice.
    r = httpx.post(
        f"{url}/v1/jobs", params={"model": "demo-gating", "cells": "false"}, json=body, timeout=60
    )
    job = poll(url, r.headers["location"])
    assert [p["population"] for p in job["result"]["predictions"]] == [
        p["population"] for p in full
    ]
    assert "labels" not in job["result"]["predictions"][0]
    # Refused where they mean nothing.
    for model, params, needle in [
        ("demo-dose", {"probabilities": "true"}, "per-cell models only"),
        ("demo-gating", {"cells": "maybe"}, "true or false"),
    ]:
        r = httpx.post(f"{url}/v1/models/{model}/predict", params=params, json=body)
        assert r.status_code == 422 and needle in r.json()["detail"], r.text


def test_parquet_and_anndata_bodies_predict_as_the_same_cells_in_csv(url, tmp_path):
    """The two optional formats, as a body (their content types, or octet-stream by
    magic) and as multipart files, give the answer the same cells give as CSV."""
    import io as _io

    import anndata
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq
    from bagserve.core.io import read_sample

    sample = read_sample(yeast_samples(1)[0])
    keep = [sample.names.index(m) for m in ("FSC-A", "SSC-A", "FITC-A")]
    cells, names = sample.points[:, keep], ["FSC-A", "SSC-A", "FITC-A"]
    csv = "\n".join([",".join(names), *(",".join(f"{v:.17g}" for v in r) for r in cells)])
    predict = f"{url}/v1/models/yeast/predict"
    expected = httpx.post(
        predict, content=csv.encode(), headers={"content-type": "text/csv"}, timeout=60
    ).json()["predictions"][0]["prediction"]
    buf = _io.BytesIO()
    # A text column beside the markers, as lab exports have: skipped.
    table = {"sample": ["B01"] * cells.shape[0]} | {n: cells[:, j] for j, n in enumerate(names)}
    pq.write_table(pa.table(table), buf)
    parquet = buf.getvalue()
    h5 = tmp_path / "cells.h5ad"
    anndata.AnnData(X=cells, var=pd.DataFrame(index=["FSC-A", "SSC-A", "GFP"])).write_h5ad(h5)
    h5ad = h5.read_bytes()
    bodies = [
        (parquet, "application/vnd.apache.parquet"),
        (h5ad, "application/x-hdf5"),
        (parquet, "application/octet-stream"),
        (h5ad, "application/octet-stream"),
    ]
    for body, ctype in bodies:
        r = httpx.post(predict, content=body, headers={"content-type": ctype}, timeout=60)
        assert r.status_code == 200, (ctype, r.text)
        assert r.json()["predictions"][0]["prediction"] == expected
    files = [("files", ("a.parquet", parquet)), ("files", ("b.h5ad", h5ad))]
    r = httpx.post(predict, files=files, timeout=60)
    assert [p["prediction"] for p in r.json()["predictions"]] == [expected, expected]
    bad = httpx.post(
        predict,
        content=b"PAR1" + b"\0" * 16,
        headers={"content-type": "application/vnd.apache.parquet"},
    )
    assert bad.status_code == 422 and "unreadable Parquet" in bad.json()["detail"]
