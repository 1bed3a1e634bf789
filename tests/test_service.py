"""The service, live: uvicorn on 127.0.0.1 in a subprocess, spoken to with httpx."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest
from bagserve.core import Bags, load
from bagserve.core.demo import demo_samples
from bagserve.core.io import Panel, Preprocessing, read_sample
from bagserve.service.client import AsyncClient, BagserveError, Client

from .conftest import SHARED_DATA
from .service_harness import (
    PREDICTION_STAGES,
    build_models,
    running_service,
    server_timing,
    wait_ready,
)

YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"
DOSE_MARKERS = ["FSC-A", "SSC-A", "GFP"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("svc") / "models")


@pytest.fixture(scope="module")
def service(models):
    with running_service(models) as url:
        yield url


@pytest.fixture(scope="module")
def http(service):
    with httpx.Client(base_url=service, timeout=120) as client:
        yield client


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def dose_bags(n: int = 3, seed: int = 9):
    bags, dose, markers = demo_samples("dose", n, seed)
    return [np.asarray(b) for b in bags], dose, markers


# ----------------------------------------------------------------- discovery
def test_health_readiness_and_model_listing(http):
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz").json()
    assert ready["status"] == "ready" and ready["workers"]["alive"] == 2
    assert set(ready["models"]) == {
        "cme/1",
        "demo-dose/1",
        "demo-gating/1",
        "yeast-level/1",
        "density/1",
        "raw-comp/1",
        "slow/1",
        "yeast/1",
        "yeast/2",
    }
    # The broken artifact is reported and skipped; the others still serve.
    assert "broken/1" in ready["model_failures"]
    listing = http.get("/v1/models").json()
    names = [m["name"] for m in listing["models"]]
    assert names == [
        "cme",
        "demo-dose",
        "demo-gating",
        "density",
        "raw-comp",
        "slow",
        "yeast",
        "yeast-level",
    ]
    one = http.get("/v1/models/yeast").json()
    assert one["latest"] == "2" and [v["version"] for v in one["versions"]] == ["1", "2"]
    v = one["versions"][0]
    assert v["panel"]["markers"] == ["FSC-A", "SSC-A", "FITC-A"] and len(v["sha256"]) == 64
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"


# ----------------------------------------------------------------- formats
def test_json_many_bags_with_provenance_and_bit_for_bit(http, models):
    bags, dose, markers = dose_bags()
    body = {
        "bags": [
            {"id": f"s{i}", "markers": markers, "points": b.tolist()} for i, b in enumerate(bags)
        ]
    }
    content = json.dumps(body).encode()
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=content,
        headers={"content-type": "application/json", "x-request-id": "trace-42"},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    model = load(models / "demo-dose" / "1")
    expected = model.predict(bags)
    assert [p["prediction"] for p in out["predictions"]] == expected.tolist()
    assert out["request_id"] == "trace-42" == r.headers["x-request-id"]
    sha = hashlib.sha256(content).hexdigest()
    assert out["request_sha256"] == sha == r.headers["x-request-sha256"]
    # Each bag is known by the sha256 of its cells (float64, C order): the same cells
    # have the same hash in any request.
    assert [p["input_sha256"] for p in out["predictions"]] == [
        hashlib.sha256(np.ascontiguousarray(b, dtype=np.float64).tobytes()).hexdigest()
        for b in bags
    ]
    assert "x-input-sha256" not in r.headers  # one per bag: in the answer
    # The demo model's policy is the default: out of domain means preliminary.
    assert [p["status"] for p in out["predictions"]] == [
        "preliminary" if p["domain"]["out_of_range"] else "final" for p in out["predictions"]
    ]
    assert r.headers["x-model-name"] == "demo-dose" and r.headers["x-model-version"] == "1"
    assert out["model"]["sha256"] == r.headers["x-model-sha256"]
    assert set(server_timing(r)) == set(PREDICTION_STAGES)
    assert np.max(np.abs(expected - dose)) < 0.3


def test_markers_are_matched_by_name_reordered_and_extras_reported(http):
    bags, _, _ = dose_bags(1)
    ref = http.post(
        "/v1/models/demo-dose/predict", json={"bags": [{"points": bags[0].tolist()}]}
    ).json()
    shuffled = bags[0][:, [2, 0, 1]]
    extra = np.hstack([shuffled, np.ones((shuffled.shape[0], 1))])
    r = http.post(
        "/v1/models/demo-dose/predict",
        json={"bags": [{"markers": ["gfp", "FSC_A", "ssc-a", "Time"], "points": extra.tolist()}]},
    )
    assert r.status_code == 200
    assert r.json()["predictions"][0]["prediction"] == ref["predictions"][0]["prediction"]
    # A routine fact, not a warning: a note of the answer.
    assert r.json()["warnings"] == []
    assert r.json()["notes"] == ["bag 'bag-0': channels the model does not use: ['Time']"]


def test_npy_csv_tsv_fcs_and_multipart_bodies(http):
    bags, _, markers = dose_bags(2)
    ref = [p["prediction"] for p in http.post(
        "/v1/models/demo-dose/predict", json={"bags": [{"points": b.tolist()} for b in bags]}
    ).json()["predictions"]]  # fmt: skip
    r = http.post(
        "/v1/models/demo-dose/predict",
        params={"markers": ",".join(markers)},
        content=npy(bags[0]),
        headers={"content-type": "application/x-npy"},
    )
    assert r.json()["predictions"][0]["prediction"] == ref[0]
    # No marker names: the columns are taken in panel order.
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=npy(bags[1]),
        headers={"content-type": "application/x-npy"},
    )
    assert r.json()["predictions"][0]["prediction"] == ref[1]
    csv_text = (
        ",".join(markers)
        + "\n"
        + "\n".join(",".join(repr(float(v)) for v in row) for row in bags[0])
    )
    r = http.post(
        "/v1/models/demo-dose/predict", content=csv_text, headers={"content-type": "text/csv"}
    )
    assert r.json()["predictions"][0]["prediction"] == pytest.approx(ref[0], rel=1e-12)
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=csv_text.replace(",", "\t"),
        headers={"content-type": "text/tab-separated-values"},
    )
    assert r.status_code == 200
    fcs = (YEAST / "Yeast_B1_B01.fcs").read_bytes()
    r = http.post(
        "/v1/models/yeast/predict",
        content=fcs,
        headers={"content-type": "application/vnd.isac.fcs"},
    )
    assert r.status_code == 200 and r.json()["model"]["version"] == "2"
    # A raw file body is known by its own name ($FIL) and by its bytes' sha256.
    (answer,) = r.json()["predictions"]
    file_name = read_sample(YEAST / "Yeast_B1_B01.fcs").file_name
    assert file_name and answer["id"] == file_name
    assert answer["input_sha256"] == hashlib.sha256(fcs).hexdigest() == r.json()["request_sha256"]
    r1 = http.post(
        "/v1/models/yeast/versions/1/predict",
        content=fcs,
        headers={"content-type": "application/octet-stream"},
    )
    assert r1.json()["predictions"][0]["prediction"] == r.json()["predictions"][0]["prediction"]
    files = [
        ("files", ("B1.fcs", fcs, "application/octet-stream")),
        (
            "files",
            ("C9.fcs", (YEAST / "Yeast_C9_C09.fcs").read_bytes(), "application/octet-stream"),
        ),
    ]
    r = http.post("/v1/models/yeast/predict", files=files)
    assert r.status_code == 200
    assert [p["id"] for p in r.json()["predictions"]] == ["B1.fcs", "C9.fcs"]
    # Each part is hashed on its own: the file's sha256 whatever the transport, the same
    # on every upload (the request's own hash changes with the multipart boundary).
    digests = [hashlib.sha256(f[1][1]).hexdigest() for f in files]
    assert [p["input_sha256"] for p in r.json()["predictions"]] == digests
    again = http.post("/v1/models/yeast/predict", files=files).json()
    assert [p["input_sha256"] for p in again["predictions"]] == digests
    assert again["request_sha256"] != r.json()["request_sha256"]


def test_large_npy_bodies_stream_into_shared_memory_bit_for_bit(http, models):
    """Bodies from 1 MiB on are read into reused shared buffers and sent to the worker
    without a copy: every answer must still be the in-process prediction, bit for bit,
    including when a buffer is reused for a body of another size and content, when the
    columns need reordering (a copy), and for Fortran-order and big-endian files."""
    from bagserve.service.wire import MEMFD_MIN_BYTES
    from threadpoolctl import threadpool_limits

    model = load(models / "demo-dose" / "1")
    rng = np.random.default_rng(21)
    bags = [rng.normal(loc=1.0, size=(n, 3)) for n in (60_000, 50_000, 80_000, 60_000)]
    assert min(b.nbytes for b in bags) >= MEMFD_MIN_BYTES
    with threadpool_limits(1):  # as in the workers
        expected = [float(model.predict([b])[0]) for b in bags]
    bodies = [npy(b) for b in bags[:3]]
    bodies.append(npy(np.asfortranarray(bags[3])))
    for body, want in zip(bodies, expected, strict=True):
        r = http.post(
            "/v1/models/demo-dose/predict",
            params={"markers": ",".join(DOSE_MARKERS)},
            content=body,
            headers={"content-type": "application/x-npy"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["predictions"][0]["prediction"] == want
        assert r.headers["x-input-sha256"] == hashlib.sha256(body).hexdigest()
    # Columns in another order: matched by name (the points are copied, then sent).
    r = http.post(
        "/v1/models/demo-dose/predict",
        params={"markers": ",".join(DOSE_MARKERS[::-1])},
        content=npy(bags[0][:, ::-1]),
        headers={"content-type": "application/x-npy"},
    )
    assert r.json()["predictions"][0]["prediction"] == expected[0]
    # Big-endian float32 through application/octet-stream: converted, as before.
    small = bags[1].astype(">f4")
    with threadpool_limits(1):
        want = float(model.predict([small.astype(np.float64)])[0])
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=npy(small),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 200 and r.json()["predictions"][0]["prediction"] == want
    # A large NPY body with a NaN is still refused, naming the problem.
    bad = bags[2].copy()
    bad[123, 2] = np.inf
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=npy(bad),
        headers={"content-type": "application/x-npy"},
    )
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
    assert "1 non-finite value(s), first at cell 124" in r.json()["detail"]
    # Large JSON bodies are read into the same buffers: same answers, same errors.
    doc = {"bags": [{"id": "j", "markers": DOSE_MARKERS, "points": bags[2].tolist()}]}
    body = json.dumps(doc).encode()
    assert len(body) >= MEMFD_MIN_BYTES
    r = http.post(
        "/v1/models/demo-dose/predict", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200 and r.json()["predictions"][0]["prediction"] == expected[2]
    assert r.headers["x-request-sha256"] == hashlib.sha256(body).hexdigest()
    assert r.headers["x-input-sha256"] == hashlib.sha256(bags[2].tobytes()).hexdigest()
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=body[:-2],
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["type"].endswith("invalid-json")
    doc["bags"][0]["points"][7] = [1.0]
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=json.dumps(doc).encode(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422 and "'j': points must be a rectangular" in r.json()["errors"][0]
    # A truncated large body is refused as unreadable, not served from stale memory.
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=bodies[2][:-8],
        headers={"content-type": "application/x-npy"},
    )
    assert r.status_code == 422 and "not a readable NPY array" in r.json()["detail"]


def test_accept_csv_and_npy_answers(http):
    bags, _, markers = dose_bags(2)
    body = {
        "bags": [
            {"id": f"b{i}", "markers": markers, "points": b.tolist()} for i, b in enumerate(bags)
        ]
    }
    r = http.post("/v1/models/demo-dose/predict", json=body, headers={"accept": "text/csv"})
    assert r.headers["content-type"].startswith("text/csv")
    lines = r.text.splitlines()
    assert lines[0] == (
        "id,prediction,status,out_of_range,domain_score,withheld_reason,input_sha256,"
        "model_sha256,warnings,error"
    )
    assert len(lines) == 3
    # The values, trust and provenance columns are the JSON answer's, bag by bag.
    answer = http.post("/v1/models/demo-dose/predict", json=body).json()
    for line, p in zip(lines[1:], answer["predictions"], strict=True):
        bag_id, value, status, flag, score, reason, digest, model_sha, warn, err = line.split(",")
        assert bag_id == p["id"] and float(value) == p["prediction"]
        assert float(score) == p["domain"]["score"]
        assert flag == str(int(p["domain"]["out_of_range"]))
        assert (status, digest) == (p["status"], p["input_sha256"])
        assert model_sha == answer["model"]["sha256"]
        assert reason == warn == err == ""
    r = http.post(
        "/v1/models/demo-dose/predict", json=body, headers={"accept": "application/x-npy"}
    )
    assert np.load(io.BytesIO(r.content)).shape == (2,)
    r = http.post("/v1/models/demo-dose/predict", json=body, headers={"accept": "image/png"})
    assert r.status_code == 406


def test_marginal_transfer_model_labels_every_cell(http, models):
    tasks, y, markers = demo_samples("gating", 2, 6)
    body = {
        "bags": [
            {"id": f"p{i}", "markers": markers, "points": np.asarray(t).tolist()}
            for i, t in enumerate(tasks)
        ]
    }
    r = http.post("/v1/models/demo-gating/predict", json=body)
    assert r.status_code == 200
    preds = r.json()["predictions"]
    labels = np.concatenate([p["labels"] for p in preds])
    np.testing.assert_array_equal(labels, load(models / "demo-gating" / "1").predict(tasks))
    assert np.mean(labels == y) > 0.8
    assert (
        preds[0]["report"]["out_of_range"] is False and len(preds[0]["report"]["similarities"]) == 3
    )
    r = http.post("/v1/models/demo-gating/predict", json=body, headers={"accept": "text/csv"})
    assert (
        r.text.splitlines()[0]
        == "id,cell,label,status,out_of_range,domain_score,withheld_reason,input_sha256,"
        "model_sha256,warnings,error"
        and len(r.text.splitlines()) == 1 + tasks.n_points
    )


def test_cells_far_from_every_population_are_unassigned_on_request(http, models):
    tasks, _, markers = demo_samples("gating", 1, 6)
    cells = np.asarray(tasks[0]).copy()
    cells[:7] += 40.0  # seven cells no population is anywhere near
    body = {"bags": [{"id": "p", "markers": markers, "points": cells.tolist()}]}
    r = http.post("/v1/models/demo-gating/predict?unassigned=0.999", json=body)
    assert r.status_code == 200, r.text
    (pred,) = r.json()["predictions"]
    model = load(models / "demo-gating" / "1")
    labels = model.predict([cells])
    # Oracle: the model's own labels, with its far-cell rule applied.
    far = model.far_from_populations([cells], labels, 0.999)
    assert far[:7].all()
    expected = np.where(far, "unassigned", labels.astype(str))
    np.testing.assert_array_equal(np.asarray(pred["labels"], dtype=str), expected)
    rows = {row["class"]: row for row in pred["population"]}
    assert rows["unassigned"]["count"] == int(far.sum())
    assert sum(row["count"] for row in rows.values()) == cells.shape[0]
    # Without asking, no cell is unassigned; bad levels and the mix with probabilities
    # are refused before the body is read.
    plain = http.post("/v1/models/demo-gating/predict", json=body).json()["predictions"][0]
    assert "unassigned" not in {row["class"] for row in plain["population"]}
    for query, message in (
        ("unassigned=2", "unassigned must be a level in (0, 1)"),
        ("unassigned=0.99&probabilities=true", "not both"),
    ):
        r = http.post(f"/v1/models/demo-gating/predict?{query}", json=body)
        assert r.status_code == 422 and message in r.text
    r = http.post("/v1/models/demo-dose/predict?unassigned=0.99", json={"bags": []})
    assert r.status_code == 422 and "per-cell classifiers only" in r.text


# ----------------------------------------------------------------- errors
def test_density_feature_model_serves_and_reports_clipped_cells(http, models):
    """Paper 001 features: same answer as in process; clipped cells are reported."""
    fcs = sorted((SHARED_DATA / "cytoflow_yeast" / "dose_response").glob("Yeast_B*.fcs"))[3]
    model = load(models / "density" / "1")
    pre = Preprocessing(transform="arcsinh", cofactor=150.0)
    panel = Panel(("FSC-A", "SSC-A", "FITC-A"), {"FITC-A": ("GFP",)})
    bag = panel.select(read_sample(fcs))
    expected = model.predict(pre.apply(Bags.from_arrays([bag]), list(panel.markers)))
    r = http.post(
        "/v1/models/density/predict",
        content=fcs.read_bytes(),
        headers={"content-type": "application/vnd.isac.fcs"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["predictions"][0]["prediction"] == float(expected[0])
    # A training sample: only the FCS file's extra channels are mentioned, nothing clipped.
    assert not [w for w in r.json()["warnings"] if "clipped" in w]
    moved = bag.copy()
    moved[:25, 2] = 1e9  # far beyond the training range of FITC-A
    body = {"bags": [{"id": "m", "markers": list(panel.markers), "points": moved.tolist()}]}
    r = http.post("/v1/models/density/predict", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["warnings"] == [
        f"bag 'm': 25 of {len(bag)} cell(s) lie outside the model's training range and were "
        "clipped into it"
    ]


def test_conditional_model_answers_quantiles_and_exceedance(http, models):
    """Paper 002 served: mean, quantiles and P(Y > t) as query parameters, in process equal."""
    files = sorted((SHARED_DATA / "cytoflow_yeast" / "dose_response").glob("Yeast_B*.fcs"))[:3]
    model = load(models / "cme" / "1")
    pre = Preprocessing(transform="arcsinh", cofactor=150.0)
    panel = Panel(("FSC-A", "SSC-A", "FITC-A"), {"FITC-A": ("GFP",)})
    bags = pre.apply(
        Bags.from_arrays([panel.select(read_sample(f)) for f in files]), list(panel.markers)
    )
    files_body = [("files", (f.name, f.read_bytes(), "application/vnd.isac.fcs")) for f in files]
    r = http.post(
        "/v1/models/cme/predict",
        params={"quantiles": "0.1,0.5,0.9", "exceed": "2"},
        files=files_body,
    )
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    np.testing.assert_array_equal([p["prediction"] for p in preds], model.predict(bags))
    q = model.quantiles(bags, [0.1, 0.5, 0.9])
    assert [list(p["quantiles"].values()) for p in preds] == q.tolist()
    assert list(preds[0]["quantiles"]) == ["0.1", "0.5", "0.9"]
    assert [p["exceedance"]["2"] for p in preds] == model.exceedance(bags, [2.0])[:, 0].tolist()
    r = http.post(
        "/v1/models/cme/predict",
        params={"quantiles": "0.5"},
        files=files_body,
        headers={"accept": "text/csv"},
    )
    lines = r.text.splitlines()
    assert lines[0] == (
        "id,prediction,q_0.5,status,out_of_range,domain_score,withheld_reason,input_sha256,"
        "model_sha256,warnings,error"
    )
    for line, p in zip(lines[1:], preds, strict=True):
        cells = line.split(",")
        assert [float(cells[1]), float(cells[2])] == [p["prediction"], p["quantiles"]["0.5"]]
    for params, needle in [
        ({"quantiles": "1.5"}, "levels must lie in [0, 1]"),
        ({"exceed": "abc"}, "comma-separated numbers"),
    ]:
        r = http.post("/v1/models/cme/predict", params=params, files=files_body)
        assert r.status_code == 422 and needle in r.json()["detail"], r.text
    r = http.post("/v1/models/demo-dose/predict", params={"quantiles": "0.5"}, json={"bags": []})
    assert r.status_code == 422 and "need a conditional model" in r.json()["detail"]
    failures = http.get("/v1/models").json()["failures"]
    assert "cannot be served" in failures["points-cme/1"]


def test_every_validation_problem_is_listed_at_once(http):
    nan_bag = np.ones((5, 3))
    nan_bag[2, 1] = np.nan
    body = {
        "bags": [
            {"id": "two-columns", "points": [[1.0, 2.0]]},
            {"id": "wrong-markers", "markers": ["x", "GFP", "FSC-A"], "points": [[1.0, 2.0, 3.0]]},
            {"id": "empty", "points": []},
            {"id": "ragged", "points": [[1.0, 2.0, 3.0], [1.0]]},
        ]
    }
    r = http.post("/v1/models/demo-dose/predict", json=body)
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    text = " | ".join(problem["errors"])
    assert len(problem["errors"]) == 4, text
    assert "'two-columns' has 2 column(s), the model takes 3" in text
    assert "missing marker(s) ['SSC-A']" in text
    assert "'empty' is empty" in text
    assert "'ragged': points must be a rectangular" in text
    assert problem["status"] == 422 and problem["request_id"] and problem["error"]
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=npy(nan_bag),
        headers={"content-type": "application/x-npy"},
    )
    assert r.status_code == 422 and "non-finite" in r.json()["detail"] + " ".join(
        r.json()["errors"]
    )
    r = http.post("/v1/models/demo-gating/predict", json={"bags": [{"points": [[1.0] * 6]}]})
    assert r.status_code == 422 and "single cell" in r.json()["errors"][0]


def test_unknown_model_version_and_media_type(http):
    r = http.post("/v1/models/nope/predict", json={"bags": [{"points": [[1, 2, 3]]}]})
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["detail"]
    r = http.post("/v1/models/yeast/versions/9/predict", json={"bags": [{"points": [[1, 2, 3]]}]})
    assert r.status_code == 404 and "versions: ['1', '2']" in r.json()["detail"]
    r = http.post(
        "/v1/models/demo-dose/predict", content=b"hello", headers={"content-type": "text/plain"}
    )
    assert r.status_code == 415
    r = http.post(
        "/v1/models/demo-dose/predict",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    r = http.post(
        "/v1/models/yeast/predict",
        content=b"FCS3.0 broken",
        headers={"content-type": "application/vnd.isac.fcs"},
    )
    assert r.status_code == 422 and "FCS" in r.json()["detail"]


def test_cors_is_off_by_default(http):
    r = http.options(
        "/v1/models",
        headers={"origin": "https://lab.example", "access-control-request-method": "GET"},
    )
    assert "access-control-allow-origin" not in r.headers


# ----------------------------------------------------------------- clients
def test_client_sync_async_and_cli(service, capsys):
    bags, _, markers = dose_bags(2)
    with Client(service) as c:
        a = c.predict("demo-dose", bags, markers=markers, ids=["x", "y"])
        b = c.predict_npy("demo-dose", bags[0], markers=markers)
        f = c.predict_files("yeast", [YEAST / "Yeast_B1_B01.fcs"], version="1")
        with pytest.raises(BagserveError, match="404") as info:
            c.predict("nope", bags)
        assert info.value.problem["status"] == 404
    assert a["predictions"][0]["prediction"] == b["predictions"][0]["prediction"]
    assert f["model"]["version"] == "1"

    import asyncio

    async def go():
        async with AsyncClient(service) as ac:
            return await ac.predict("demo-dose", bags, markers=markers)

    assert asyncio.run(go())["predictions"][1] == a["predictions"][1] | {"id": "bag-1"}
    from bagserve.cli import main

    assert main(["predict", "yeast/1", str(YEAST / "Yeast_B1_B01.fcs"), "--url", service]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["results"][0]["prediction"] == f["predictions"][0]["prediction"]


def test_client_retries_on_503_and_429_with_backoff():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) == 1:
            return httpx.Response(503, headers={"retry-after": "1"}, json={"detail": "busy"})
        if len(calls) == 2:
            return httpx.Response(429, json={"detail": "slow down"})
        return httpx.Response(200, json={"predictions": [], "model": {}})

    with Client("http://127.0.0.1:9", transport=httpx.MockTransport(handler), backoff=0.05) as c:
        assert c.predict("m", [np.zeros((2, 3))]) == {"predictions": [], "model": {}}
    assert len(calls) == 3
    assert calls[1] - calls[0] >= 0.9  # honoured Retry-After
    always_busy = httpx.MockTransport(lambda r: httpx.Response(503, json={"detail": "x"}))
    with (
        Client("http://127.0.0.1:9", transport=always_busy, retries=2, backoff=0.01) as c,
        pytest.raises(BagserveError, match="503"),
    ):
        c.predict("m", [np.zeros((2, 3))])


# ----------------------------------------------------------------- failures
def test_worker_killed_mid_request_fails_fast_and_is_replaced(http, service):
    import os
    import signal

    big = np.random.default_rng(1).normal(size=(40_000, 3))
    result = {}

    def slow_request():
        t0 = time.monotonic()
        r = http.post(
            "/v1/models/slow/predict",
            content=npy(big),
            headers={"content-type": "application/x-npy"},
        )
        result.update(
            status=r.status_code,
            body=r.json(),
            seconds=time.monotonic() - t0,
            retry=r.headers.get("retry-after"),
        )

    th = threading.Thread(target=slow_request)
    th.start()
    deadline = time.monotonic() + 30
    while http.get("/readyz").json()["workers"]["busy"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = http.get("/readyz").json()["workers"]["pids"]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    th.join(60)
    assert result["status"] == 503 and result["retry"] == "1"
    assert "stopped" in result["body"]["detail"]
    # Readiness tells the truth while workers come back, then recovers.
    states = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        r = http.get("/readyz")
        states.append(r.status_code)
        if r.status_code == 200 and 503 in states:
            break
        time.sleep(0.05)
    assert 503 in states and states[-1] == 200
    ready = wait_ready(service)
    assert set(ready["workers"]["pids"]).isdisjoint(pids)
    bags, _, _ = dose_bags(1)
    assert (
        http.post(
            "/v1/models/demo-dose/predict", json={"bags": [{"points": bags[0].tolist()}]}
        ).status_code
        == 200
    )


@pytest.fixture(scope="module")
def strict_service(models):
    env = {
        "BAGSERVE_WORKERS": "1",
        "BAGSERVE_QUEUE_SIZE": "0",
        "BAGSERVE_API_KEYS": "first-key,second-key",
        "BAGSERVE_CORS_ORIGINS": "https://lab.example",
        "BAGSERVE_MAX_BODY_BYTES": "1000000",
        "BAGSERVE_MAX_BAGS": "3",
        "BAGSERVE_MAX_POINTS_PER_BAG": "30000",
        "BAGSERVE_RETRY_AFTER": "2",
    }
    with running_service(models, **env) as url:
        yield url


def test_api_keys_bearer_and_header_constant_time_and_health_open(strict_service, models):
    body = {"bags": [{"points": [[1.0, 2.0, 3.0]] * 3}]}
    with httpx.Client(base_url=strict_service, timeout=60) as h:
        assert h.get("/healthz").status_code == 200 and h.get("/readyz").status_code == 200
        r = h.post("/v1/models/demo-dose/predict", json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        r = h.post(
            "/v1/models/demo-dose/predict", json=body, headers={"authorization": "Bearer nope"}
        )
        assert r.status_code == 401 and r.json()["type"].endswith("invalid-api-key")
        assert h.get("/v1/models").status_code == 401
        for headers in ({"authorization": "Bearer first-key"}, {"x-api-key": "second-key"}):
            assert (
                h.post("/v1/models/demo-dose/predict", json=body, headers=headers).status_code
                == 200
            )
    log = (models.parent / f"serve-{strict_service.rsplit(':', 1)[1]}.log").read_text()
    assert "first-key" not in log and "second-key" not in log
    assert "api_key_id" in log


def test_cors_when_configured(strict_service):
    r = httpx.options(
        f"{strict_service}/v1/models",
        headers={"origin": "https://lab.example", "access-control-request-method": "GET"},
    )
    assert r.headers["access-control-allow-origin"] == "https://lab.example"


def test_size_limits(strict_service):
    auth = {"x-api-key": "first-key"}
    with httpx.Client(base_url=strict_service, timeout=60, headers=auth) as h:
        big = npy(np.zeros((70_000, 3)))  # 1.7 MB > 1 MB
        r = h.post(
            "/v1/models/demo-dose/predict",
            content=big,
            headers={"content-type": "application/x-npy"},
        )
        assert r.status_code == 413

        def chunks():
            for _ in range(200):
                yield b"0" * 10_000  # 2 MB, no Content-Length

        r = h.post(
            "/v1/models/demo-dose/predict",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413
        # The same without Content-Length for a body that could go to shared memory.
        r = h.post(
            "/v1/models/demo-dose/predict",
            content=chunks(),
            headers={"content-type": "application/x-npy"},
        )
        assert r.status_code == 413
        bags = {"bags": [{"id": str(i), "points": [[1.0, 2.0, 3.0]]} for i in range(4)]}
        r = h.post("/v1/models/demo-dose/predict", json=bags)
        assert r.status_code == 422 and "4 bags, more than the limit of 3" in r.json()["errors"][0]
        many = npy(np.zeros((40_000, 3)))  # 960 kB, under the body limit
        r = h.post(
            "/v1/models/demo-dose/predict",
            content=many,
            headers={"content-type": "application/x-npy"},
        )
        # Refused from its NPY header, before the cells are decoded.
        assert r.status_code == 413 and "more than the limit of 30000" in r.json()["errors"][0]
        assert "NPY header" in r.json()["detail"]


def test_full_queue_answers_503_with_retry_after(strict_service):
    auth = {"x-api-key": "first-key"}
    slow_bag = npy(np.random.default_rng(2).normal(size=(25_000, 3)))
    statuses = []

    def call():
        with httpx.Client(base_url=strict_service, timeout=120, headers=auth) as h:
            r = h.post(
                "/v1/models/slow/predict",
                content=slow_bag,
                headers={"content-type": "application/x-npy"},
            )
            statuses.append((r.status_code, r.headers.get("retry-after")))

    first = threading.Thread(target=call)
    first.start()
    deadline = time.monotonic() + 30
    while (
        httpx.get(f"{strict_service}/readyz", headers=auth).json()["workers"]["busy"] < 1
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    second = threading.Thread(target=call)
    second.start()
    second.join(30)
    first.join(120)
    assert sorted(s for s, _ in statuses) == [200, 503]
    assert ("503", "2") in [(str(s), r) for s, r in statuses]


def test_request_timeout_answers_504_and_replaces_the_worker(models):
    with running_service(models, BAGSERVE_WORKERS="1", BAGSERVE_REQUEST_TIMEOUT="0.5") as url:
        big = npy(np.random.default_rng(3).normal(size=(40_000, 3)))
        r = httpx.post(
            f"{url}/v1/models/slow/predict",
            content=big,
            headers={"content-type": "application/x-npy"},
            timeout=60,
        )
        assert r.status_code == 504 and r.json()["type"].endswith("timeout")
        wait_ready(url)
        bags, _, _ = dose_bags(1)
        ok = httpx.post(
            f"{url}/v1/models/demo-dose/predict",
            json={"bags": [{"points": bags[0].tolist()}]},
            timeout=60,
        )
        assert ok.status_code == 200


def _finished_job(http, location: str) -> dict:
    """A job's state once it succeeded or failed (polled for up to a minute)."""
    for _ in range(600):
        state = http.get(location).json()
        if state["status"] in ("succeeded", "failed"):
            break
        time.sleep(0.1)
    return state


