"""The models a service instance serves: ``MODELS_DIR/<name>/<version>/`` artifacts.

Every artifact is verified (format and sha256 of every file) at start-up; a broken one
is recorded with its reason and skipped, the others still serve. With trusted release
keys (``BAGSERVE_TRUSTED_KEYS``), an artifact is served only if its signature verifies
against one of them (:mod:`bagserve.core.signing`), at start-up and at every reload,
and only under the name and version its signed manifest records.
Models are never uploaded over HTTP.

What is verified is what is served: a served version's manifest and arrays are read
once into sealed memory and verified there (:func:`~bagserve.core.artifacts.read_verified`),
its signature bound to those bytes, and the workers compute from that memory
(:attr:`ModelEntry.verified`), never from the files. A file changed afterwards changes
no answer; the next load that reads it refuses it with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagserve.core.artifact_info import ArtifactInfo
from bagserve.core.artifacts import ArtifactError, VerifiedArtifact, read_manifest, read_verified
from bagserve.core.io import Panel
from bagserve.core.results import ModelKind
from bagserve.core.signing import SignatureError, Signer, TrustedKey, verify_model

__all__ = ["ModelEntry", "Registry"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _version_key(version: str) -> tuple[Any, ...]:
    """Numeric-aware ordering: "10" after "9", "1.10" after "1.9"."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[._-]", version))


@dataclass(frozen=True)
class ModelEntry:
    """One served model version: its name and version, and what its artifact says.

    Parameters
    ----------
    name, version : str
        From the directory ``MODELS_DIR/<name>/<version>/``.
    info : ArtifactInfo
        The verified manifest (kind, panel, preprocessing, hashes).
    signer : Signer, optional
        Who signed the release, when the service requires signatures.
    verified : VerifiedArtifact, optional
        The manifest and arrays as read and verified, in sealed memory: what the
        workers compute from (None for a listing of what is on disk).
    """

    name: str
    version: str
    info: ArtifactInfo = field(repr=False)
    signer: Signer | None = None
    verified: VerifiedArtifact | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> str:
        """``name/version``: how the workers know the model."""
        return f"{self.name}/{self.version}"

    @property
    def sha256(self) -> str:
        """The artifact's manifest digest (it covers every file)."""
        return self.info.sha256

    @property
    def kind(self) -> ModelKind:
        """What the model answers (:class:`~bagserve.core.results.ModelKind`)."""
        return self.info.kind

    @property
    def panel(self) -> Panel | None:
        """The model's markers, matched by name; ``None`` for models trained on arrays."""
        return self.info.panel

    @property
    def n_features(self) -> int:
        """Columns each bag must have."""
        return self.info.n_features

    def describe(self) -> dict[str, Any]:
        """The model as ``GET /v1/models`` lists it."""
        out = {"name": self.name, "version": self.version, **self.info.describe()}
        if self.signer is not None:
            out["signature"] = self.signer.to_json()
        return out

    def provenance(self) -> dict[str, Any]:
        """The model as every answer names it: name, version, sha256, and the signer."""
        out: dict[str, Any] = {"name": self.name, "version": self.version, "sha256": self.sha256}
        if self.signer is not None:
            out["signer"] = self.signer.to_json()
        return out

    def card(self) -> str:
        """The model card, with a section on the release's signature when signed."""
        text = self.info.card()
        if self.signer is None:
            return text
        signed = self.signer
        return (
            f"{text.rstrip()}\n\n## Signature\n\n"
            f"Release signed by **{signed.name}** (public key sha256 `{signed.key_sha256}`), "
            "OpenSSF model-signing format; the signature covers every file of this version "
            "and was verified when the service loaded it.\n"
        )


def _without_paths(reason: str, artifact: Path, key: str) -> str:
    """A refusal's reason with the artifact's place on disk replaced by its key: the
    server's paths are nobody's business, and ``name/version`` says which artifact."""
    for place in (str(artifact.resolve()), str(artifact)):
        reason = reason.replace(place, key)
    return reason


