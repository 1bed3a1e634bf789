"""FHIR R4 answers: every one valid against the official FHIR R4 JSON schema, and equal
in content to the native JSON answer to the same request.

The service runs under uvicorn on 127.0.0.1; the models are the demo models and two
trained here from configurations with ``[fhir]`` tables (a regressor with a unit and a
reference range, a classifier with class codings).
"""

from __future__ import annotations

import copy
import csv
import gzip
import hashlib
import io
import json
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import jsonschema
import numpy as np
import pytest
from bagserve.core import read_manifest
from bagserve.core.artifact_info import ArtifactInfo
from bagserve.core.demo import build_demo_models
from bagserve.core.errors import ConfigError
from bagserve.core.fhir_coding import OutputCoding
from bagserve.core.io import read_sample
from bagserve.core.training import GridEdgeWarning, train

from bagserve.cli.local import predict_files

from .conftest import SHARED_DATA
from .service_harness import running_service
from .test_cli import example

ROOT = Path(__file__).resolve().parents[1]
FHIR = "application/fhir+json"
YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"
#: The issue's foreign sample: mouse bone marrow (FlowSOM's example) for the yeast model.
MOUSE = SHARED_DATA / "flowsom_example" / "not_preprocessed.fcs"
DOSE_BAG = json.loads((ROOT / "examples" / "requests" / "dose_bag.json").read_text())
GATING_CSV = (ROOT / "examples" / "requests" / "gating_sample.csv").read_bytes()
INTERPRETATION = "http://terminology.hl7.org/CodeSystem/v3-ObservationInterpretation"
#: The lab's own code system in the configurations below (never fetched).
LAB = "http://lab.example.org/fhir/CodeSystem/assays"
SNOMED = "http://snomed.info/sct"
PERFORMER = "Organization/lab-1"
DOSE_FHIR = {
    "system": LAB,
    "code": "yeast-ip-dose",
    "display": "Inducer (IP) dose, log10",
    "unit": "[lg]",
    "unit_display": "log10",
    "reference_range": [-1.0, 0.4],
}
LEVEL_CLASSES = {
    "high": {"system": SNOMED, "code": "75540009", "display": "High"},
    "low": {"system": SNOMED, "code": "62482003", "display": "Low"},
}


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft6Validator:
    schema = json.loads(
        gzip.decompress((ROOT / "tests" / "fhir" / "fhir.schema.json.gz").read_bytes())
    )
    assert schema["id"] == "http://hl7.org/fhir/json-schema/4.0"
    jsonschema.Draft6Validator.check_schema(schema)
    return jsonschema.Draft6Validator(schema)


def assert_valid(validator: jsonschema.Draft6Validator, doc: dict[str, Any]) -> None:
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, [f"{list(e.absolute_path)}: {e.message[:200]}" for e in errors[:5]]


