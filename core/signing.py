"""Signed model releases, in the OpenSSF model-signing format.

A lab validates a model version and then releases it: ``bagserve sign MODEL_DIR --key
KEY.pem`` writes ``MODEL_DIR/model.sig``, a Sigstore bundle (the OpenSSF model-signing
format, `model-signing` on PyPI) that signs the sha256 of every file of the artifact
with the lab's elliptic-curve private key, offline. A service given the release keys'
public halves (``BAGSERVE_TRUSTED_KEYS``) serves only artifacts whose signature
verifies against one of them, and names the signer wherever it names the model.

Signing covers every file of the directory, so a file changed, removed or added after
signing fails verification (the reason names it). The artifact's own hashes
(:func:`~core.artifacts.read_manifest`) are checked before signing: a tampered artifact
is never signed.

Trusted keys are read once (:func:`load_trusted_keys`, at a service's start-up) and
pinned by fingerprint: a key file replaced or removed afterwards is refused when a
model is verified with it, rather than silently trusted, so that changing who may
release models takes a restart (and shows in the start-up log).

The format's package is an optional extra (``pip install 'bagserve[signing]'``); it is
imported only when something is signed or verified.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .artifacts import read_manifest
from .atomic import atomic_write_bytes
from .errors import ArtifactError

__all__ = [
    "SIGNATURE_FILE",
    "SignatureError",
    "Signer",
    "TrustedKey",
    "key_fingerprint",
    "load_trusted_keys",
    "sign_model",
    "signature_key_sha256",
    "verify_model",
]

#: The signature's name inside the artifact (the model-signing tools' default name).
SIGNATURE_FILE = "model.sig"
_KEY_SUFFIXES = (".pub", ".pem")
#: The curves model-signing's elliptic-curve signer and verifier accept.
_CURVES = ("secp256r1", "secp384r1", "secp521r1")


class SignatureError(ArtifactError):
    """A model is unsigned, its signature does not verify, or its signer is not trusted."""


@dataclass(frozen=True)
class Signer:
    """Who signed a release: the trusted key's name and the sha256 of its public key
    (PEM), the fingerprint the signature itself carries."""

    name: str
    key_sha256: str

    def to_json(self) -> dict[str, str]:
        """As ``/v1/models`` and every answer's ``model`` carry it."""
        return {"signer": self.name, "key_sha256": self.key_sha256, "format": "model-signing"}


@dataclass(frozen=True)
class TrustedKey:
    """A public key releases may be signed with (elliptic curve, PEM)."""

    name: str
    path: Path
    sha256: str


def _model_signing() -> Any:
    try:
        import model_signing.hashing
        import model_signing.signing
        import model_signing.verifying
    except ImportError as exc:
        raise SignatureError(
            f"signed models need the model-signing package ({exc}): pip install 'bagserve[signing]'"
        ) from None
    return model_signing


def _check_curve(key: Any, what: str) -> None:
    """Refuse a key model-signing cannot sign or verify with, saying which it needs.

    Checked before model-signing sees the key: an RSA or secp256k1 public key would
    otherwise be accepted at start-up and refuse every model later, and an RSA private
    key fails inside model-signing with an AttributeError.
    """
    from cryptography.hazmat.primitives.asymmetric import ec

    if isinstance(key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey):
        if key.curve.name in _CURVES:
            return
        kind = f"is on the curve {key.curve.name}"
    else:
        kind = f"is not an elliptic-curve key ({type(key).__name__})"
    raise ValueError(f"{what} {kind}; model-signing needs {', '.join(_CURVES)}")


def key_fingerprint(pem: bytes) -> str:
    """sha256 of a public key in PEM (SubjectPublicKeyInfo), as signatures name it.

    Raises
    ------
    ValueError
        Not a PEM public key, or not on a curve model-signing supports.
    """
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a PEM public key ({exc})") from None
    _check_curve(key, "the public key")
    spki = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).hexdigest()