def _v2_points(points: np.ndarray, parameters: dict) -> dict:
    """A /v2 request of one bag of ``points`` with ``parameters``."""
    tensor = {"name": "points", "datatype": "FP64", "shape": list(points.shape)}
    return {"inputs": [{**tensor, "data": points.ravel().tolist()}], "parameters": parameters}


def test_explanations_on_every_door_match_the_library(http, service, models):
    from bagserve.core.runtime import ModelRuntime

    from .service_harness import audit_log

    samples = [read_sample(f) for f in sorted(YEAST.glob("Yeast_B*.fcs"))[:2]]
    runtime = ModelRuntime.open(models / "yeast" / "1")
    expected = [e.to_dict(top=10) for e in runtime.explain(runtime.align(samples))]
    files = [
        ("files", (f.name, f.read_bytes(), "application/octet-stream"))
        for f in sorted(YEAST.glob("Yeast_B*.fcs"))[:2]
    ]
    r = http.post(
        "/v1/models/yeast/predict",
        params={"explain": "true", "plot": "50"},
        files=files,
        headers={"x-request-id": "explain-1"},
    )
    assert r.status_code == 200, r.text
    answers = r.json()["predictions"]
    assert [a["explanation"] for a in answers] == expected
    for a in answers:  # the numbers add up: baseline + cells = the prediction
        e = a["explanation"]
        assert e["prediction"] == [a["prediction"]]
        assert abs(e["baseline"][0] + e["total"][0] - a["prediction"]) < 1e-9
        assert len(a["plot"]["contributions"]) == len(a["plot"]["points"]) == 50
    # The audit trail keeps the explanations' hash, not their cells.
    port = int(service.rsplit(":", 1)[1])
    log = audit_log(models.parent / f"data-{port}")
    record = next(x for x in log.recent(20) if x["request_id"] == "explain-1")
    assert len(record["output"]["explanations_sha256"]) == 64
    assert "top_cells" not in json.dumps(record)
    # FHIR and HL7: one line of text each, no cell data.
    fhir = http.post(
        "/v1/models/yeast/predict",
        params={"explain": "true"},
        files=files,
        headers={"accept": "application/fhir+json"},
    )
    notes = [
        n["text"]
        for e in fhir.json()["entry"]
        for n in e["resource"].get("note", [])
        if n["text"].startswith("Why this prediction")
    ]
    assert len(notes) == 2 and "top_cells" not in fhir.text
    hl7 = http.post(
        "/v1/models/yeast/predict",
        params={"explain": "true"},
        files=files,
        headers={"accept": "application/hl7-v2"},
    )
    assert hl7.status_code == 200 and hl7.text.count("Why this prediction") == 2
    # Jobs store the same document; /v2 takes it as a parameter.
    job = http.post("/v1/jobs", params={"model": "yeast", "explain": "true"}, files=files)
    assert job.status_code == 202, job.text
    state = _finished_job(http, job.headers["location"])
    assert [p["explanation"] for p in state["result"]["predictions"]] == expected
    points = runtime.align(samples[:1]).points
    v2 = http.post(
        "/v2/models/yeast/infer",
        json=_v2_points(points, {"explain": True, "markers": ["FSC-A", "SSC-A", "GFP"]}),
    )
    assert v2.status_code == 200, v2.text
    assert v2.json()["parameters"]["explanations"] == expected[:1]


