"""Model artifacts: a directory of plain arrays plus a manifest, safe to load.

Layout of an artifact written by :func:`save`::

    model/
      manifest.json        format version, estimator class and parameters, fitted state
                           (JSON), metadata (panel, preprocessing, training data sha256,
                           metrics, ...), library versions, creation time, the sha256 of
                           every other file, and the sha256 of the manifest itself
      arrays/<name>.npy    every fitted array, read with allow_pickle=False

Loading instantiates only classes of a fixed registry (the core's estimators and
representations), never code named by the file, checks every hash, and refuses a
tampered, truncated or newer-format artifact with :class:`ArtifactError`. Arrays are
stored bit for bit, so a loaded model reproduces the saved model's predictions exactly.

What a model computes with is what was verified: :func:`read_verified` reads the
manifest and every array file once into memory (:mod:`core.sealing`), hashes those
bytes, and the arrays are built over them; the files are never read or mapped again,
so changing, truncating or replacing them afterwards changes no answer. With
``mmap=True`` that memory is a sealed anonymous memory file that other processes map
read-only (the service's workers share one copy of each model).

Writes are atomic and durable (:func:`core.atomic.atomic_directory`): the artifact is
assembled in a temporary sibling directory, synced to disk and renamed into place; an
existing artifact is never half-overwritten.

A pickle (joblib) export exists for models outside the registry, behind an explicit
``trusted`` flag on both ends: loading a pickle can run arbitrary code.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import platform
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .atomic import atomic_directory
from .errors import ArtifactError
from .estimator_state import (
    ALIGNMENT,
    StateDecoder,
    StateEncoder,
    aligned,
    canonical_alignment,
    registry,
)
from .hashing import canonical_json, file_sha256, json_sha256
from .sealing import MemoryWriter, SealedMemory, npy_array, shared_memory_available

# Imported where a model is saved, loaded or aligned: reading and verifying a manifest
# (``bagserve models list``, the service's registry) needs neither scikit-learn nor scipy.
if TYPE_CHECKING:
    pass

__all__ = [
    "FORMAT_VERSION",
    "ArtifactError",
    "VerifiedArtifact",
    "load",
    "load_verified",
    "read_manifest",
    "read_verified",
    "save",
]

#: Version of the artifact layout; loading refuses anything newer.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ARRAY_DIR = "arrays"
PICKLE_FILE = "model.joblib"
#: Bytes of a model file read (and hashed, and put in memory) at a time.
_READ_CHUNK = 1 << 18


# ----------------------------------------------------------------------- files
def _canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes the manifest's own hash covers: all of it but that hash."""
    return canonical_json(manifest, exclude=("manifest_sha256",))


def _manifest_sha256(manifest: dict[str, Any]) -> str:
    """The hash a manifest carries of itself (``manifest_sha256``)."""
    return json_sha256(manifest, exclude=("manifest_sha256",))


def library_versions() -> dict[str, str]:
    import scipy
    import sklearn

    from .. import __version__

    return {
        "bagserve": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "scikit-learn": sklearn.__version__,
    }


def _json_safe(value: Any, where: str) -> Any:
    """Metadata must be plain JSON (numbers, strings, lists, dicts)."""
    try:
        text = json.dumps(value, allow_nan=False, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"metadata {where!r} is not JSON-serialisable: {exc}") from exc
    return json.loads(text)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