def train_coded_dose(tmp: Path, directory: Path, name: str = "coded-dose", **tables) -> Path:
    """The yeast example coded by DOSE_FHIR (one representation, the estimator's own
    search), trained into ``directory/name/1``; ``tables`` override the configuration."""
    (tmp / name).mkdir()
    cfg = example(
        "yeast_dose",
        tmp / name,
        model={"name": name, "output": str(directory)},
        search={"representation__p": [2]},
        fhir=DOSE_FHIR,
        **tables,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GridEdgeWarning)  # reported in test_training_honesty
        return train(cfg, progress=False).path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fhir")
    directory = tmp / "models"
    build_demo_models(directory)
    train_coded_dose(tmp, directory)
    # The same model under the policy that withholds out-of-domain answers.
    train_coded_dose(tmp, directory, "withheld-dose", serving={"out_of_domain": "withhold"})
    # A bag classifier from the same files: the upper half of the doses is "high".
    rows = (ROOT / "examples" / "yeast_dose" / "doses.csv").read_text().splitlines()[1:]
    doses = {r.split(",")[0]: float(r.split(",")[2]) for r in rows}
    median = sorted(doses.values())[len(doses) // 2]
    (tmp / "level").mkdir()
    labels = tmp / "levels.csv"
    labels.write_text(
        "file,level\n"
        + "".join(f"{f},{'high' if d >= median else 'low'}\n" for f, d in doses.items())
    )
    cfg = example(
        "yeast_dose",
        tmp / "level",
        model={"name": "coded-level", "output": str(directory)},
        data={"labels": str(labels), "label_column": "level"},
        estimator={"class": "DistributionRidgeClassifier"},
        search={"representation__p": [2]},
        fhir={
            "system": LAB,
            "code": "yeast-ip-level",
            "display": "Inducer level",
            "classes": LEVEL_CLASSES,
        },
    )
    train(cfg, progress=False)
    return directory


@pytest.fixture(scope="module")
def url(models) -> Iterator[str]:
    # The lab's own settings: who performs the test, the instruments' time zone.
    with running_service(
        models,
        BAGSERVE_FHIR_PERFORMER=PERFORMER,
        BAGSERVE_FHIR_TIMEZONE="Europe/Berlin",
    ) as u:
        yield u


@pytest.fixture
def http(url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def both(
    http: httpx.Client,
    path: str,
    body: bytes,
    params: dict[str, str] | None = None,
    ctype: str = "application/json",
) -> tuple[httpx.Response, httpx.Response]:
    """The same request answered as FHIR and as bagserve's own JSON."""
    answers = []
    for accept in (FHIR, "application/json"):
        r = http.post(
            path, content=body, params=params, headers={"accept": accept, "content-type": ctype}
        )
        assert r.status_code == 200, r.text
        answers.append(r)
    return answers[0], answers[1]


def observations(bundle: dict[str, Any]) -> list[dict[str, Any]]:
    """The Observations of a transaction Bundle, after checking what a FHIR server
    needs to file it: unique urn:uuid entries, each with its request, every reference
    between them resolvable in the Bundle."""
    assert bundle["resourceType"] == "Bundle" and bundle["type"] == "transaction"
    urls = [e["fullUrl"] for e in bundle["entry"]]
    assert len(set(urls)) == len(urls) and all(u.startswith("urn:uuid:") for u in urls)
    for e in bundle["entry"]:
        kind, request = e["resource"]["resourceType"], e["request"]
        if kind == "Provenance":
            assert request == {"method": "PUT", "url": f"Provenance/{e['resource']['id']}"}
        else:
            assert request["method"] == "POST" and request["url"] == kind
            # The search finds the resource by its identifier, and only it.
            (token,) = identifier_search(request["ifNoneExist"])
            assert matches(e["resource"]["identifier"], token)
    inside = json.dumps([e["resource"] for e in bundle["entry"]])
    for ref in re.findall(r'"reference": "(urn:uuid:[^"]+)"', inside):
        assert ref in urls
    return [
        e["resource"] for e in bundle["entry"] if e["resource"]["resourceType"] == "Observation"
    ]


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, current, i = [], "", 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            current += text[i : i + 2]
            i += 2
        elif text[i] == sep:
            parts.append(current)
            current, i = "", i + 1
        else:
            current, i = current + text[i], i + 1
    return [*parts, current]


def identifier_search(query: str) -> list[tuple[str | None, str]]:
    """``identifier=...`` read as a FHIR server reads a token search: URL-decoded, OR-ed
    values at unescaped commas, ``system|value`` at the first unescaped bar, then the
    escapes (``\\,`` ``\\|`` ``\\$`` ``\\\\``) removed. The oracle of conditional creates."""
    name, _, text = query.partition("=")
    assert name == "identifier"
    tokens: list[tuple[str | None, str]] = []
    for value in _split_unescaped(unquote(text), ","):
        parts = [re.sub(r"\\(.)", r"\1", p) for p in _split_unescaped(value, "|")]
        tokens.append((None, parts[0]) if len(parts) == 1 else (parts[0], "|".join(parts[1:])))
    return tokens


def matches(identifiers: list[dict[str, str]], token: tuple[str | None, str]) -> bool:
    system, value = token
    return any(i["value"] == value and system in (None, i["system"]) for i in identifiers)


def resource(bundle: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e["resource"] for e in bundle["entry"] if e["resource"]["resourceType"] == kind]


def by_url(bundle: dict[str, Any], url: str) -> dict[str, Any]:
    (found,) = [e["resource"] for e in bundle["entry"] if e["fullUrl"] == url]
    return found


def contained(obs: dict[str, Any], reference: str) -> dict[str, Any]:
    """The contained resource a local reference (``#id``) points at."""
    assert reference.startswith("#")
    (found,) = [r for r in obs["contained"] if r["id"] == reference[1:]]
    return found


def check_provenance(
    obs: dict[str, Any],
    fhir: httpx.Response,
    body: bytes,
    bag: str,
    digest: str | None = None,
) -> None:
    """device: the model (name, version, sha256); derivedFrom: the bag's own sha256
    (``digest``: of its cells, for cells sent as numbers; else of the body, its file),
    with the request body's sha256 beside it; the Provenance names both."""
    bundle = fhir.json()
    device = by_url(bundle, obs["device"]["reference"])
    assert device["resourceType"] == "Device"
    assert device["deviceName"][0]["name"] == fhir.headers["x-model-name"]
    assert device["version"][0]["value"] == fhir.headers["x-model-version"]
    assert device["identifier"][0]["value"] == fhir.headers["x-model-sha256"]
    (source,) = obs["derivedFrom"]
    document = contained(obs, source["reference"])
    assert document["resourceType"] == "DocumentReference"
    # The oracle: hashlib on the bytes sent (on the cells' float64 bytes for JSON bags).
    request = hashlib.sha256(body).hexdigest()
    assert document["masterIdentifier"]["value"] == (digest or request)
    assert document["identifier"] == [{"system": "urn:bagserve:request-sha256", "value": request}]
    assert document["content"][0]["attachment"]["title"] == bag
    # Every contained resource is referred to (FHIR invariant dom-3).
    refs = {d["reference"] for d in obs["derivedFrom"]}
    assert refs == {f"#{r['id']}" for r in obs["contained"]}
    (prov,) = resource(bundle, "Provenance")
    assert prov["agent"][0]["who"]["reference"] == obs["device"]["reference"]
    assert {
        "identifier": {
            "system": "urn:bagserve:sha256",
            "value": document["masterIdentifier"]["value"],
        },
        "display": f"sample {bag}",
    } in [e["what"] for e in prov["entity"]]
    (report,) = resource(bundle, "DiagnosticReport")
    urls = {e["fullUrl"] for e in bundle["entry"] if e["resource"] is obs} or {
        e["fullUrl"] for e in bundle["entry"] if e["resource"] == obs
    }
    assert urls and urls <= {r["reference"] for r in report["result"]}
    assert urls <= {t["reference"] for t in prov["target"]}
    request_id = fhir.headers["x-request-id"]
    assert obs["identifier"][0]["value"] == f"{request_id}/{bag}"


def flags(obs: dict[str, Any]) -> set[str]:
    out = set()
    for concept in obs.get("interpretation", []):
        for coding in concept["coding"]:
            assert coding["system"] == INTERPRETATION
            out.add(coding["code"])
    return out


def component(obs: dict[str, Any], code: str) -> dict[str, Any]:
    (found,) = [c for c in obs["component"] if c["code"]["coding"][0]["code"] == code]
    return found


def test_regression_with_interval_and_domain(http, validator):
    """demo-dose: value, 90% interval as a component, EX outside the domain."""
    far = copy.deepcopy(DOSE_BAG["bags"][0])
    far["id"] = "far-away"
    far["points"] = [[40 * v for v in p] for p in far["points"]]
    body = json.dumps({"bags": [DOSE_BAG["bags"][0], far]}).encode()
    params = {"interval": "0.9", "subject": "Patient/p-17", "specimen": "Specimen/s-3"}
    fhir, native = both(http, "/v1/models/demo-dose/predict", body, params)
    assert fhir.headers["content-type"] == "application/fhir+json; fhirVersion=4.0"
    bundle = fhir.json()
    assert_valid(validator, bundle)
    assert bundle["identifier"]["value"] == fhir.headers["x-request-id"]
    expected = native.json()["predictions"]
    obs = observations(bundle)
    assert len(obs) == 2
    out_of_domain = []
    sent = json.loads(body)["bags"]
    for o, e, bag in zip(obs, expected, sent, strict=True):
        cells = np.asarray(bag["points"], dtype=np.float64)
        check_provenance(o, fhir, body, e["id"], hashlib.sha256(cells.tobytes()).hexdigest())
        # The demo models keep the default out-of-domain policy: preliminary.
        outside = e["domain"]["out_of_range"]
        assert (
            o["status"]
            == ("preliminary" if outside else "final")
            == (e["status"] if outside else "final")
        )
        assert o["code"]["coding"] == [
            {
                "system": "urn:bagserve:model",
                "code": "demo-dose",
                "display": "Inducer dose (log10 units) from a sample's reporter distribution.",
            }
        ]
        assert o["subject"] == {"reference": "Patient/p-17"}
        assert o["specimen"] == {"reference": "Specimen/s-3"}
        assert o["valueQuantity"]["value"] == pytest.approx(e["prediction"], rel=1e-12)
        interval = component(o, "prediction-interval")
        assert interval["code"]["text"] == "90% prediction interval"
        low, high = interval["valueRange"]["low"]["value"], interval["valueRange"]["high"]["value"]
        assert [low, high] == pytest.approx(e["interval"], rel=1e-12)
        # The interval is not a clinical normal range.
        assert "referenceRange" not in o
        assert ("EX" in flags(o)) == e["domain"]["out_of_range"]
        out_of_domain.append(e["domain"]["out_of_range"])
        for name in e["domain"]["nearest"]:
            assert name in o["note"][0]["text"]
    # The far bag is outside the domain and the demo bag inside it.
    assert out_of_domain == [False, True]


def test_per_cell_population_as_ratios(http, validator):
    """demo-gating: one component per class, its cells over the bag's cells."""
    fhir, native = both(
        http, "/v1/models/demo-gating/predict", GATING_CSV, {"id": "tube-1"}, "text/csv"
    )
    bundle = fhir.json()
    assert_valid(validator, bundle)
    (o,) = observations(bundle)
    (expected,) = native.json()["predictions"]
    check_provenance(o, fhir, GATING_CSV, "tube-1")
    assert "valueQuantity" not in o and "valueCodeableConcept" not in o
    population = expected["population"]
    assert len(o["component"]) == len(population)
    for c, row in zip(o["component"], population, strict=True):
        assert c["code"]["coding"][0] == {
            "system": "urn:bagserve:model:demo-gating:class",
            "code": str(row["class"]),
            "display": str(row["class"]),
        }
        ratio = c["valueRatio"]
        assert ratio["numerator"]["value"] == row["count"]
        assert ratio["denominator"]["value"] == expected["n_points"]
        assert ratio["numerator"]["code"] == ratio["denominator"]["code"] == "{cells}"
        assert 100 * ratio["numerator"]["value"] / ratio["denominator"]["value"] == pytest.approx(
            row["percent"], rel=1e-12
        )
    assert (
        sum(c["valueRatio"]["numerator"]["value"] for c in o["component"]) == expected["n_points"]
    )
    assert ("EX" in flags(o)) == expected["report"]["out_of_range"]


def test_configured_code_unit_and_reference_range(http, models, validator):
    """coded-dose: the [fhir] table's code and UCUM unit; H/L/N against its range."""
    meta = read_manifest(models / "coded-dose" / "1")["metadata"]
    assert meta["fhir"] == {**DOSE_FHIR, "category": "laboratory"}
    card = (models / "coded-dose" / "1" / "card.md").read_text()
    assert (
        f"- Reported as: `{LAB}` code `yeast-ip-dose` (Inducer (IP) dose, log10), unit `[lg]`"
        in card
    )
    names = ["Yeast_B1_B01.fcs", "Yeast_B8_B08.fcs", "Yeast_C9_C09.fcs"]
    files = [("files", (n, (YEAST / n).read_bytes(), "application/vnd.isac.fcs")) for n in names]
    fhir = http.post("/v1/models/coded-dose/predict", files=files, headers={"accept": FHIR})
    native = http.post("/v1/models/coded-dose/predict", files=files)
    assert fhir.status_code == native.status_code == 200, fhir.text
    bundle = fhir.json()
    assert_valid(validator, bundle)
    low, high = DOSE_FHIR["reference_range"]
    seen = []
    for o, e in zip(observations(bundle), native.json()["predictions"], strict=True):
        assert o["code"]["coding"] == [
            {"system": LAB, "code": "yeast-ip-dose", "display": "Inducer (IP) dose, log10"}
        ]
        q = o["valueQuantity"]
        assert q == {
            "value": pytest.approx(e["prediction"], rel=1e-12),
            "unit": "log10",
            "system": "http://unitsofmeasure.org",
            "code": "[lg]",
        }
        (rng,) = o["referenceRange"]
        assert (rng["low"]["value"], rng["high"]["value"]) == (low, high)
        assert rng["low"]["code"] == "[lg]"
        want = "L" if q["value"] < low else "H" if q["value"] > high else "N"
        assert flags(o) - {"EX"} == {want}
        seen.append(want)
    # The highest dose, a middle one and the lowest: one of each.
    assert seen == ["H", "N", "L"]


def _yeast_and_mouse() -> list[tuple[str, tuple[str, bytes, str]]]:
    return [
        ("files", (name, path.read_bytes(), "application/vnd.isac.fcs"))
        for name, path in (("Yeast_B8_B08.fcs", YEAST / "Yeast_B8_B08.fcs"), ("mouse.fcs", MOUSE))
    ]


def test_a_foreign_sample_is_never_normal_nor_final(http, validator):
    """The mouse sample through the yeast model with a reference range: preliminary
    (the default policy), EX alone (no N/H/L beside it), a wider interval than in
    domain; the ignored channels are a note of the answer, not of the Observation."""
    files = _yeast_and_mouse()
    params = {"interval": "0.9"}
    path = "/v1/models/coded-dose/predict"
    fhir = http.post(path, files=files, params=params, headers={"accept": FHIR})
    native = http.post(path, files=files, params=params)
    assert fhir.status_code == native.status_code == 200, fhir.text
    bundle = fhir.json()
    assert_valid(validator, bundle)
    yeast, mouse = observations(bundle)
    answer = native.json()
    e_yeast, e_mouse = answer["predictions"]
    assert (yeast["status"], flags(yeast)) == ("final", {"N"})
    assert e_mouse["domain"]["out_of_range"] and e_mouse["domain"]["score"] > 5
    assert (mouse["status"], flags(mouse)) == ("preliminary", {"EX"})
    # The report says so in a code, not only in words.
    (report,) = resource(bundle, "DiagnosticReport")
    (code,) = report["conclusionCode"]
    assert code["coding"][0]["system"] == INTERPRETATION and code["coding"][0]["code"] == "EX"
    assert "mouse.fcs" in code["text"] and "Yeast_B8_B08.fcs" not in code["text"]
    assert e_mouse["status"] == "preliminary" and e_yeast["status"] == "final"
    assert mouse["valueQuantity"]["value"] == pytest.approx(e_mouse["prediction"], rel=1e-12)

    def width(e: dict[str, Any]) -> float:
        return e["interval"][1] - e["interval"][0]

    # The interval widens with the domain score (its residuals are scaled by the score
    # beyond 1; the exact form is tested against an oracle in test_conformal).
    assert e_mouse["domain"]["score"] > 5 * max(1.0, e_yeast["domain"]["score"])
    assert width(e_mouse) > 3 * width(e_yeast)
    # Provenance: each file's own sha256 and name; training samples by name, not path.
    for e, (_, (name, data, _)) in zip(answer["predictions"], files, strict=True):
        assert e["id"] == name and e["input_sha256"] == hashlib.sha256(data).hexdigest()
        assert e["domain"]["nearest"] and all("/" not in n for n in e["domain"]["nearest"])
    # Routine facts are notes of the answer, never warnings nor FHIR notes.
    assert any("channels the model does not use" in n for n in answer["notes"])
    assert not any("channels" in w for w in answer["warnings"])
    assert [w for w in answer["warnings"] if "mouse.fcs" in w]
    for o in (yeast, mouse):
        assert not any("channels" in n["text"] for n in o.get("note", []))
    # Each Observation speaks of its own sample only: the yeast result carries no note
    # about the mouse sample sent beside it.
    assert [n["text"] for n in yeast["note"]] == [
        "Within the model's applicability domain (score "
        f"{e_yeast['domain']['score']:.4g}); nearest training samples: "
        f"{', '.join(e_yeast['domain']['nearest'])}."
    ]
    assert len(mouse["note"]) == 1
    assert mouse["note"][0]["text"].startswith("Outside the model's applicability domain")


def test_withhold_policy_gives_no_value_on_any_door(http, validator, url, models):
    """withheld-dose: the mouse sample's value, interval and normal-range verdict are
    withheld with the reason on JSON, CSV, /v2, FHIR, jobs and the command line."""
    files = _yeast_and_mouse()
    path = "/v1/models/withheld-dose/predict"
    params = {"interval": "0.9"}
    fhir = http.post(path, files=files, params=params, headers={"accept": FHIR})
    assert fhir.status_code == 200, fhir.text
    bundle = fhir.json()
    assert_valid(validator, bundle)
    yeast, mouse = observations(bundle)
    assert yeast["status"] == "final" and "valueQuantity" in yeast
    assert mouse["status"] == "cancelled" and "valueQuantity" not in mouse
    assert "component" not in mouse and "referenceRange" not in mouse
    assert flags(mouse) == {"EX"}
    reason = mouse["dataAbsentReason"]
    assert reason["coding"][0]["code"] == "unsupported"
    assert "withheld" in reason["text"] and "domain score" in reason["text"]

    native = http.post(path, files=files, params=params).json()
    e_yeast, e_mouse = native["predictions"]
    assert e_yeast["status"] == "final" and isinstance(e_yeast["prediction"], float)
    assert e_mouse["status"] == "withheld" and e_mouse["prediction"] is None
    assert "interval" not in e_mouse and e_mouse["withheld"] == reason["text"]

    table = http.post(path, files=files, params=params, headers={"accept": "text/csv"})
    rows = list(csv.DictReader(io.StringIO(table.text)))
    assert [r["status"] for r in rows] == ["final", "withheld"]
    assert rows[1]["prediction"] == rows[1]["interval_lo"] == "" and rows[0]["prediction"]
    assert rows[1]["out_of_range"] == "1" and rows[1]["withheld_reason"] == reason["text"]
    assert rows[0]["withheld_reason"] == "" and rows[0]["interval_lo"]

    npy = http.post(path, files=files, headers={"accept": "application/x-npy"})
    values = np.load(io.BytesIO(npy.content))
    assert np.isfinite(values[0]) and np.isnan(values[1])

    panel = ArtifactInfo.read(models / "withheld-dose" / "1").panel
    cells = [panel.select(read_sample(p)) for p in (YEAST / "Yeast_B8_B08.fcs", MOUSE)]
    points = np.vstack(cells)
    v2 = http.post(
        "/v2/models/withheld-dose/infer",
        json={
            "inputs": [
                {
                    "name": "points",
                    "datatype": "FP64",
                    "shape": list(points.shape),
                    "data": points.ravel().tolist(),
                },
                {
                    "name": "bag_sizes",
                    "datatype": "INT64",
                    "shape": [2],
                    "data": [len(c) for c in cells],
                },
            ]
        },
    )
    assert v2.status_code == 200, v2.text
    out = {o["name"]: o for o in v2.json()["outputs"]}
    assert out["status"]["data"] == ["final", "withheld"]
    assert out["prediction"]["data"][1] is None or np.isnan(out["prediction"]["data"][1])

    job = http.post("/v1/jobs", params={"model": "withheld-dose"}, files=files)
    assert job.status_code == 202, job.text
    for _ in range(600):
        state = http.get(job.headers["location"]).json()
        if state["status"] in ("succeeded", "failed"):
            break
        time.sleep(0.1)
    assert state["status"] == "succeeded", state
    assert [p["status"] for p in state["result"]["predictions"]] == ["final", "withheld"]
    assert state["result"]["predictions"][1]["prediction"] is None

    local = predict_files(models / "withheld-dose" / "1", [YEAST / "Yeast_B8_B08.fcs", MOUSE])
    remote = subprocess.run(
        [
            sys.executable,
            "-m",
            "bagserve",
            "predict",
            "withheld-dose",
            str(YEAST / "Yeast_B8_B08.fcs"),
            str(MOUSE),
            "--url",
            url,
            "--format",
            "csv",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert remote.returncode == 0, remote.stderr
    rows = list(csv.DictReader(io.StringIO(remote.stdout)))
    assert (
        [r["status"] for r in rows]
        == ["final", "withheld"]
        == [r["status"] for r in local["results"]]
    )
    assert rows[1]["prediction"] == "" and "withheld" in rows[1]["withheld_reason"]
    assert rows[1]["input_sha256"] == hashlib.sha256(MOUSE.read_bytes()).hexdigest()
    assert "outside the model's applicability domain" in remote.stderr


def file_once(store: dict[str, list[dict[str, Any]]], bundle: dict[str, Any]) -> None:
    """What a FHIR server does with a transaction's requests (conditional create on
    the identifier, PUT by id), reduced to a dictionary: the oracle for retries."""
    for e in bundle["entry"]:
        r, request = e["resource"], e["request"]
        kept = store.setdefault(r["resourceType"], [])
        if request["method"] == "PUT":
            kept[:] = [k for k in kept if k["id"] != r["id"]] + [r]
            continue
        tokens = identifier_search(request["ifNoneExist"])
        if not any(matches(k["identifier"], t) for k in kept for t in tokens):
            kept.append(r)


def test_the_transaction_files_a_report_once_with_its_provenance(http, validator, models):
    """DiagnosticReport, Provenance, Device and effective times; a retried submission
    (the same answer replayed) files nothing twice."""
    files = _yeast_and_mouse()
    headers = {"accept": FHIR, "Idempotency-Key": "transaction-1"}
    path = "/v1/models/coded-dose/predict"
    # A retry sends the same bytes (one multipart body, one boundary) with the same key.
    built = http.build_request("POST", path, files=files)
    body, ctype = built.read(), built.headers["content-type"]
    headers["content-type"] = ctype
    first = http.post(path, content=body, headers=headers, params={"subject": "Patient/p-9"})
    again = http.post(path, content=body, headers=headers, params={"subject": "Patient/p-9"})
    assert first.status_code == again.status_code == 200, first.text
    bundle = first.json()
    assert_valid(validator, bundle)
    yeast, mouse = observations(bundle)
    (report,) = resource(bundle, "DiagnosticReport")
    (device,) = resource(bundle, "Device")
    assert report["status"] == "preliminary"  # one of its results is preliminary
    assert report["subject"] == {"reference": "Patient/p-9"}
    assert report["performer"] == yeast["performer"] == [{"reference": PERFORMER}]
    assert (
        "mouse.fcs: preliminary, outside the model's applicability domain" in report["conclusion"]
    )
    assert "Yeast_B8_B08.fcs: final" in report["conclusion"]
    # Acquired 02-DEC-2012 09:51:35 (its FCS $DATE, $BTIM) in the instruments' zone (CET).
    acquired = read_sample(YEAST / "Yeast_B8_B08.fcs").acquired
    assert acquired == "2012-12-02T09:51:35"
    assert yeast["effectiveDateTime"] == "2012-12-02T09:51:35+01:00"
    assert mouse["effectiveDateTime"] == "2013-07-02T00:29:01+02:00"  # CEST
    assert "effectiveDateTime" not in report  # the samples differ
    assert device["identifier"][0]["value"] == first.headers["x-model-sha256"]
    store: dict[str, list[dict[str, Any]]] = {}
    file_once(store, bundle)
    file_once(store, again.json())
    assert {k: len(v) for k, v in store.items()} == {
        "Device": 1,
        "Observation": 2,
        "DiagnosticReport": 1,
        "Provenance": 1,
    }
    # A new request is a new report; the model's Device is the one already filed.
    file_once(store, http.post(path, files=files, headers={"accept": FHIR}).json())
    assert [len(store[k]) for k in ("Device", "Observation", "DiagnosticReport")] == [1, 4, 2]
    # ?effective= overrides the files' times; a time without a zone is refused.
    given = http.post(
        path, files=files, headers={"accept": FHIR}, params={"effective": "2026-11-25"}
    ).json()
    assert {o["effectiveDateTime"] for o in observations(given)} == {"2026-11-25"}
    assert resource(given, "DiagnosticReport")[0]["effectiveDateTime"] == "2026-11-25"
    bad = http.post(
        path, files=files, headers={"accept": FHIR}, params={"effective": "2026-11-25T10:00"}
    )
    assert bad.status_code == 422 and "FHIR dateTime" in bad.json()["detail"]
    # The withhold policy: one value withheld, so the report is partial.
    withheld = http.post(
        "/v1/models/withheld-dose/predict", files=files, headers={"accept": FHIR}
    ).json()
    assert resource(withheld, "DiagnosticReport")[0]["status"] == "partial"
    assert "mouse.fcs: withheld" in resource(withheld, "DiagnosticReport")[0]["conclusion"]


def test_classifier_codes_its_classes(http, validator):
    """coded-level: the class codings of [fhir.classes]; the prediction set as a note."""
    names = ["Yeast_B1_B01.fcs", "Yeast_C9_C09.fcs"]
    files = [("files", (n, (YEAST / n).read_bytes(), "application/vnd.isac.fcs")) for n in names]
    params = {"interval": "0.8"}
    fhir = http.post(
        "/v1/models/coded-level/predict", files=files, params=params, headers={"accept": FHIR}
    )
    native = http.post("/v1/models/coded-level/predict", files=files, params=params)
    assert fhir.status_code == native.status_code == 200, fhir.text
    bundle = fhir.json()
    assert_valid(validator, bundle)
    labels = []
    for o, e in zip(observations(bundle), native.json()["predictions"], strict=True):
        concept = o["valueCodeableConcept"]
        assert concept["coding"] == [LEVEL_CLASSES[e["prediction"]]]
        assert concept["text"] == e["prediction"]
        members = ", ".join(e["set"]) or "empty"
        assert f"80% prediction set: {members}." in [n["text"] for n in o["note"]]
        if "probabilities" in e:
            for label, p in e["probabilities"].items():
                (c,) = [c for c in o["component"] if c["code"]["coding"][0] == LEVEL_CLASSES[label]]
                assert c["valueQuantity"]["value"] == pytest.approx(p, rel=1e-12)
        labels.append(e["prediction"])
    assert labels == ["high", "low"]


def test_references_checked_before_the_body_and_legacy_media_type(http):
    for params in (
        {"subject": "patient 17"},
        {"specimen": "Specimen/"},
        # Another resource type, another server, or nothing the bundle holds.
        {"subject": "Observation/1"},
        {"subject": "Group/1"},
        {"subject": "https://fhir.elsewhere.example/Patient/1"},
        {"subject": "http://127.0.0.1:1/Patient/1"},
        {"subject": "urn:uuid:0b8e6a7c-3f0e-4c1e-9a8b-2d7f1c5e4a90"},
        {"specimen": "Patient/1"},
        {"specimen": "https://fhir.elsewhere.example/Specimen/9"},
    ):
        r = http.post(
            "/v1/models/demo-dose/predict", json=DOSE_BAG, params=params, headers={"accept": FHIR}
        )
        assert r.status_code == 422, (params, r.text)
        name = next(iter(params))
        kind = {"subject": "Patient", "specimen": "Specimen"}[name]
        assert f"{name} must be a FHIR reference" in r.json()["detail"]
        assert kind in r.json()["detail"]
    # The problem says what is accepted.
    r = http.post(
        "/v1/models/demo-dose/predict",
        json=DOSE_BAG,
        params={"subject": "https://fhir.elsewhere.example/Patient/1"},
        headers={"accept": FHIR},
    )
    detail = r.json()["detail"]
    assert "Patient/<id>" in detail and "not another resource type, an absolute URL" in detail
    for params in ({"subject": "Patient/p-1"}, {"subject": "Patient/p-1/_history/2"},
                   {"specimen": "Specimen/9"}):  # fmt: skip
        r = http.post(
            "/v1/models/demo-dose/predict", json=DOSE_BAG, params=params, headers={"accept": FHIR}
        )
        assert r.status_code == 200, (params, r.text)
        (report,) = resource(r.json(), "DiagnosticReport")
        name, value = next(iter(params.items()))
        assert report[name] in ({"reference": value}, [{"reference": value}])
    # application/json+fhir (before FHIR R3) is answered as R4 JSON too.
    r = http.post(
        "/v1/models/demo-dose/predict", json=DOSE_BAG, headers={"accept": "application/json+fhir"}
    )
    assert r.status_code == 200 and r.json()["resourceType"] == "Bundle"
    # Without Accept FHIR, the FHIR parameters change nothing.
    r = http.post("/v1/models/demo-dose/predict", json=DOSE_BAG, params={"subject": "Patient/1"})
    assert r.status_code == 200 and "predictions" in r.json()


def test_conditional_creates_are_escaped_for_fhir_search(http, validator):
    """Bag ids with FHIR search's special characters: each Observation's conditional
    create finds its own identifier only. Unescaped, ``a,b`` would search ``.../a``
    OR ``b`` and, once ``.../a`` is filed, never be filed itself."""
    (bag,) = DOSE_BAG["bags"]
    ids = ["a", "a,b", "b", "x|y", "cost$1", "back\\slash", "p,q|r$s\\t"]
    body = {"bags": [{**bag, "id": i} for i in ids]}
    r = http.post("/v1/models/demo-dose/predict", json=body, headers={"accept": FHIR})
    assert r.status_code == 200, r.text
    bundle = r.json()
    assert_valid(validator, bundle)
    filed = observations(bundle)  # each entry's search finds its own identifier
    request_id = r.headers["x-request-id"]
    assert [o["identifier"][0]["value"] for o in filed] == [f"{request_id}/{i}" for i in ids]
    store: dict[str, list[dict[str, Any]]] = {}
    file_once(store, bundle)
    assert len(store["Observation"]) == len(ids)
    file_once(store, bundle)  # a retry files nothing twice
    assert len(store["Observation"]) == len(ids)


def test_idempotent_replay_is_the_same_bundle(http):
    headers = {"accept": FHIR, "Idempotency-Key": "fhir-replay-1"}
    first = http.post("/v1/models/demo-dose/predict", json=DOSE_BAG, headers=headers)
    again = http.post("/v1/models/demo-dose/predict", json=DOSE_BAG, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.content == first.content


def test_the_schema_check_can_fail(http, validator):
    """The validator refuses what FHIR refuses: the checks above are not vacuous."""
    r = http.post("/v1/models/demo-dose/predict", json=DOSE_BAG, headers={"accept": FHIR})
    bundle = r.json()
    assert_valid(validator, bundle)
    for breaks in (
        lambda o: o.pop("code"),
        lambda o: o["valueQuantity"].update(value="0.3"),
        lambda o: o.update(status="done"),
        lambda o: o.update(issued="23 Nov 2026"),
        lambda o: o["code"]["coding"][0].update(system="not a uri"),
        lambda o: o.update(valueWhatever=1),
    ):
        broken = copy.deepcopy(bundle)
        (obs,) = [e["resource"] for e in broken["entry"] if "valueQuantity" in e["resource"]]
        breaks(obs)
        assert not validator.is_valid(broken)


def test_output_coding_config_errors(tmp_path):
    good = {"system": LAB, "code": "x"}
    for spec, message in (
        ({**good, "sytem": LAB}, r"unknown key\(s\) \['sytem'\]"),
        ({"code": "x"}, "missing system"),
        ({**good, "system": "loinc"}, "absolute URI"),
        ({**good, "code": " x"}, "code must be"),
        ({**good, "category": "lab"}, "category must be one of"),
        ({**good, "reference_range": [2, 1]}, "low 2.0 is above high 1.0"),
        ({**good, "reference_range": ["", ""]}, "at least one end"),
        ({**good, "classes": {"a": {"code": "1"}}}, r"\[fhir.classes\] 'a': missing system"),
    ):
        with pytest.raises(ConfigError, match=message):
            OutputCoding.from_config(spec)
    with pytest.raises(ConfigError, match=r"\['medium'\] are not classes of the model"):
        OutputCoding.from_config({**good, "classes": {"medium": good}}, classes=["high", "low"])
    coding = OutputCoding.from_config({**good, "reference_range": ["", 5]})
    assert coding.reference_range == (None, 5.0)
    assert OutputCoding.from_json(coding.to_json(), "m") == coding
    # Checked before any fitting: a bad table fails at once.
    cfg = example("yeast_dose", tmp_path, fhir={"system": "loinc", "code": "1"})
    with pytest.raises(ConfigError, match="absolute URI"):
        train(cfg, progress=False)
