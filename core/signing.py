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

The format's package is an optional extra (``pip install 'bagserve[signing]'``); it is
imported only when something is signed or verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .artifacts import read_manifest
from .errors import ArtifactError

__all__ = [
    "SIGNATURE_FILE",
    "SignatureError",
    "Signer",
    "TrustedKey",
    "load_trusted_keys",
    "sign_model",
    "verify_model",
]

#: The signature's name inside the artifact (the model-signing tools' default name).
SIGNATURE_FILE = "model.sig"
_KEY_SUFFIXES = (".pub", ".pem")


class SignatureError(ArtifactError):
    """A model is unsigned, its signature does not verify, or its signer is not trusted."""


@dataclass(frozen=True)
class Signer:
    """Who signed a release: the trusted key's name and the sha256 of its public key
    (PEM), the fingerprint the signature itself carries."""

    name: str
    key_sha256: str

    def to_json(self) -> dict[str, str]:
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


def key_fingerprint(pem: bytes) -> str:
    """sha256 of a public key in PEM (SubjectPublicKeyInfo), as signatures name it."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_public_key(pem)
    spki = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).hexdigest()


def load_trusted_keys(entries: Sequence[str]) -> list[TrustedKey]:
    """The keys of ``BAGSERVE_TRUSTED_KEYS``: each entry ``PATH`` or ``NAME=PATH`` of a
    PEM public key, or a directory of them (``*.pub``, ``*.pem``); the name defaults to
    the file's stem.

    Raises
    ------
    SignatureError
        A key file that is missing, unreadable or not an elliptic-curve public key,
        named; or no key at all in a directory.
    """
    keys: list[TrustedKey] = []
    for entry in entries:
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
            except (ValueError, TypeError) as exc:
                raise SignatureError(f"trusted key {f}: not a PEM public key ({exc})") from None
            label = name.strip() if name.strip() and len(files) == 1 else f.stem
            keys.append(TrustedKey(label, f, fingerprint))
    return keys


def sign_model(
    model_dir: str | os.PathLike[str],
    private_key: str | os.PathLike[str],
    *,
    password: str | None = None,
) -> tuple[Path, str]:
    """Sign an artifact with an elliptic-curve private key (PEM): writes
    ``MODEL_DIR/model.sig`` atomically (a new signature replaces an old one).

    Returns
    -------
    signature : Path
    key_sha256 : str
        The fingerprint of the signing key's public half.

    Raises
    ------
    ArtifactError
        Not a bagserve artifact, or one that does not pass its own hashes.
    SignatureError
        The key cannot be used.
    """
    model_dir = Path(model_dir)
    read_manifest(model_dir, verify=True)
    ms = _model_signing()
    hashing = ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE], ignore_git_paths=True)
    target = model_dir / SIGNATURE_FILE
    fd, tmp = tempfile.mkstemp(dir=model_dir.parent, prefix=f".{model_dir.name}.sig.")
    os.close(fd)
    try:
        try:
            # Its annotation says str; cryptography, which reads the key, takes bytes.
            secret = password.encode() if password is not None else None
            signer = ms.signing.Config().use_elliptic_key_signer(
                private_key=Path(private_key), password=secret
            )
        except (OSError, ValueError, TypeError) as exc:
            raise SignatureError(f"signing key {private_key}: {exc}") from None
        # Written beside the artifact, not in it: the directory is hashed while signing.
        signer.set_hashing_config(hashing).sign(model_dir, Path(tmp))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target, _hint(target)


def _hint(signature: Path) -> str:
    """The signing key's fingerprint as the signature records it."""
    try:
        bundle = json.loads(signature.read_text())
        return str(bundle["verificationMaterial"]["publicKey"]["hint"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


# The messages come inside a list's repr, so their quotes may be escaped.
_MISMATCH = re.compile(r"Hash mismatch for \\?'([^'\\]+)\\?'")
_EXTRA = re.compile(r"Extra files found in model '[^']*': (.+?)['\"\]]*$")
_MISSING = re.compile(r"Missing files in model '[^']*': (.+?)['\"\]]*$")


def _reason(message: str) -> str:
    """model-signing's mismatch message, in words (files named, digests left out)."""
    changed = _MISMATCH.findall(message)
    parts = [f"{', '.join(changed)} changed since it was signed"] if changed else []
    for pattern, what in ((_EXTRA, "added after signing"), (_MISSING, "missing")):
        found = pattern.search(message)
        if found:
            parts.append(f"{found.group(1)} {what}")
    return "; ".join(parts) or message[:300]


def verify_model(model_dir: str | os.PathLike[str], keys: Sequence[TrustedKey]) -> Signer:
    """Verify an artifact's signature against the trusted keys; who signed it.

    Raises
    ------
    SignatureError
        Unsigned, signed by a key that is not trusted, or not matching the files (the
        reason names the files).
    """
    model_dir = Path(model_dir)
    signature = model_dir / SIGNATURE_FILE
    if not signature.is_file():
        raise SignatureError(f"unsigned: no {SIGNATURE_FILE} (sign it with `bagserve sign`)")
    hint = _hint(signature)
    candidates = [k for k in keys if k.sha256 == hint] or ([] if hint else list(keys))
    if not candidates:
        raise SignatureError(
            f"signed by a key that is not trusted (key sha256 {hint[:16]}...; trusted: "
            f"{', '.join(k.name for k in keys) or 'none'})"
        )
    ms = _model_signing()
    problem = "no trusted key"
    for key in candidates:
        try:
            ms.verifying.Config().use_elliptic_key_verifier(public_key=key.path).verify(
                model_dir, signature
            )
        except ValueError as exc:
            problem = str(exc)
            continue
        except Exception as exc:  # a malformed bundle raises from protobuf, json, ...
            raise SignatureError(f"unreadable signature ({type(exc).__name__}: {exc})") from None
        return Signer(key.name, key.sha256)
    raise SignatureError(f"the signature does not verify: {_reason(problem)}")