def save(
    model: Any,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    pickle: bool = False,
    trusted: bool = False,
    extra_files: dict[str, bytes] | None = None,
    **metadata: Any,
) -> Path:
    """Write ``model`` as an artifact directory at ``path``, atomically.

    Parameters
    ----------
    model : estimator or representation of the core (fitted), or any object with
        ``pickle=True, trusted=True``.
    path : path
        Directory to create. An existing one is replaced only with ``overwrite=True``,
        and then only after the new artifact is complete.
    pickle, trusted : bool
        Export with joblib (needs ``trusted=True``, and ``load(..., trusted=True)``).
    extra_files : dict of str to bytes, optional
        More files stored (and hashed) in the artifact, e.g. a training report under
        ``report/``. Paths are relative and may not leave the artifact.
    **metadata
        Stored in the manifest: conventionally ``name``, ``version``, ``panel`` (marker
        names in input order), ``preprocessing``, ``training_data_sha256``,
        ``metrics``, ``description``. Values must be JSON.

    Returns
    -------
    Path
        The artifact directory.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise ArtifactError(f"{path} already exists (pass overwrite=True to replace it)")
    meta = {k: _json_safe(v, k) for k, v in metadata.items()}
    if pickle and not trusted:
        raise ArtifactError("pickle export runs code at load time: pass trusted=True to confirm")
    with atomic_directory(path, overwrite=overwrite) as tmp:
        files: dict[str, str] = {}
        if pickle:
            import joblib

            joblib.dump(model, tmp / PICKLE_FILE)
            files[PICKLE_FILE] = file_sha256(tmp / PICKLE_FILE)
            estimator = {"class": type(model).__name__, "format": "joblib"}
            state = None
        else:
            from sklearn.base import BaseEstimator

            if not (isinstance(model, BaseEstimator) and type(model).__name__ in registry()):
                raise ArtifactError(
                    f"{type(model).__name__} is not one of the core's estimators; "
                    "use pickle=True, trusted=True to export it with joblib"
                )
            if not any(k.endswith("_") and not k.startswith("_") for k in vars(model)):
                raise ArtifactError(f"{type(model).__name__} is not fitted")
            enc = StateEncoder()
            state = enc.estimator(model, "model")
            (tmp / ARRAY_DIR).mkdir()
            for name, arr in enc.arrays.items():
                rel = f"{ARRAY_DIR}/{name}.npy"
                np.save(tmp / rel, arr, allow_pickle=False)
                files[rel] = file_sha256(tmp / rel)
            estimator = {"class": type(model).__name__, "format": "arrays"}
        for rel, content in (extra_files or {}).items():
            target = (tmp / rel).resolve()
            if tmp.resolve() not in target.parents or rel in (MANIFEST, PICKLE_FILE, *files):
                raise ArtifactError(
                    f"extra file {rel!r} would leave the artifact or replace a model file"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            files[rel] = file_sha256(target)
        manifest: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "estimator": estimator,
            "model": state,
            "metadata": meta,
            "libraries": library_versions(),
            "files": files,
        }
        manifest["manifest_sha256"] = _manifest_sha256(manifest)
        # Inside the temporary directory a plain write suffices: atomic_directory syncs
        # every file before the directory is renamed into place.
        (tmp / MANIFEST).write_text(
            json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8"
        )
    if not pickle:
        # The model in memory and every loaded copy then compute bit for bit alike.
        canonical_alignment(model)
    return path


def _parse_manifest(path: Path, text: bytes) -> dict[str, Any]:
    """An artifact's manifest from its bytes, its format checked (not yet its hash)."""
    mpath = path / MANIFEST
    try:
        manifest = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{mpath}: unreadable manifest ({exc})") from exc
    if not isinstance(manifest, dict) or "format_version" not in manifest:
        raise ArtifactError(f"{mpath}: not a bagserve manifest")
    fv = manifest["format_version"]
    if not isinstance(fv, int) or fv > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format {fv!r} is newer than this bagserve reads "
            f"({FORMAT_VERSION}); upgrade bagserve"
        )
    if not isinstance(manifest.get("files", {}), dict):
        raise ArtifactError(f"{mpath}: not a bagserve manifest (files is not a mapping)")
    return manifest