def load_trusted_keys(entries: Sequence[str]) -> list[TrustedKey]:
    """The keys of ``BAGSERVE_TRUSTED_KEYS``: each entry ``PATH`` or ``NAME=PATH`` of a
    PEM public key, or a directory of them (``*.pub``, ``*.pem``); the name defaults to
    the file's stem.

    A ``NAME=`` given to a directory of several keys is not used: each key is then
    named by its file's stem, so that a failure names which key.

    Raises
    ------
    SignatureError
        A key file that is missing, unreadable or not an elliptic-curve public key on a
        supported curve, named; no key at all in a directory; or the model-signing
        package is missing (checked here, at start-up, rather than at the first model).
    """
    keys: list[TrustedKey] = []
    if any(e.strip() for e in entries):
        _model_signing()
    for entry in entries:
        if not entry.strip():
            continue
        name, sep, where = entry.partition("=")
        if not sep:
            name, where = "", entry
        path = Path(where.strip()).expanduser()
        files = (
            sorted(p for p in path.iterdir() if p.suffix in _KEY_SUFFIXES)
            if path.is_dir()
            else [path]
        )
        if not files:
            raise SignatureError(f"trusted keys: no *.pub or *.pem file in {path}")
        for f in files:
            try:
                fingerprint = key_fingerprint(f.read_bytes())
            except OSError as exc:
                raise SignatureError(f"trusted key {f}: {exc.strerror or exc}") from None
            except ValueError as exc:
                raise SignatureError(f"trusted key {f}: {exc}") from None
            label = name.strip() if name.strip() and len(files) == 1 else f.stem
            keys.append(TrustedKey(label, f, fingerprint))
    return keys


def sign_model(
    model_dir: str | os.PathLike[str],
    private_key: str | os.PathLike[str],
    *,
    password: str | bytes | None = None,
) -> Path:
    """Sign an artifact with an elliptic-curve private key (PEM), offline.

    Writes ``MODEL_DIR/model.sig`` atomically: a new signature replaces an old one
    whole, and a reader (a service reloading) sees one or the other. The signature is
    not itself signed (it is model-signing's ignored path), and neither are Git's
    files, as with model-signing's own CLI.

    Parameters
    ----------
    model_dir : path
        A bagserve artifact (``manifest.json`` and the files it lists).
    private_key : path
        PEM, on one of the curves secp256r1, secp384r1, secp521r1.
    password : str or bytes, optional
        The private key's password, if it is encrypted.

    Returns
    -------
    Path
        The signature; :func:`signature_key_sha256` gives the fingerprint it records.

    Raises
    ------
    ArtifactError
        Not a bagserve artifact, or one that does not pass its own hashes.
    SignatureError
        The key cannot be read or used (wrong password, unsupported curve).
    """
    model_dir = Path(model_dir)
    read_manifest(model_dir, verify=True)
    ms = _model_signing()
    hashing = ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE], ignore_git_paths=True)
    from cryptography.hazmat.primitives import serialization

    # model-signing's annotation says str; cryptography, which reads the key, takes bytes.
    secret = password.encode() if isinstance(password, str) else password
    pem = b""
    try:
        pem = Path(private_key).read_bytes()
        key = serialization.load_pem_private_key(pem, secret)
        _check_curve(key, "the private key")
        signer = ms.signing.Config().use_elliptic_key_signer(
            private_key=Path(private_key), password=secret
        )
    except OSError as exc:
        raise SignatureError(f"signing key {private_key}: {exc.strerror or exc}") from None
    except (ValueError, TypeError) as exc:  # wrong or missing password, not a key
        reason = str(exc)
        if secret is not None and b"ENCRYPTED" in pem and "password" not in reason.lower():
            # A wrong password usually fails the padding check ("Incorrect password");
            # about once in 256 keys it passes it and the garbage fails to parse.
            reason = f"incorrect password: the encrypted key did not decrypt to a key ({reason})"
        raise SignatureError(f"signing key {private_key}: {reason}") from None
    # Signed into a scratch directory outside the artifact (which is being hashed),
    # then published into it with a durable atomic rename.
    with tempfile.TemporaryDirectory(prefix="bagserve-sign-") as scratch:
        tmp = Path(scratch) / SIGNATURE_FILE
        signer.set_hashing_config(hashing).sign(model_dir, tmp)
        return atomic_write_bytes(model_dir / SIGNATURE_FILE, tmp.read_bytes())


