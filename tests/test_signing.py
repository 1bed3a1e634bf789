"""Signed model releases: sign, verify, refuse, and name the signer everywhere.

Oracles: the model-signing package's own verifier (a signature from ``bagserve sign``
must verify with it directly), and edits made with plain file writes after signing.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from bagserve.core import ArtifactError
from bagserve.core.demo import build_demo_models
from bagserve.core.signing import (
    SIGNATURE_FILE,
    SignatureError,
    load_trusted_keys,
    sign_model,
    verify_model,
)
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bagserve.cli import main

from .service_harness import running_service
from .test_fhir import assert_valid, validator  # noqa: F401  (a fixture)

DOSE_BODY = {
    "bags": [
        {
            "id": "p1",
            "markers": ["FSC-A", "SSC-A", "GFP"],
            "points": [[2.1, 1.0, 0.3], [1.7, 0.8, 1.9], [2.4, 1.3, 0.1], [1.9, 1.1, 0.5]],
        }
    ]
}


def keypair(directory: Path, name: str, password: bytes | None = None) -> tuple[Path, Path]:
    """An elliptic-curve key pair as PEM files: (private, public)."""
    key = ec.generate_private_key(ec.SECP256R1())
    encryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


@pytest.fixture
def release(tmp_path):
    """Demo models, the dose model signed by the lab's QA key; a key outside the lab."""
    models = tmp_path / "models"
    build_demo_models(models)
    keys = tmp_path / "keys"
    keys.mkdir()
    qa_private, qa_public = keypair(keys, "lab-qa")
    other_private, _ = keypair(tmp_path, "intruder")
    sign_model(models / "demo-dose" / "1", qa_private)
    return models, qa_private, qa_public, other_private


def test_a_signature_verifies_with_model_signing_itself(release):
    import model_signing.verifying

    models, _, qa_public, _ = release
    artifact = models / "demo-dose" / "1"
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=qa_public).verify(
        artifact, artifact / SIGNATURE_FILE
    )
    signer = verify_model(artifact, load_trusted_keys([str(qa_public)]))
    assert signer.name == "lab-qa" and len(signer.key_sha256) == 64


def test_changed_added_unsigned_and_untrusted_are_refused(release, tmp_path):
    models, qa_private, qa_public, other_private = release
    keys = load_trusted_keys([f"QA release={qa_public}"])
    assert keys[0].name == "QA release"
    artifact = models / "demo-dose" / "1"
    array = sorted((artifact / "arrays").glob("*.npy"))[0]
    original = array.read_bytes()
    array.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(SignatureError, match=f"arrays/{array.name} changed since it was signed"):
        verify_model(artifact, keys)
    # bagserve's own hashes refuse to sign a tampered artifact in the first place.
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        sign_model(artifact, qa_private)
    array.write_bytes(original)
    (artifact / "notes.txt").write_text("added later")
    with pytest.raises(SignatureError, match=r"notes\.txt added after signing"):
        verify_model(artifact, keys)
    (artifact / "notes.txt").unlink()
    assert verify_model(artifact, keys).name == "QA release"
    with pytest.raises(SignatureError, match="unsigned"):
        verify_model(models / "demo-gating" / "1", keys)
    sign_model(models / "demo-gating" / "1", other_private)
    with pytest.raises(SignatureError, match="not trusted"):
        verify_model(models / "demo-gating" / "1", keys)
    with pytest.raises(ArtifactError, match="not a bagserve model artifact"):
        sign_model(tmp_path, qa_private)


def test_trusted_keys_from_a_directory_and_bad_key_files(release, tmp_path):
    _, _, qa_public, _ = release
    assert [k.name for k in load_trusted_keys([str(qa_public.parent)])] == ["lab-qa"]
    (tmp_path / "broken.pub").write_text("not a key")
    with pytest.raises(SignatureError, match=r"broken\.pub: not a PEM public key"):
        load_trusted_keys([str(tmp_path / "broken.pub")])
    with pytest.raises(SignatureError, match=r"missing\.pub"):
        load_trusted_keys([str(tmp_path / "missing.pub")])


def test_cli_sign_and_verify_signature(tmp_path, capsys, monkeypatch):
    models = tmp_path / "models"
    build_demo_models(models)
    private, public = keypair(tmp_path, "release", password=b"s3cret")
    artifact = str(models / "demo-gating" / "1")
    monkeypatch.setenv("RELEASE_KEY_PASSWORD", "s3cret")
    sign = ["sign", artifact, "--key", str(private)]
    assert main([*sign, "--password-env", "RELEASE_KEY_PASSWORD"]) == 0
    assert "signed with the key of sha256" in capsys.readouterr().out
    assert main(["verify-signature", artifact, "--trusted-keys", str(public)]) == 0
    assert "signed by release" in capsys.readouterr().out
    (Path(artifact) / "manifest.json").write_text("{}")
    assert main(["verify-signature", artifact, "--trusted-keys", str(public)]) == 1
    assert "manifest.json changed since it was signed" in capsys.readouterr().err
    monkeypatch.delenv("RELEASE_KEY_PASSWORD")
    assert main([*sign, "--password-env", "X_UNSET"]) == 1


def test_the_service_serves_only_signed_models_and_names_the_signer(release, validator):  # noqa: F811
    models, qa_private, qa_public, _ = release
    with running_service(models, BAGSERVE_TRUSTED_KEYS=f"lab QA={qa_public}") as url:
        listing = httpx.get(f"{url}/v1/models").json()
        served = {m["name"]: m["versions"][0] for m in listing["models"]}
        assert set(served) == {"demo-dose"}
        assert served["demo-dose"]["signature"]["signer"] == "lab QA"
        assert "unsigned" in listing["failures"]["demo-gating/1"]
        card = httpx.get(f"{url}/v1/models/demo-dose/card").text
        assert "## Signature" in card and "**lab QA**" in card
        answer = httpx.post(f"{url}/v1/models/demo-dose/predict", json=DOSE_BODY).json()
        assert answer["model"]["signer"]["signer"] == "lab QA"
        bundle = httpx.post(
            f"{url}/v1/models/demo-dose/predict",
            json=DOSE_BODY,
            headers={"accept": "application/fhir+json"},
        ).json()
        assert_valid(validator, bundle)
        devices = [
            c
            for e in bundle["entry"]
            for c in e["resource"].get("contained", [])
            if c["resourceType"] == "Device"
        ]
        assert devices and all("lab QA" in d["note"][0]["text"] for d in devices)
        # Sign the gating model and load it: served. Tamper with the dose model and
        # reload everything (SIGHUP): refused with the reason, the rest still served.
        sign_model(models / "demo-gating" / "1", qa_private)
        assert httpx.post(f"{url}/v2/repository/models/demo-gating/load").status_code == 200
        array = sorted((models / "demo-dose" / "1" / "arrays").glob("*.npy"))[0]
        array.write_bytes(array.read_bytes() + b"\0")
        refused = httpx.post(f"{url}/v2/repository/models/demo-dose/load")
        assert refused.status_code == 404
        assert "does not match its sha256" in refused.json()["error"]
        (models / "demo-dose" / "1" / "notes.txt").write_text("x")
        array.write_bytes(array.read_bytes()[:-1])
        os.kill(url.pid, signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "demo-dose" in httpx.get(f"{url}/readyz").json()["models"][0]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        failures = httpx.get(f"{url}/v1/models").json()["failures"]
        assert "notes.txt added after signing" in failures["demo-dose/1"]
        assert str(models) not in str(failures)
        assert httpx.get(f"{url}/readyz").json()["models"] == ["demo-gating/1"]