def _open_regular(path: Path) -> io.FileIO:
    """``path`` opened for reading if it is a regular file: a pipe or a device put in
    an artifact's place would block or never end a read (opened without waiting for
    a writer, then checked, so that no swap in between goes unnoticed)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArtifactError(f"{path}: not a regular file")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return io.FileIO(fd, "rb", closefd=True)


def _read_manifest_bytes(path: Path) -> bytes:
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{path}: no {MANIFEST} (not a bagserve model artifact)")
    try:
        with _open_regular(mpath) as f:
            return f.readall()
    except OSError as exc:
        raise ArtifactError(f"{mpath}: unreadable manifest ({exc})") from exc


def _check_manifest_hash(path: Path, manifest: dict[str, Any]) -> None:
    if manifest.get("manifest_sha256") != _manifest_sha256(manifest):
        raise ArtifactError(f"{path / MANIFEST}: manifest was modified after it was written")


def _mismatch(path: Path, rel: str) -> ArtifactError:
    return ArtifactError(f"{path}: file {rel} does not match its sha256 (tampered or truncated)")


def read_manifest(path: str | os.PathLike[str], *, verify: bool = True) -> dict[str, Any]:
    """The manifest of an artifact, after checking its format and (by default) every hash.

    It says what the files on disk hold now; a model is computed from what
    :func:`read_verified` read and verified, never from a second read of the files.

    Raises
    ------
    ArtifactError
        Missing or unreadable manifest, newer format, edited manifest, a missing,
        extra-truncated or modified file.
    """
    path = Path(path)
    manifest = _parse_manifest(path, _read_manifest_bytes(path))
    if verify:
        _check_manifest_hash(path, manifest)
        for rel, digest in manifest.get("files", {}).items():
            f = path / rel
            if not f.is_file():
                raise ArtifactError(f"{path}: file {rel} is missing")
            if file_sha256(f) != digest:
                raise _mismatch(path, rel)
    return manifest


@dataclass(frozen=True, eq=False)
class VerifiedArtifact:
    """An artifact's manifest and model files as read once and verified, in memory.

    Built by :func:`read_verified` (or, in another process, :meth:`attach`); loaded
    by :func:`load_verified`. Nothing here reads the artifact's files again.

    Attributes
    ----------
    path : Path
        Where the artifact was read from (for names and messages only).
    manifest : dict
        The manifest, parsed from the bytes in :attr:`memory`.
    memory : SealedMemory
        The manifest's and the model files' bytes (arrays, or the pickle), one after
        the other, each starting at a multiple of :data:`ALIGNMENT`.
    places : dict of str to (int, int)
        Each of those files' offset and size in :attr:`memory`, by relative path.
    digests : dict of str to str
        The sha256 of each of those files' bytes, as read (``manifest.json`` too: a
        signature's digests are compared with them).
    """

    path: Path
    manifest: dict[str, Any] = field(repr=False)
    memory: SealedMemory = field(repr=False)
    places: Mapping[str, tuple[int, int]] = field(repr=False)
    digests: Mapping[str, str] = field(repr=False)

    @property
    def sha256(self) -> str:
        """The manifest's own digest (it covers every file of the artifact)."""
        return str(self.manifest["manifest_sha256"])

    def file(self, rel: str) -> memoryview:
        """The bytes of one of the files read (read-only when shared)."""
        if self.memory.view is None:
            raise ArtifactError(f"{self.path}: its verified bytes are not mapped in this process")
        offset, size = self.places[rel]
        return self.memory.view[offset : offset + size]

    def handle(self) -> tuple[dict[str, Any], list[int]]:
        """What another process needs to :meth:`attach` this artifact: a small
        description and the descriptors to pass with it (the sealed memory file; its
        bytes themselves in the description where memory is private)."""
        spec: dict[str, Any] = {
            "path": str(self.path),
            "size": self.memory.size,
            "places": dict(self.places),
            "digests": dict(self.digests),
        }
        if self.memory.fd is not None:
            return spec, [self.memory.fd]
        if self.memory.view is None:
            raise ArtifactError(f"{self.path}: its verified bytes are gone")
        return {**spec, "data": bytes(self.memory.view)}, []

    @classmethod
    def attach(cls, spec: Mapping[str, Any], fds: list[int]) -> VerifiedArtifact:
        """The artifact another process verified (see :meth:`handle`), mapped here
        read-only; takes the descriptors over.

        Raises
        ------
        ArtifactError
            The memory is not sealed, or does not hold the manifest it names.
        """
        path, size = Path(spec["path"]), int(spec["size"])
        try:
            if fds:
                memory = SealedMemory.attach(fds[0], size)
            else:
                writer = MemoryWriter(size, shared=False)
                writer.write(0, spec["data"])
                memory = writer.finish()
        except ValueError as exc:
            raise ArtifactError(f"{path}: {exc}") from exc
        places = {rel: (int(o), int(n)) for rel, (o, n) in spec["places"].items()}
        offset, length = places[MANIFEST]
        assert memory.view is not None
        manifest = _parse_manifest(path, bytes(memory.view[offset : offset + length]))
        return cls(path, manifest, memory, places, dict(spec["digests"]))


def _model_files(manifest: dict[str, Any]) -> list[str]:
    """The files a model is computed from: its arrays (or its pickle)."""
    return [
        rel
        for rel in manifest.get("files", {})
        if rel.startswith(f"{ARRAY_DIR}/") or rel == PICKLE_FILE
    ]