def signature_key_sha256(model_dir: str | os.PathLike[str]) -> str:
    """The fingerprint (sha256 of the public key PEM) an artifact's signature records
    as its signer's; ``""`` when it is unsigned or records none. Not verified."""
    try:
        return _hint(_bundle((Path(model_dir) / SIGNATURE_FILE).read_bytes()))
    except (OSError, ValueError):
        return ""


def _bundle(raw: bytes) -> dict[str, Any]:
    """A signature file's bytes as JSON (a Sigstore bundle); ValueError if not one."""
    bundle = json.loads(raw)
    if not isinstance(bundle, dict) or "dsseEnvelope" not in bundle:
        raise ValueError("not a Sigstore bundle")
    return bundle


def _hint(bundle: dict[str, Any]) -> str:
    """The signing key's fingerprint as the signature records it."""
    try:
        return str(bundle["verificationMaterial"]["publicKey"]["hint"])
    except (KeyError, TypeError):
        return ""


# model-signing reports a mismatch as "Signature mismatch: " and the repr of a list of
# lines, one per kind of difference, digests included.
_MISMATCH = re.compile(r"Hash mismatch for '(.+?)': .*", re.DOTALL)
_EXTRA = re.compile(r"Extra files found in model '.*?': (.+)", re.DOTALL)
_MISSING = re.compile(r"Missing files in model '.*?': (.+)", re.DOTALL)


def _reason(message: str) -> str:
    """model-signing's mismatch message, in words: the files named (relative to the
    artifact), the digests left out; the message itself if it is of another kind."""
    head, _, listed = message.partition("Signature mismatch: ")
    try:
        lines = ast.literal_eval(listed) if not head and listed else None
    except (ValueError, SyntaxError):
        lines = None
    if not isinstance(lines, list) or not lines:
        return message[:300]
    changed, parts = [], []
    for line in map(str, lines):
        if m := _MISMATCH.fullmatch(line):
            changed.append(m.group(1))
        elif m := _EXTRA.fullmatch(line):
            parts.append(f"{m.group(1)} added after signing")
        elif m := _MISSING.fullmatch(line):
            parts.append(f"{m.group(1)} missing since signing")
        else:
            parts.append(line[:200])
    if changed:
        parts.insert(0, f"{', '.join(changed)} changed since it was signed")
    return "; ".join(parts)


def verify_model(
    model_dir: str | os.PathLike[str],
    trusted_keys: Sequence[TrustedKey],
    *,
    digests: Mapping[str, str] | None = None,
) -> Signer:
    """Verify an artifact's signature against the trusted keys; who signed it.

    The key tried is the one the signature names (its public-key hint, the sha256 of
    the signer's public key); a signature naming none (model-signing's older format)
    is tried against each trusted key. Unsigned files are not ignored: a file added to
    the directory after signing fails verification like a changed one.

    model-signing reads the files on disk; what a process computes from is what it
    read itself (:func:`~core.artifacts.read_verified`). ``digests`` binds the two:
    the signature file is read once, verified, and the digests it signs must be
    those of the bytes the caller holds, so that a file swapped between the caller's
    read and model-signing's is refused rather than served under the signer's name.

    Parameters
    ----------
    model_dir : path
        The artifact.
    trusted_keys : sequence of TrustedKey
        From :func:`load_trusted_keys`.
    digests : mapping of str to str, optional
        The sha256 of the files the caller read (relative path to hex digest), each
        to be the digest the signature signs for that file.

    Returns
    -------
    Signer
        The trusted key's name and fingerprint.

    Raises
    ------
    SignatureError
        Naming the artifact and why: unsigned, an unreadable signature, signed by a
        key that is not trusted, a signature that is not valid for its key, or files
        that do not match it (named: changed, added or missing since signing); or a
        trusted key's file changed since it was loaded.
    """
    model_dir = Path(model_dir)
    signature = model_dir / SIGNATURE_FILE
    if not signature.is_file():
        raise SignatureError(
            f"{model_dir}: unsigned (no {SIGNATURE_FILE}; a release is signed with `bagserve sign`)"
        )
    try:
        raw = signature.read_bytes()
        bundle = _bundle(raw)
        hint = _hint(bundle)
    except (OSError, ValueError) as exc:
        raise SignatureError(
            f"{model_dir}: {SIGNATURE_FILE} is not a readable signature ({exc})"
        ) from None
    # model-signing is given a copy of the bytes read here: the digests compared
    # below are then those of the signature it verified, whatever the file holds now.
    with tempfile.TemporaryDirectory(prefix="bagserve-verify-") as scratch:
        copy = Path(scratch) / SIGNATURE_FILE
        copy.write_bytes(raw)
        signer = _verify_bundle(model_dir, copy, hint, trusted_keys)
    if digests is not None:
        _check_signed_digests(model_dir, bundle, digests)
    return signer


