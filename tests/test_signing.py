"""Signed model releases: sign, verify, refuse, and name the signer everywhere.

Oracles: the model-signing package's own verifier (a signature from ``bagserve sign``
must verify with it directly), and edits made with plain file writes after signing.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from bagserve.core import ArtifactError
from bagserve.core.demo import build_demo_models
from bagserve.core.signing import (
    SIGNATURE_FILE,
    SignatureError,
    load_trusted_keys,
    sign_model,
    signature_key_sha256,
    verify_model,
)
from bagserve.service.registry import Registry
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

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


def keypair(
    directory: Path, name: str, password: bytes | None = None, key: Any = None
) -> tuple[Path, Path]:
    """A key pair as PEM files, (private, public): ``key``, or a new P-256 key."""
    key = key or ec.generate_private_key(ec.SECP256R1())
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


def test_keys_model_signing_cannot_use_are_refused_with_the_reason(tmp_path):
    models = tmp_path / "models"
    build_demo_models(models)
    artifact = models / "demo-dose" / "1"
    rsa_private, rsa_public = keypair(
        tmp_path, "rsa", key=rsa.generate_private_key(public_exponent=65537, key_size=2048)
    )
    _, k1_public = keypair(tmp_path, "k1", key=ec.generate_private_key(ec.SECP256K1()))
    with pytest.raises(SignatureError, match=r"rsa\.pub: the public key is not an elliptic"):
        load_trusted_keys([str(rsa_public)])
    with pytest.raises(SignatureError, match=r"k1\.pub: the public key is on the curve secp256k1"):
        load_trusted_keys([str(k1_public)])
    with pytest.raises(SignatureError, match=r"rsa\.key: the private key is not an elliptic"):
        sign_model(artifact, rsa_private)
    locked, _ = keypair(tmp_path, "locked", password=b"right")
    with pytest.raises(SignatureError, match=r"[Ii]ncorrect password"):
        sign_model(artifact, locked, password="wrong")
    with pytest.raises(SignatureError, match="not given"):
        sign_model(artifact, locked)
    assert not (artifact / SIGNATURE_FILE).exists()


def test_forged_unreadable_resigned_and_replaced_keys(release, tmp_path):
    models, qa_private, qa_public, other_private = release
    artifact = models / "demo-dose" / "1"
    keys = load_trusted_keys([str(qa_public)])
    signature = artifact / SIGNATURE_FILE
    good = signature.read_bytes()
    assert signature_key_sha256(artifact) == keys[0].sha256
    # One bit of the signature itself flipped: its key is trusted, the signature is not.
    bundle = json.loads(good)
    sig = bytearray(base64.b64decode(bundle["dsseEnvelope"]["signatures"][0]["sig"]))
    sig[-1] ^= 1
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    signature.write_text(json.dumps(bundle))
    with pytest.raises(SignatureError, match="not valid for the key of lab-qa"):
        verify_model(artifact, keys)
    signature.write_text("not a signature")
    with pytest.raises(SignatureError, match=r"model\.sig is not a readable signature"):
        verify_model(artifact, keys)
    signature.write_bytes(good)
    # A file removed after signing (the CLI sees it; the service's own hashes first).
    array = sorted((artifact / "arrays").glob("*.npy"))[-1]
    content = array.read_bytes()
    array.unlink()
    with pytest.raises(SignatureError, match=f"arrays/{array.name} missing since signing"):
        verify_model(artifact, keys)
    array.write_bytes(content)
    # Re-signing replaces the signature whole: the new signer, no leftover file.
    listing = sorted(p.name for p in artifact.iterdir())
    sign_model(artifact, other_private)
    assert sorted(p.name for p in artifact.iterdir()) == listing
    with pytest.raises(SignatureError, match="not trusted"):
        verify_model(artifact, keys)
    sign_model(artifact, qa_private)
    assert verify_model(artifact, keys).name == "lab-qa"
    # The trusted key's file replaced after it was loaded: refused, not silently trusted.
    _, intruder_public = keypair(tmp_path, "swap")
    qa_public.write_bytes(intruder_public.read_bytes())
    with pytest.raises(SignatureError, match="trusted key lab-qa changed or went missing"):
        verify_model(artifact, keys)


def test_registry_binds_a_release_to_its_name_and_version(release):
    models, _, qa_public, _ = release
    keys = load_trusted_keys([str(qa_public)])
    # A signed release copied under another version: its files verify, its place not.
    shutil.copytree(models / "demo-dose" / "1", models / "demo-dose" / "2")
    registry = Registry(models, keys)
    assert [e.key for e in registry.all()] == ["demo-dose/1"]
    assert registry.all()[0].signer is not None
    assert "the signed release is demo-dose/1" in registry.failures["demo-dose/2"]
    assert registry.failures["demo-gating/1"].startswith("demo-gating/1: unsigned")
    assert str(models) not in str(registry.failures)
    # Reloads (plans) apply the same rules.
    plan = registry.plan("demo-dose")
    assert [e.key for e in plan.all()] == ["demo-dose/1"] and "demo-dose/2" in plan.failures
    # Without trusted keys nothing is verified or shown: today's behaviour.
    plain = Registry(models)
    assert {e.key for e in plain.all()} == {"demo-dose/1", "demo-dose/2", "demo-gating/1"}
    assert all(e.signer is None and "signature" not in e.describe() for e in plain.all())
    assert "## Signature" not in plain.get("demo-dose", "1").card()


def test_model_signing_is_imported_only_when_needed(tmp_path, monkeypatch):
    code = (
        "import sys\n"
        "from bagserve.service.app import create_app\n"
        "from bagserve.service.settings import Settings\n"
        f"create_app(Settings(models_dir={str(tmp_path)!r}))\n"
        "assert 'model_signing' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    version = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "bagserve", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "model_signing" not in version.stderr
    # Without the package, trusted keys stop the start-up and say what to install.
    monkeypatch.setitem(sys.modules, "model_signing", None)
    with pytest.raises(SignatureError, match=r"pip install 'bagserve\[signing\]'"):
        load_trusted_keys([str(tmp_path / "any.pub")])


def test_cli_trusted_key_forms(release, capsys):
    models, _, qa_public, _ = release
    artifact = str(models / "demo-dose" / "1")
    _, unrelated = keypair(qa_public.parent.parent, "unrelated")
    many = ["--trusted-key", str(unrelated), "--trusted-key", f"QA={qa_public}"]
    assert main(["verify-signature", artifact, *many]) == 0
    assert "signed by QA" in capsys.readouterr().out
    as_json = json.dumps([str(unrelated), f"QA={qa_public}"])
    assert main(["verify-signature", artifact, "--trusted-keys", as_json]) == 0
    capsys.readouterr()
    assert main(["verify-signature", artifact, "--trusted-key", str(unrelated)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {artifact}: signed by a key that is not trusted")
    assert main(["verify-signature", artifact, "--trusted-key", artifact]) == 1
    assert "no *.pub or *.pem file" in capsys.readouterr().err


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
            e["resource"] for e in bundle["entry"] if e["resource"]["resourceType"] == "Device"
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


def test_a_wrong_password_that_passes_the_padding_check_is_still_named(tmp_path, monkeypatch):
    """About once in 256 keys a wrong password decrypts to bytes whose padding looks
    right, and cryptography reports unparseable key data instead of a wrong password:
    the error still says the password is wrong (it made this suite flaky)."""
    models = tmp_path / "models"
    build_demo_models(models)
    artifact = models / "demo-dose" / "1"
    locked, _ = keypair(tmp_path, "locked", password=b"right")
    real = serialization.load_pem_private_key

    def garbled(data, password, *args, **kwargs):
        if password == b"wrong":
            raise ValueError("Could not deserialize key data. ASN.1 parsing error")
        return real(data, password, *args, **kwargs)

    monkeypatch.setattr(serialization, "load_pem_private_key", garbled)
    with pytest.raises(SignatureError, match=r"locked\.key: incorrect password: .*ASN\.1"):
        sign_model(artifact, locked, password="wrong")
    assert not (artifact / SIGNATURE_FILE).exists()