def test_per_cell_model_explains_its_shares_on_every_door(http, models):
    """A per-cell model's explanation is the library's (``model.explain``), its
    prediction the shares the answer counts; JSON, jobs, /v2, FHIR, HL7 and FCS carry
    it; asked with ``unassigned`` (which relabels after it) it is refused, saying why."""
    import flowio

    tasks, _, markers = demo_samples("gating", 2, 6)
    model = load(models / "demo-gating" / "1")
    expected = [model.explain(tasks[i], markers=markers).to_dict(top=10) for i in range(2)]
    body = {
        "bags": [
            {"id": f"p{i}", "markers": markers, "points": np.asarray(tasks[i]).tolist()}
            for i in range(2)
        ]
    }
    r = http.post(
        "/v1/models/demo-gating/predict", params={"explain": "true", "plot": "40"}, json=body
    )
    assert r.status_code == 200, r.text
    answers = r.json()["predictions"]
    assert [a["explanation"] for a in answers] == expected
    for a in answers:
        plot = a["plot"]  # the plotted cells with their labels and contributions
        assert len(plot["labels"]) == len(plot["contributions"]) == 40
        assert plot["labels"] == [a["labels"][i] for i in plot["cells"]]
        e = a["explanation"]
        shares = {row["class"]: row["count"] / len(a["labels"]) for row in a["population"]}
        assert e["method"] == "assignment" and e["baseline"] == [0.0] * len(e["outputs"])
        assert e["prediction"] == pytest.approx([shares.get(c, 0.0) for c in e["outputs"]])
        assert e["total"] == pytest.approx(e["prediction"], abs=1e-12)
    job = http.post("/v1/jobs", params={"model": "demo-gating", "explain": "true"}, json=body)
    assert job.status_code == 202, job.text
    state = _finished_job(http, job.headers["location"])
    assert [p["explanation"] for p in state["result"]["predictions"]] == expected
    points = np.asarray(tasks[0])
    v2 = http.post(
        "/v2/models/demo-gating/infer",
        json=_v2_points(points, {"explain": True, "markers": markers}),
    )
    assert v2.status_code == 200, v2.text
    assert v2.json()["parameters"]["explanations"] == expected[:1]
    for accept in ("application/fhir+json", "application/hl7-v2"):
        text = http.post(
            "/v1/models/demo-gating/predict",
            params={"explain": "true"},
            json=body,
            headers={"accept": accept},
        )
        assert text.status_code == 200, text.text
        assert text.text.count("Why this prediction (assignment") == 2
        assert "top_cells" not in text.text
    fcs = http.post(
        "/v1/models/demo-gating/predict",
        params={"explain": "true"},
        json={"bags": body["bags"][:1]},
        headers={"accept": "application/vnd.isac.fcs"},
    )
    assert fcs.status_code == 200, fcs.text
    back = flowio.FlowData(io.BytesIO(fcs.content))
    assert back.pnn_labels[-1] == "contribution"
    explained = model.explain(tasks[0], markers=markers)
    np.testing.assert_array_equal(
        back.as_array(preprocess=False)[:, -1], explained.contributions[:, -1].astype(np.float32)
    )
    both = http.post(
        "/v1/models/demo-gating/predict",
        params={"explain": "true", "unassigned": "0.999"},
        json=body,
    )
    assert both.status_code == 422 and "explanation or unassigned cells, not both" in both.text


