"""HL7 v2.5.1 ORU^R01 results and their delivery over MLLP.

The messages are built with hl7apy; every check here reads them with the other library,
python-hl7 (``hl7``), as a laboratory system's interface engine would, and compares
their values with the JSON answer of the same request. The MLLP peer
(:mod:`tests.mllp_peer`) is python-hl7's asyncio server answering real ACKs. The
delivery queue of forwarded jobs is tested in :mod:`tests.test_hl7_delivery`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
from bagserve.core.fhir_coding import OutputCoding
from bagserve.core.policy import POLICIES
from bagserve.core.runtime import ModelRuntime
from bagserve.service.fhir import bundle
from bagserve.service.hl7 import new_control_id, oru_r01
from bagserve.service.mllp import MllpError, send
from bagserve.service.settings import Settings
from pydantic import ValidationError

from .conftest import SHARED_DATA
from .mllp_peer import mllp_peer
from .service_harness import running_service
from .test_fhir import DOSE_BAG, train_coded_dose

YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"
MOUSE = SHARED_DATA / "flowsom_example" / "not_preprocessed.fcs"
HL7 = "application/hl7-v2"
#: The parties of the module's service (MSH-3..6), as a lab would configure them.
PARTIES = {
    "BAGSERVE_HL7_SENDING_APPLICATION": "FLOWAI",
    "BAGSERVE_HL7_SENDING_FACILITY": "CYTOLAB^2.16.840.1.113883.3.72^ISO",
    "BAGSERVE_HL7_RECEIVING_APPLICATION": "LIS",
    "BAGSERVE_HL7_RECEIVING_FACILITY": "GENERAL-HOSPITAL",
}
INTERPRETATION = "http://terminology.hl7.org/CodeSystem/v3-ObservationInterpretation"


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
        running_service(
            models, BAGSERVE_HL7_FORWARD=peer.url, BAGSERVE_HL7_BACKOFF="0.05", **PARTIES
        ) as url,
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
    orders = ["ord-4711", "ord-4712"]
    params = {"interval": "0.9", "patient": "p-9", "order": orders}
    path = f"{url}/v1/models/coded-dose/predict"
    r = httpx.post(path, files=files(), params=params, headers={"accept": HL7}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(HL7)
    answer = httpx.post(path, files=files(), params={"interval": "0.9"}, timeout=60).json()
    message = hl7.parse(r.text)
    msh = message.segment("MSH")
    assert str(msh[9]) == "ORU^R01^ORU_R01" and str(msh[12]) == "2.5.1"
    # MSH-3..6 are the lab's settings; MSH-10 a fresh id, not the request id cut short.
    assert [str(msh[k]) for k in (3, 4, 5, 6)] == list(PARTIES.values())
    assert re.fullmatch(r"[A-Z2-7]{20}", str(msh[10]))
    assert str(msh[10]) != r.headers["x-request-id"][:20]
    assert str(message.segment("PID")[3]) == "p-9"
    orcs, obrs, obxs = segments(message, "ORC"), segments(message, "OBR"), segments(message, "OBX")
    assert len(orcs) == len(obrs) == len(obxs) == 2
    for orc, obr, obx, e, order in zip(
        orcs, obrs, obxs, answer["predictions"], orders, strict=True
    ):
        # One placer order per bag, the same in ORC-2 and OBR-2; the filler number too.
        assert str(orc[1]) == "RE" and str(orc[2]) == str(obr[2]) == order
        assert str(orc[3]) == str(obr[3]) and str(obr[3]).endswith(f"/{e['id']}^bagserve")
        assert str(obx[2]) == "NM"
        assert float(str(obx[5])) == pytest.approx(e["prediction"], rel=1e-14)
        # The configured range [-1, 0.4]: the limits apart, whatever their signs.
        assert str(obx[6]) == "[lg]^log10^UCUM" and str(obx[7]) == "-1 - 0.4"
        status = {"final": "F", "preliminary": "P"}[e["status"]]
        assert str(obx[11]) == str(obr[25]) == status
        # Outside the domain: abnormal (A), and no verdict against the normal range.
        assert str(obx[8]) == ("A" if e["domain"]["out_of_range"] else "N")
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


def test_placer_orders_are_one_per_bag(peer_and_url):
    """A placer order number names one order: two bags with one order, or one order
    twice, are refused (422, saying why); one per bag goes to each bag's ORC and OBR."""
    _, url = peer_and_url
    path = f"{url}/v1/models/coded-dose/predict"
    for orders, why in (
        (["ORD-77"], "1 placer order number(s) for 2 bag(s)"),
        (["ORD-77", "ORD-77"], "order 'ORD-77' is given twice"),
        (["ORD-77", "ORD-78", "ORD-79"], "3 placer order number(s) for 2 bag(s)"),
        (["ORD 77", "ORD-78"], "order must be 1 to 64 letters"),
    ):
        r = httpx.post(
            path, files=files(), params={"order": orders}, headers={"accept": HL7}, timeout=60
        )
        assert r.status_code == 422, (orders, r.text)
        assert why in r.json()["detail"]
    r = httpx.post(
        path, files=files(), params={"order": ["B-2", "A-1"]}, headers={"accept": HL7}, timeout=60
    )
    assert r.status_code == 200, r.text
    message = hl7.parse(r.text)
    assert [str(o[2]) for o in segments(message, "OBR")] == ["B-2", "A-1"]
    assert [str(o[2]) for o in segments(message, "ORC")] == ["B-2", "A-1"]
    # Without orders the OBRs name none (and the message is still built).
    r = httpx.post(path, files=files(), headers={"accept": HL7}, timeout=60)
    assert [str(o[2]) for o in segments(hl7.parse(r.text), "OBR")] == ["", ""]