def read_verified(
    path: str | os.PathLike[str], *, shared: bool = False, mapped: bool = True
) -> VerifiedArtifact:
    """Read an artifact's manifest and model files once into memory and verify those
    bytes: the manifest's own hash, and every model file's sha256 (the other files,
    such as a training report, are hashed on disk as :func:`read_manifest` does).

    Parameters
    ----------
    path : path
    shared : bool, default=False
        Put the bytes in a sealed anonymous memory file that other processes can map
        (:meth:`VerifiedArtifact.handle`); else (and where there are no such files)
        in memory of this process.
    mapped : bool, default=True
        With ``shared``: keep the memory mapped in this process (to load the model
        here); ``False`` for a process that only hands it on.

    Raises
    ------
    ArtifactError
        As :func:`read_manifest`; also a file that changed size while it was read.
    """
    path = Path(path)
    text = _read_manifest_bytes(path)
    manifest = _parse_manifest(path, text)
    _check_manifest_hash(path, manifest)
    files: dict[str, str] = manifest.get("files", {})
    model_files = _model_files(manifest)
    for rel in sorted(set(files) - set(model_files)):
        if not (path / rel).is_file():
            raise ArtifactError(f"{path}: file {rel} is missing")
        if file_sha256(path / rel) != files[rel]:
            raise _mismatch(path, rel)
    places: dict[str, tuple[int, int]] = {}
    end = 0
    for rel in [MANIFEST, *model_files]:
        if rel == MANIFEST:
            size = len(text)
        else:
            try:
                size = (path / rel).stat().st_size
            except OSError:
                raise ArtifactError(f"{path}: file {rel} is missing") from None
        start = -(-end // ALIGNMENT) * ALIGNMENT
        places[rel] = (start, size)
        end = start + size
    writer = MemoryWriter(end, shared=shared and shared_memory_available())
    try:
        writer.write(0, text)
        digests = {MANIFEST: hashlib.sha256(text).hexdigest()}
        chunk = memoryview(bytearray(_READ_CHUNK))
        for rel in model_files:
            offset, size = places[rel]
            digest, got = hashlib.sha256(), 0
            try:
                with _open_regular(path / rel) as f:
                    while got < size:
                        n = f.readinto(chunk[: min(_READ_CHUNK, size - got)])
                        if not n:
                            break
                        # Hashed, then written: the memory holds exactly what was hashed
                        # (no one else has it before it is sealed).
                        digest.update(chunk[:n])
                        writer.write(offset + got, chunk[:n])
                        got += n
            except OSError as exc:
                raise ArtifactError(f"{path}: file {rel} is unreadable ({exc})") from exc
            digests[rel] = digest.hexdigest()
            if got < size or digests[rel] != files[rel]:
                raise _mismatch(path, rel)
        memory = writer.finish(mapped=mapped)
    except BaseException:
        writer.discard()
        raise
    return VerifiedArtifact(path, manifest, memory, places, digests)


def load_verified(verified: VerifiedArtifact, *, trusted: bool = False) -> Any:
    """The model of an artifact read by :func:`read_verified`, computed from its
    verified bytes in memory (read-only arrays where the memory is shared).

    Raises
    ------
    ArtifactError
        A pickle artifact without ``trusted``, an unknown format, an array the
        manifest does not list, or an array file numpy would not read.
    """
    path, manifest = verified.path, verified.manifest
    fmt = manifest["estimator"].get("format")
    if fmt == "joblib":
        if not trusted:
            raise ArtifactError(
                f"{path} is a pickle (joblib) artifact: loading it can run arbitrary code; "
                "pass trusted=True only for files you created"
            )
        import joblib

        return joblib.load(io.BytesIO(verified.file(PICKLE_FILE)))
    if fmt != "arrays":
        raise ArtifactError(f"{path}: unknown artifact format {fmt!r}")

    def load_array(name: str) -> np.ndarray:
        rel = f"{ARRAY_DIR}/{name}.npy"
        if rel not in verified.places:
            raise ArtifactError(f"{path}: manifest refers to an unlisted array {name!r}")
        try:
            array = npy_array(verified.file(rel))
        except ValueError as exc:
            raise ArtifactError(f"{path}: array {rel} is unreadable ({exc})") from exc
        # The NPY format puts data at multiples of 64 and every file starts at one
        # here: a copy only for a file written otherwise.
        return aligned(array)

    return StateDecoder(load_array).estimator(manifest["model"])


def load(path: str | os.PathLike[str], *, mmap: bool = False, trusted: bool = False) -> Any:
    """Load an artifact written by :func:`save`, computed from its files' bytes as
    read once and verified (:func:`read_verified`).

    Parameters
    ----------
    path : path
    mmap : bool, default=False
        Hold the arrays in a sealed anonymous memory file, read-only, that other
        processes can share; else in memory of this process. Either way the files
        are never mapped: changing them afterwards changes nothing loaded.
    trusted : bool, default=False
        Allow a joblib (pickle) artifact; never set it for files of unknown origin.

    Returns
    -------
    The fitted model; its manifest is available through :func:`read_manifest`.
    """
    return load_verified(read_verified(path, shared=mmap), trusted=trusted)