def test_explained_sample_comes_back_as_fcs_with_a_contribution_channel(http):
    import flowio

    path = sorted(YEAST.glob("Yeast_B*.fcs"))[0]
    raw = read_sample(path)
    fcs = http.post(
        "/v1/models/yeast/predict",
        params={"explain": "true"},
        content=path.read_bytes(),
        headers={"content-type": "application/vnd.isac.fcs", "accept": "application/vnd.isac.fcs"},
    )
    assert fcs.status_code == 200, fcs.text
    assert fcs.headers["content-type"] == "application/vnd.isac.fcs"
    assert fcs.headers["x-model-sha256"] and fcs.headers["x-input-sha256"]
    back = flowio.FlowData(io.BytesIO(fcs.content))
    assert back.pnn_labels[-1] == "contribution"
    cells = back.as_array(preprocess=False)
    assert cells.shape == (raw.points.shape[0], raw.points.shape[1] + 1)
    # The cells as sent, every channel in its order, then the contributions.
    np.testing.assert_array_equal(cells[:, :-1], raw.points.astype(np.float32))
    # The JSON answer's explanation of the same sample: every cell is plotted (1000).
    doc = http.post(
        "/v1/models/yeast/predict",
        params={"explain": "true", "plot": str(raw.points.shape[0])},
        content=path.read_bytes(),
        headers={"content-type": "application/vnd.isac.fcs"},
    )
    assert doc.status_code == 200, doc.text
    answer = doc.json()["predictions"][0]
    assert answer["plot"]["cells"] == list(range(raw.points.shape[0]))
    expected = np.asarray(answer["plot"]["contributions"], dtype=np.float32)
    np.testing.assert_array_equal(cells[:, -1], expected)
    for top in answer["explanation"]["top_cells"]:
        assert cells[top["index"], -1] == np.float32(top["contribution"])
    # Refused, naming the problem: without explain, several bags.
    asked = {"accept": "application/vnd.isac.fcs"}
    plain = http.post(
        "/v1/models/yeast/predict",
        content=path.read_bytes(),
        headers={**asked, "content-type": "application/vnd.isac.fcs"},
    )
    assert plain.status_code == 406 and "explain=true" in plain.text
    files = [
        ("files", (f.name, f.read_bytes(), "application/octet-stream"))
        for f in sorted(YEAST.glob("Yeast_B*.fcs"))[:2]
    ]
    several = http.post(
        "/v1/models/yeast/predict", params={"explain": "true"}, files=files, headers=asked
    )
    assert several.status_code == 422 and "one bag per request" in several.text
