"""HL7 v2.5.1 ORU^R01 results and their delivery over MLLP.

The messages are built with hl7apy; every check here reads them with the other library,
python-hl7 (``hl7``), as a laboratory system's interface engine would, and compares
their values with the JSON answer of the same request. The MLLP peer
(:mod:`tests.mllp_peer`) is python-hl7's asyncio server answering real ACKs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hl7
import httpx
import numpy as np
import pytest
from bagserve.core import (
    Bags,
    DistributionRidge,
    DistributionRidgeClassifier,
    SlicedWasserstein,
    save,
)
from bagserve.core.datasets import make_gmm_modes
from bagserve.core.demo import build_demo_models, demo_samples
from bagserve.core.runtime import ModelRuntime
from bagserve.service.hl7 import MllpError, oru_r01, send

from .conftest import SHARED_DATA
from .mllp_peer import mllp_peer
from .service_harness import running_service
from .test_fhir import train_coded_dose

YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"
MOUSE = SHARED_DATA / "flowsom_example" / "not_preprocessed.fcs"
HL7 = "application/hl7-v2"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hl7")
    directory = tmp / "models"
    build_demo_models(directory)
    train_coded_dose(tmp, directory)
    return directory


@pytest.fixture(scope="module")
def peer_and_url(models) -> Iterator[tuple[Any, str]]:
    # One peer for the whole module; each test sets its script.
    with (
        mllp_peer() as peer,
        running_service(models, BAGSERVE_HL7_FORWARD=peer.url, BAGSERVE_HL7_BACKOFF="0.05") as url,
    ):
        yield peer, url


def files() -> list[tuple[str, tuple[str, bytes, str]]]:
    return [
        ("files", (name, path.read_bytes(), "application/vnd.isac.fcs"))
        for name, path in (("Yeast_B8_B08.fcs", YEAST / "Yeast_B8_B08.fcs"), ("mouse.fcs", MOUSE))
    ]


def segments(message: hl7.Message, name: str) -> list[Any]:
    return [s for s in message if str(s[0]) == name]


def test_the_oru_message_says_what_the_json_says(peer_and_url):
    _, url = peer_and_url
    params = {"interval": "0.9", "patient": "p-9", "order": "ord-4711"}
    path = f"{url}/v1/models/coded-dose/predict"
    r = httpx.post(path, files=files(), params=params, headers={"accept": HL7}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(HL7)
    answer = httpx.post(path, files=files(), params={"interval": "0.9"}, timeout=60).json()
    message = hl7.parse(r.text)
    msh = message.segment("MSH")
    assert str(msh[9]) == "ORU^R01^ORU_R01" and str(msh[12]) == "2.5.1"
    assert str(msh[10]) == r.headers["x-request-id"][:20]
    assert str(message.segment("PID")[3]) == "p-9"
    obrs, obxs = segments(message, "OBR"), segments(message, "OBX")
    assert len(obrs) == len(obxs) == 2
    for obr, obx, e in zip(obrs, obxs, answer["predictions"], strict=True):
        assert str(obr[2]) == "ord-4711" and str(obr[3]).endswith(f"/{e['id']}^bagserve")
        assert str(obx[2]) == "NM"
        assert float(str(obx[5])) == pytest.approx(e["prediction"], rel=1e-14)
        assert str(obx[6]) == "[lg]^log10^UCUM" and str(obx[7]) == "-1-0.4"
        status = {"final": "F", "preliminary": "P"}[e["status"]]
        assert str(obx[11]) == str(obr[25]) == status
        # Outside the domain, no verdict against the normal range.
        assert str(obx[8]) == ("" if e["domain"]["out_of_range"] else "N")
        assert answer["model"]["sha256"] in str(obx[18]) and "coded-dose/1" in str(obx[18])
        assert str(obx[17]).startswith("coded-dose^")
    assert [str(obx[11]) for obx in obxs] == ["F", "P"]
    # The notes, in a fixed order: interval, then domain (with the nearest samples).
    notes = [str(s[3]) for s in segments(message, "NTE")]
    (yeast, mouse) = answer["predictions"]
    lo, hi = yeast["interval"]
    assert notes[0] == f"90% prediction interval: {lo:.6g} to {hi:.6g}"
    assert notes[1].startswith("Within the model's applicability domain")
    assert notes[3].startswith("Outside the model's applicability domain")
    assert ", ".join(mouse["domain"]["nearest"]) in notes[3]
    # The acquisition time from the FCS keywords (02-DEC-2012 09:51:35).
    assert str(obrs[0][7]) == "20121202095135"


def test_per_cell_models_give_one_obx_per_population_count_and_percent(peer_and_url):
    _, url = peer_and_url
    tasks, _, markers = demo_samples("gating", 1, 5)
    rows = [",".join(markers), *(",".join(f"{v:.17g}" for v in p) for p in np.asarray(tasks[0]))]
    body = ("\n".join(rows) + "\n").encode()
    path = f"{url}/v1/models/demo-gating/predict"
    headers = {"content-type": "text/csv"}
    r = httpx.post(path, content=body, headers={**headers, "accept": HL7}, timeout=60)
    assert r.status_code == 200, r.text
    answer = httpx.post(path, content=body, headers=headers, params={"cells": "false"}).json()
    obxs = segments(hl7.parse(r.text), "OBX")
    population = answer["predictions"][0]["population"]
    assert len(obxs) == 2 * len(population)
    for k, row in enumerate(population):
        count, percent = obxs[2 * k], obxs[2 * k + 1]
        assert str(count[3]).split("^")[0] == str(row["class"]) == str(percent[3]).split("^")[0]
        assert (str(count[4]), str(percent[4])) == ("1", "2")
        assert int(str(count[5])) == row["count"]
        assert float(str(percent[5])) == pytest.approx(row["percent"], rel=1e-5)
        assert str(count[6]).startswith("{cells}") and str(percent[6]).startswith("%")


def _message(url: str) -> str:
    r = httpx.post(
        f"{url}/v1/models/coded-dose/predict", files=files(), headers={"accept": HL7}, timeout=60
    )
    assert r.status_code == 200
    return r.text


def test_send_retries_dropped_connections_and_ae_but_not_ar(peer_and_url):
    _, url = peer_and_url
    message = _message(url)
    with mllp_peer(["DROP", "AE"]) as peer:
        ack = send(message, peer.url, retries=3, backoff=0.01)
        assert (ack.code, ack.attempts) == ("AA", 3)
        assert peer.answers == ["DROP", "AE", "AA"]
        # The peer read the same, whole message every time.
        assert {str(m) for m in peer.received} == {str(hl7.parse(message))}
    with mllp_peer(["AR"]) as peer:
        with pytest.raises(MllpError, match="AR: the peer says AR") as info:
            send(message, peer.url, retries=3, backoff=0.01)
        assert info.value.code == "AR" and peer.answers == ["AR"]  # not retried
    with mllp_peer(["AE"] * 5) as peer:
        with pytest.raises(MllpError, match="AE") as info:
            send(message, peer.url, retries=2, backoff=0.01)
        assert len(peer.received) == 3
    with pytest.raises(ValueError, match="mllp://HOST:PORT"):
        send(message, "http://127.0.0.1:1")


def test_jobs_are_forwarded_and_the_outcome_audited(peer_and_url, models):
    peer, url = peer_and_url

    def job(script: list[str]) -> dict[str, Any]:
        peer.script[:] = script
        peer.received.clear()
        peer.answers.clear()
        r = httpx.post(f"{url}/v1/jobs", params={"model": "coded-dose"}, files=files())
        assert r.status_code == 202, r.text
        for _ in range(600):
            state = httpx.get(f"{url}{r.headers['location']}").json()
            if state["status"] in ("succeeded", "failed"):
                return state
            time.sleep(0.1)
        raise AssertionError("the job did not finish")

    state = job(["AE"])
    assert state["status"] == "succeeded"
    assert state["result"]["hl7"] == {
        "peer": peer.url,
        "delivered": True,
        "ack": "AA",
        "attempts": 2,
    }
    assert peer.answers == ["AE", "AA"]
    obx = segments(peer.received[-1], "OBX")
    values = [p["prediction"] for p in state["result"]["predictions"]]
    assert [float(str(o[5])) for o in obx] == pytest.approx(values, rel=1e-14)
    state = job(["AR"])
    record = state["result"]["hl7"]
    assert record["delivered"] is False and record["ack"] == "AR"
    assert "the peer says AR" in record["error"]
    audit = httpx.get(f"{url}/v1/audit", params={"limit": 50}).json()["entries"]
    forwarded = [e for e in audit if e.get("route") == "hl7-forward"]
    assert [e["hl7"]["ack"] for e in forwarded[:2]] == ["AR", "AA"]


def test_cli_predict_sends_the_answer_to_a_laboratory_system(peer_and_url, models):
    _, url = peer_and_url
    exe = [sys.executable, "-m", "bagserve", "predict"]
    paths = [str(YEAST / "Yeast_B8_B08.fcs"), str(MOUSE)]
    for where in (
        [str(models / "coded-dose" / "1")],  # a saved model
        ["coded-dose", "--url", url],  # a served one
    ):
        with mllp_peer() as peer:
            done = subprocess.run(
                [*exe, where[0], *paths, *where[1:], "--hl7", peer.url, "--patient", "p-1"],
                capture_output=True,
                text=True,
            )
            assert done.returncode == 0, done.stderr
            assert f"{peer.url} accepted the ORU^R01 message (AA)" in done.stderr
            (message,) = peer.received
            assert str(message.segment("PID")[3]) == "p-1"
            obx = segments(message, "OBX")
            assert [str(o[11]) for o in obx] == ["F", "P"]
    with mllp_peer(["AR"]) as peer:
        done = subprocess.run(
            [*exe, str(models / "coded-dose" / "1"), *paths, "--hl7", peer.url],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 1 and "was not accepted (AR" in done.stderr


def test_classifiers_answer_a_coded_cwe_value_and_withheld_values_are_absent(tmp_path):
    """A bag classifier's class is a CWE; under the withhold policy an out-of-domain
    bag's OBX carries status X, no value, and the reason in an NTE."""
    bags, y = make_gmm_modes(40, 60, max_components=2, dim=2, random_state=0)
    labels = np.where(y == 1, "one", "two")
    model = DistributionRidgeClassifier(
        SlicedWasserstein(n_directions=10, n_levels=10, random_state=0), random_state=0
    ).fit(bags, labels)
    path = save(model, tmp_path / "modes", name="modes", version="1",
                serving={"out_of_domain": "withhold"})  # fmt: skip
    runtime = ModelRuntime.open(path)
    far = [np.asarray(bags[0]), 50 + 30 * np.asarray(bags[1])]
    result = runtime.predict(Bags.from_arrays(far), coverage=0.9)
    assert result.status_of(0) == "final" and result.status_of(1) == "withheld"
    meta = {"model": {"name": "modes", "version": "1", "sha256": runtime.info.sha256},
            "request_id": "r" * 32}  # fmt: skip
    text = oru_r01(result, ["near", "far"], meta, runtime.info, coverage=0.9)
    message = hl7.parse(text)
    near, far_obx = segments(message, "OBX")
    label = str(result.labels[0])
    assert str(near[2]) == "CWE" and str(near[5]).split("^")[:2] == [label, label]
    assert str(near[11]) == "F"
    assert str(far_obx[11]) == "X" and str(far_obx[5]) == ""
    notes = [str(s[3]) for s in segments(message, "NTE")]
    members = ", ".join(str(c) for c in result.set_of(0)) or "empty"
    assert notes[0] == f"90% prediction set: {members}"
    assert notes[1].startswith("Within the model's applicability domain")
    assert notes[2].startswith("Outside the model's applicability domain")
    assert notes[3].startswith("withheld: the sample lies outside")  # no set for it
    assert len(notes) == 4


def test_several_outputs_give_one_obx_each(tmp_path):

    rng = np.random.default_rng(0)
    arrays = [rng.normal(loc=m, size=(50, 2)) for m in rng.normal(size=20)]
    y = np.array([[a.mean(), a.std()] for a in arrays])
    model = DistributionRidge(
        SlicedWasserstein(n_directions=10, n_levels=10, random_state=0), gamma=1.0, alpha=1e-3
    ).fit(Bags.from_arrays(arrays), y)
    runtime = ModelRuntime.open(save(model, tmp_path / "two", name="two", version="1"))
    result = runtime.predict(Bags.from_arrays(arrays[:2]))
    meta = {"model": {"name": "two", "version": "1", "sha256": runtime.info.sha256},
            "request_id": "q" * 32}  # fmt: skip
    message = hl7.parse(oru_r01(result, ["a", "b"], meta, runtime.info))
    obx = segments(message, "OBX")
    assert len(obx) == 4 and [str(o[4]) for o in obx] == ["1", "2", "1", "2"]
    got = np.array([float(str(o[5])) for o in obx]).reshape(2, 2)
    np.testing.assert_allclose(got, result.estimate, rtol=1e-14)