def _check_release_place(info: ArtifactInfo, key: str) -> None:
    """Refuse a signed release served under another name or version than its manifest's.

    A model-signing signature covers the files, not the directory's name; the name and
    version the manifest records are signed with it. Without this check a signed
    ``demo-dose/1`` copied to ``demo-dose/2`` (or to another model's name) would be
    served, and named in every answer and FHIR ``Device``, as a release nobody signed.
    An artifact whose manifest records no name or version is not checked for it.
    """
    meta = info.metadata
    name, version = key.split("/", 1)
    signed_as = f"{meta.get('name') or name}/{meta.get('version') or version}"
    if signed_as != key:
        raise SignatureError(
            f"{key}: the signed release is {signed_as} (its manifest's name and version); "
            "a signature vouches for the release it names, not for a copy under another name"
        )


class Registry:
    """Scan a models directory once; keep the valid artifacts and the reasons for the rest.

    Parameters
    ----------
    models_dir : path
        ``MODELS_DIR/<name>/<version>/`` artifacts.
    trusted_keys : sequence of TrustedKey
        Release keys; when given, an artifact without a signature that verifies against
        one of them is refused (with the reason).
    """

    def __init__(self, models_dir: str | Path, trusted_keys: Sequence[TrustedKey] = ()):
        self.models_dir = Path(models_dir)
        self.trusted_keys = list(trusted_keys)
        self.entries: dict[str, dict[str, ModelEntry]] = {}
        self.failures: dict[str, str] = {}
        #: Models taken out of service by :meth:`unload` (kept out by later rescans).
        self.unloaded: set[str] = set()
        self.entries, self.failures = self._scan(load=True)

    def _scan(
        self, only: str | None = None, *, load: bool = False
    ) -> tuple[dict[str, dict[str, ModelEntry]], dict[str, str]]:
        """Every valid artifact on disk (of model ``only``, if given) and the reasons
        for the others; nothing is changed.

        With ``load``, each valid version comes with its verified bytes, to be served
        (:meth:`_verified`); without, the files are only checked (a listing)."""
        entries: dict[str, dict[str, ModelEntry]] = {}
        failures: dict[str, str] = {}
        if not self.models_dir.is_dir():
            failures[str(self.models_dir)] = "models directory does not exist"
            return entries, failures
        for mdir in sorted(p for p in self.models_dir.iterdir() if p.is_dir()):
            if only is not None and mdir.name != only:
                continue
            if not _NAME.match(mdir.name):
                continue
            for vdir in sorted(p for p in mdir.iterdir() if p.is_dir()):
                if not _NAME.match(vdir.name):
                    continue
                key = f"{mdir.name}/{vdir.name}"
                try:
                    verified = self._verified(key, vdir) if load else None
                    if verified is None:
                        info = ArtifactInfo.read(vdir)
                    else:
                        info = ArtifactInfo(vdir, verified.manifest)
                    info.check_servable()
                    # The class labels name its answers' table columns: read now, their
                    # bytes checked against the manifest just verified.
                    _ = info.classes
                    signer = None
                    if self.trusted_keys:
                        signer = verify_model(
                            vdir,
                            self.trusted_keys,
                            digests=None if verified is None else verified.digests,
                        )
                        _check_release_place(info, key)
                except ArtifactError as exc:  # SignatureError included
                    failures[key] = _without_paths(str(exc), vdir, key)
                    continue
                entries.setdefault(mdir.name, {})[vdir.name] = ModelEntry(
                    mdir.name, vdir.name, info, signer, verified
                )
        return entries, failures

    def _verified(self, key: str, vdir: Path) -> VerifiedArtifact:
        """The verified bytes to serve ``key`` from: read into sealed memory, or, for
        the version served now unchanged on disk, the memory it is served from (a
        reload checks the files again, and holds no second copy)."""
        name, version = key.split("/", 1)
        served = self.get(name, version)
        if served is not None and served.verified is not None:
            on_disk = read_manifest(vdir)  # every file hashed: a changed one is refused
            if on_disk.get("manifest_sha256") == served.sha256:
                return served.verified
        return read_verified(vdir, shared=True, mapped=False)

    def plan(self, name: str | None = None) -> Registry:
        """What serving would look like after a rescan (of model ``name`` only, which
        is also taken back from :attr:`unloaded`), as a new registry; this one is
        unchanged until :meth:`adopt`."""
        nxt = Registry.__new__(Registry)
        nxt.models_dir = self.models_dir
        nxt.trusted_keys = self.trusted_keys
        nxt.unloaded = set(self.unloaded) - ({name} if name else set())
        if name is None:
            entries, failures = self._scan(load=True)
        else:
            entries = {k: v for k, v in self.entries.items() if k != name}
            failures = {k: v for k, v in self.failures.items() if not k.startswith(f"{name}/")}
            found, failed = self._scan(only=name, load=True)
            entries.update(found)
            failures.update(failed)
        nxt.entries = {k: v for k, v in entries.items() if k not in nxt.unloaded}
        nxt.failures = failures
        return nxt

    def without(self, name: str) -> Registry:
        """This registry with model ``name`` unloaded (see :meth:`plan`)."""
        nxt = Registry.__new__(Registry)
        nxt.models_dir = self.models_dir
        nxt.trusted_keys = self.trusted_keys
        nxt.unloaded = self.unloaded | {name}
        nxt.entries = {k: v for k, v in self.entries.items() if k != name}
        nxt.failures = dict(self.failures)
        return nxt

    def refusing(self, reasons: dict[str, str], fallback: Registry | None = None) -> Registry:
        """This registry without the versions ``reasons`` names (``name/version`` to
        why, recorded as refusals); where ``fallback`` serves the same version (an
        artifact changed on disk whose new files could not be loaded), its entry stays.
        """
        nxt = Registry.__new__(Registry)
        nxt.models_dir = self.models_dir
        nxt.trusted_keys = self.trusted_keys
        nxt.unloaded = set(self.unloaded)
        nxt.entries = {name: dict(versions) for name, versions in self.entries.items()}
        nxt.failures = {**self.failures, **reasons}
        for key in reasons:
            name, version = key.split("/", 1)
            before = fallback.get(name, version) if fallback is not None else None
            if before is not None:
                nxt.entries.setdefault(name, {})[version] = before
            else:
                nxt.entries.get(name, {}).pop(version, None)
        nxt.entries = {name: versions for name, versions in nxt.entries.items() if versions}
        return nxt

    def adopt(self, other: Registry) -> None:
        """Serve what ``other`` serves, in place (every holder of this registry sees it)."""
        self.entries, self.failures, self.unloaded = other.entries, other.failures, other.unloaded

    def on_disk(self) -> list[dict[str, str]]:
        """Every model version in the repository with its state, as Triton's repository
        index lists them: READY (served) or UNAVAILABLE with the reason."""
        found, failed = self._scan()
        rows = []
        for name in sorted(set(found) | {k.split("/")[0] for k in failed if "/" in k}):
            for version in sorted(found.get(name, {}), key=_version_key):
                served = self.get(name, version)
                on_disk = found[name][version]
                if name in self.unloaded:
                    state, reason = "UNAVAILABLE", "unloaded"
                elif served is None and f"{name}/{version}" in self.failures:
                    # Verified on disk, refused by the workers (see Repository.load).
                    state, reason = "UNAVAILABLE", self.failures[f"{name}/{version}"]
                elif served is None:
                    state, reason = "UNAVAILABLE", "not loaded yet (load it)"
                elif served.sha256 != on_disk.sha256:
                    state, reason = "READY", "the artifact on disk changed: load it again"
                else:
                    state, reason = "READY", ""
                rows.append({"name": name, "version": version, "state": state, "reason": reason})
            for key, why in sorted(failed.items()):
                if key.startswith(f"{name}/"):
                    version = key.split("/", 1)[1]
                    state = "UNAVAILABLE"
                    if name not in self.unloaded and self.get(name, version) is not None:
                        # Served from the bytes verified when it was loaded, not the files.
                        state, why = (
                            "READY",
                            f"the files on disk no longer verify ({why}); the copy verified "
                            "when it was loaded answers until the next load refuses it",
                        )
                    rows.append({"name": name, "version": version, "state": state, "reason": why})
        return rows

    def all(self) -> list[ModelEntry]:
        """Every served model version."""
        return [e for versions in self.entries.values() for e in versions.values()]

    def versions(self, name: str) -> list[ModelEntry]:
        """The versions of a model, oldest first (numeric-aware order)."""
        return sorted(self.entries.get(name, {}).values(), key=lambda e: _version_key(e.version))

    def get(self, name: str, version: str | None = None) -> ModelEntry | None:
        """A model version, or the latest one (``None`` or ``"latest"``)."""
        versions = self.versions(name)
        if not versions:
            return None
        if version in (None, "latest"):
            return versions[-1]
        return self.entries[name].get(version)