def _verify_bundle(
    model_dir: Path, signature: Path, hint: str, trusted_keys: Sequence[TrustedKey]
) -> Signer:
    """model-signing's verification of ``model_dir`` against ``signature``."""
    candidates = [k for k in trusted_keys if k.sha256 == hint] or (
        [] if hint else list(trusted_keys)
    )
    if not candidates:
        raise SignatureError(
            f"{model_dir}: signed by a key that is not trusted (key sha256 {hint[:16]}...; "
            f"trusted: {', '.join(k.name for k in trusted_keys) or 'none'})"
        )
    from cryptography.exceptions import InvalidSignature

    ms = _model_signing()
    problem = ""
    for key in candidates:
        _check_pinned(key, model_dir)
        try:
            ms.verifying.Config().use_elliptic_key_verifier(public_key=key.path).verify(
                model_dir, signature
            )
        except InvalidSignature:
            problem = f"the signature is not valid for the key of {key.name} (forged or corrupted)"
            continue
        except ValueError as exc:
            problem = _reason(str(exc))
            continue
        except Exception as exc:  # a malformed bundle raises from protobuf, base64, ...
            raise SignatureError(
                f"{model_dir}: {SIGNATURE_FILE} is not a readable signature "
                f"({type(exc).__name__}: {exc})"
            ) from None
        return Signer(key.name, key.sha256)
    raise SignatureError(f"{model_dir}: the signature does not verify: {problem}")


def _signed_digests(bundle: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """File to (algorithm, hex digest), as the signature's in-toto statement signs them
    (model-signing's v1.0 predicate, or its v0.2 subjects)."""
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    resources = (statement.get("predicate") or {}).get("resources")
    if resources is None:
        return {
            str(s["name"]): ("sha256", str(s["digest"]["sha256"])) for s in statement["subject"]
        }
    return {str(r["name"]): (str(r["algorithm"]), str(r["digest"])) for r in resources}


def _check_signed_digests(
    model_dir: Path, bundle: dict[str, Any], digests: Mapping[str, str]
) -> None:
    """Refuse bytes held by the caller that are not the bytes the signature signs."""
    try:
        signed = _signed_digests(bundle)
    except (KeyError, TypeError, ValueError) as exc:
        raise SignatureError(
            f"{model_dir}: {SIGNATURE_FILE} is not a readable signature ({exc!r})"
        ) from None
    for rel, digest in sorted(digests.items()):
        algorithm, value = signed.get(rel, ("", ""))
        if not algorithm:
            raise SignatureError(f"{model_dir}: {rel} is not covered by the signature")
        if algorithm != "sha256":
            raise SignatureError(
                f"{model_dir}: the signature records {algorithm} digests; the bytes served "
                "are bound to it by sha256 file digests (sign with `bagserve sign`)"
            )
        if value != digest:
            raise SignatureError(
                f"{model_dir}: {rel} changed while it was being verified (the bytes read "
                "are not the bytes signed); load it again"
            )


def _check_pinned(key: TrustedKey, model_dir: Path) -> None:
    """Refuse a trusted key whose file no longer holds the key loaded at start-up
    (model-signing reads the key from its file at every verification)."""
    try:
        same = key_fingerprint(key.path.read_bytes()) == key.sha256
    except (OSError, ValueError, TypeError):
        same = False
    if not same:
        raise SignatureError(
            f"{model_dir}: the file of trusted key {key.name} changed or went missing since "
            "it was loaded; restart to trust the keys now on disk"
        )