def test_control_ids_are_unique_and_never_cut_from_the_request_id(peer_and_url):
    """Two requests whose ids share their first 20 characters get distinct MSH-10s;
    every id is 20 base32 characters."""
    _, url = peer_and_url
    path = f"{url}/v1/models/demo-dose/predict"
    seen = []
    for tail in ("1", "2"):
        headers = {"accept": HL7, "x-request-id": "lab-run-2026-11-27-sample-" + tail}
        r = httpx.post(path, json=DOSE_BAG, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        seen.append(str(hl7.parse(r.text).segment("MSH")[10]))
    assert seen[0] != seen[1]
    ids = {new_control_id() for _ in range(20_000)} | set(seen)
    assert len(ids) == 20_002
    assert all(re.fullmatch(r"[A-Z2-7]{20}", i) for i in ids)


def test_msh_parties_are_settings_checked_for_delimiters():
    for name in ("hl7_sending_application", "hl7_receiving_facility"):
        for bad in ("LA|B", "LAB^1.2^ISO^X", "a" * 21, "LAB\rMSH", "LA&B"):
            with pytest.raises(ValidationError, match=name):
                Settings(**{name: bad})
    ok = Settings(hl7_sending_facility="CYTOLAB^2.16.840.1.113883.3.72^ISO")
    assert ok.hl7_sending_application == "bagserve" and ok.hl7_receiving_application is None


def test_free_text_is_escaped_and_cannot_break_the_frame(peer_and_url):
    """Bag ids with HL7 delimiters, MLLP frame bytes and line breaks: escaped for ER7
    (python-hl7 reads them back), control characters gone, nothing split, and two ids
    that differ only in a delimiter stay apart."""
    _, url = peer_and_url
    points = DOSE_BAG["bags"][0]
    hostile = ["a|b", "a^b", "x&y~z\\w", "frame\x0b\x1cend", "two\rlines\nMSH|^~\\&|evil"]
    body = {"bags": [{**points, "id": bag} for bag in hostile]}
    r = httpx.post(
        f"{url}/v1/models/demo-dose/predict", json=body, headers={"accept": HL7}, timeout=60
    )
    assert r.status_code == 200, r.text
    raw = r.content
    assert b"\x0b" not in raw and b"\x1c" not in raw and b"\n" not in raw
    message = hl7.parse(r.text)
    # The segments bagserve wrote, no more: no text started a segment of its own.
    assert [str(seg[0]) for seg in message] == ["MSH"] + ["ORC", "OBR", "OBX", "NTE"] * 5
    fillers = [str(obr[3][0][0]) for obr in segments(message, "OBR")]
    read = [message.unescape(f).split("/", 1)[1] for f in fillers]
    assert read == ["a|b", "a^b", "x&y~z\\w", "frameend", "two lines MSH|^~\\&|evil"]
    assert len(set(read)) == len(hostile)


def test_class_labels_and_model_names_are_escaped(tmp_path):
    """A classifier whose class labels and model name hold delimiters and control
    characters: the CWE value (OBX-5) and the method (OBX-17) read back as written."""
    bags, y = make_gmm_modes(30, 40, max_components=2, dim=2, random_state=1)
    labels = np.where(y == 1, "one|1^\x1c", "two&2~\\")
    model = DistributionRidgeClassifier(
        SlicedWasserstein(n_directions=10, n_levels=10, random_state=0), random_state=0
    ).fit(bags, labels)
    runtime = ModelRuntime.open(save(model, tmp_path / "m", name="m|x", version="1"))
    result = runtime.predict(Bags.from_arrays([np.asarray(bags[i]) for i in range(4)]))
    meta = {"model": {"name": "m|x", "version": "1^2", "sha256": runtime.info.sha256},
            "request_id": "r" * 32}  # fmt: skip
    message = hl7.parse(oru_r01(result, ["a", "b", "c", "d"], meta, runtime.info))
    for obx, label in zip(segments(message, "OBX"), result.labels.tolist(), strict=True):
        value = obx[5][0]
        assert message.unescape(str(value[0])) == str(label).replace("\x1c", "")
        assert message.unescape(str(obx[17][0][0])) == "m|x"
        assert message.unescape(str(obx[17][0][1])) == "bagserve model m|x 1^2"


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


def test_cli_predict_sends_the_answer_to_a_laboratory_system(peer_and_url, models):
    _, url = peer_and_url
    exe = [sys.executable, "-m", "bagserve", "predict"]
    paths = [str(YEAST / "Yeast_B8_B08.fcs"), str(MOUSE)]
    # The command line's MSH-3..6 come from the same settings as the service's.
    env = {**os.environ, **PARTIES}
    for where in (
        [str(models / "coded-dose" / "1")],  # a saved model
        ["coded-dose", "--url", url],  # a served one
    ):
        with mllp_peer() as peer:
            done = subprocess.run(
                [*exe, where[0], *paths, *where[1:], "--hl7", peer.url, "--patient", "p-1",
                 "--order", "o-1", "--order", "o-2"],
                capture_output=True,
                text=True,
                env=env,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert f"{peer.url} accepted the ORU^R01 message (AA)" in done.stderr
            (message,) = peer.received
            assert str(message.segment("PID")[3]) == "p-1"
            assert [str(o[2]) for o in segments(message, "OBR")] == ["o-1", "o-2"]
            assert [str(o[2]) for o in segments(message, "ORC")] == ["o-1", "o-2"]
            msh = message.segment("MSH")
            assert [str(msh[k]) for k in (3, 4, 5, 6)] == list(PARTIES.values())
            obx = segments(message, "OBX")
            assert [str(o[11]) for o in obx] == ["F", "P"]
            assert [str(o[8]) for o in obx] == ["N", "A"]
    # One placer order for two files: refused before any work, nothing sent.
    with mllp_peer() as peer:
        done = subprocess.run(
            [*exe, str(models / "coded-dose" / "1"), *paths, "--hl7", peer.url,
             "--order", "ORD-77"],
            capture_output=True,
            text=True,
        )  # fmt: skip
        assert done.returncode != 0
        assert "1 placer order number(s) for 2 bag(s)" in done.stderr
        assert peer.received == []
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
    # Withheld, and still flagged abnormal: outside the domain is never a plain result.
    assert str(near[8]) == "" and str(far_obx[8]) == "A"
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


@pytest.mark.parametrize("policy", POLICIES)
def test_out_of_domain_is_flagged_on_every_standard_under_every_policy(tmp_path, policy):
    """A bag far from the training bags, under each out-of-domain policy: HL7 OBX-8 is
    ``A`` (never N/H/L) with the policy's OBX-11, FHIR interprets its Observation
    ``EX`` and codes the report's conclusion ``EX``; a bag inside the domain is judged
    against the normal range and final. Regressor and classifier alike."""
    rng = np.random.default_rng(3)
    arrays = [rng.normal(loc=m, size=(60, 2)) for m in rng.normal(size=24)]
    y = np.array([a.mean() for a in arrays])
    low, high = float(np.quantile(y, 0.1)), float(np.quantile(y, 0.9))
    coding = {"system": "http://lab.example.org/codes", "code": "mean", "unit": "1",
              "reference_range": [low, high]}  # fmt: skip
    sw = SlicedWasserstein(n_directions=10, n_levels=10, random_state=0)
    models = {
        "regressor": DistributionRidge(sw, gamma=1.0, alpha=1e-3).fit(arrays, y),
        "classifier": DistributionRidgeClassifier(sw, alpha=1e-3, random_state=0).fit(
            arrays, np.where(y > np.median(y), "high", "low")
        ),
    }
    status = {"flag": "F", "preliminary": "P", "withhold": "X"}[policy]
    fhir_status = {"flag": "final", "preliminary": "preliminary", "withhold": "cancelled"}
    for kind, model in models.items():
        path = save(model, tmp_path / kind, name=kind, version="1", fhir=coding,
                    serving={"out_of_domain": policy})  # fmt: skip
        runtime = ModelRuntime.open(path)
        assert OutputCoding.from_json(coding, kind).reference_range == (low, high)
        far = 40 + 25 * arrays[1]
        result = runtime.predict(Bags.from_arrays([arrays[0], far]))
        assert result.domain is not None
        assert result.domain.out_of_range.tolist() == [False, True]
        meta = {"model": {"name": kind, "version": "1", "sha256": runtime.info.sha256},
                "request_id": "q" * 32}  # fmt: skip
        message = hl7.parse(oru_r01(result, ["near", "far"], meta, runtime.info))
        near, outside = segments(message, "OBX")
        assert (str(outside[8]), str(outside[11])) == ("A", status), kind
        assert str(near[11]) == "F"
        if kind == "regressor":  # judged against the normal range, by its own value
            v = float(result.estimate[0])
            assert str(near[8]) == ("L" if v < low else "H" if v > high else "N")
        else:
            assert str(near[8]) == ""
        doc = bundle(result, ["near", "far"], meta, runtime.info)
        obs = [e["resource"] for e in doc["entry"]
               if e["resource"]["resourceType"] == "Observation"]  # fmt: skip
        codes = [{c["code"] for f in o.get("interpretation", []) for c in f["coding"]} for o in obs]
        assert codes[1] == {"EX"} and "EX" not in codes[0]
        assert obs[1]["status"] == fhir_status[policy] and obs[0]["status"] == "final"
        (report,) = [e["resource"] for e in doc["entry"]
                     if e["resource"]["resourceType"] == "DiagnosticReport"]  # fmt: skip
        (concluded,) = report["conclusionCode"]
        assert concluded["coding"] == [
            {"system": INTERPRETATION, "code": "EX", "display": "outside threshold"}
        ]
        assert concluded["text"].endswith("applicability domain: far")
        # Inside the domain alone, the report has no such code.
        inside = bundle(runtime.predict(Bags.from_arrays([arrays[0]])), ["near"], meta,
                        runtime.info)  # fmt: skip
        (plain,) = [e["resource"] for e in inside["entry"]
                    if e["resource"]["resourceType"] == "DiagnosticReport"]  # fmt: skip
        assert "conclusionCode" not in plain
