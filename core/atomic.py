"""Atomic, durable writes: a reader sees the old file or the new one, never a mix.

A plain ``open(path, "w")`` truncates first and writes next, so a crash, a full disk or
a concurrent reader in between sees an empty or half-written file, and even a complete
write can sit in the page cache for seconds after the program reports success. Here:

* :func:`atomic_write_bytes`, :func:`atomic_write_text`, :func:`atomic_write_json`
  write a temporary file in the target's directory, flush and ``fsync`` it, rename it
  over the target with :func:`os.replace` (atomic within one file system, which is why
  the temporary file is a sibling and not in ``/tmp``), then ``fsync`` the directory so
  that the rename itself survives a power cut.
* :func:`atomic_directory` does the same for a directory of files built together
  (a model artifact): the files are written into a temporary sibling directory, synced,
  and the directory is renamed into place only once complete.

On any failure the temporary file or directory is removed and the target is left as it
was. Temporary names start with ``.`` and contain ``.tmp-``, so that directory listings
(``models/*/*``) skip them and a leftover from a killed process is recognisable.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "fsync_directory",
    "fsync_tree",
]


def _sibling(path: Path, kind: str) -> Path:
    """A fresh hidden name next to ``path`` (same directory, hence same file system)."""
    return path.parent / f".{path.name}.{kind}-{uuid.uuid4().hex}"


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (names created, renamed or removed) to disk.

    ``fsync`` of a file makes its contents durable, not its name: after a rename, the
    directory holding the new name must be synced too.

    Parameters
    ----------
    path : path-like
        The directory.

    Raises
    ------
    OSError
        The directory cannot be opened or synced.
    """
    if os.name == "nt":  # pragma: no cover - Windows cannot open a directory to sync it
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """``fsync`` every file and directory under ``path`` (``path`` included).

    For files written by code that does not sync them (``numpy.save``,
    ``joblib.dump``), before the tree is published with a rename.

    Parameters
    ----------
    path : path-like
        A directory.
    """
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(root)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> Path:
    """Replace the file at ``path`` with ``data``, atomically and durably.

    The bytes go to a temporary file in the same directory, which is flushed, synced,
    renamed over ``path`` and followed by a sync of the directory. Readers see either
    the old contents or the new, never a truncated file; after a crash the file holds
    one or the other.

    Parameters
    ----------
    path : path-like
        The file to create or replace; its directory must exist. A file replaced keeps
        its permission bits; a new one gets the usual ``0o666`` minus the umask (not
        the ``0o600`` of :mod:`tempfile`), as ``open(path, "w")`` would give it. A
        symbolic link at ``path`` is replaced by the file, not written through.
    data : bytes, bytearray or memoryview
        The new contents.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    OSError
        The file could not be written, synced or renamed; ``path`` is then unchanged
        and no temporary file is left.
    """
    path = Path(path)
    tmp = _sibling(path, "tmp")
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode is not None and os.chmod in os.supports_fd:
                os.chmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_directory(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> Path:
    """Replace the file at ``path`` with ``text``, atomically and durably.

    As :func:`atomic_write_bytes`; line endings are written as they are in ``text``
    (no translation to the platform's).

    Parameters
    ----------
    path : path-like
        The file to create or replace; its directory must exist.
    text : str
        The new contents.
    encoding : str, default="utf-8"

    Returns
    -------
    Path
        ``path``.
    """
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike[str], doc: Any, **dumps_kwargs: Any) -> Path:
    """Replace the file at ``path`` with ``doc`` as JSON, atomically and durably.

    The document is serialised completely before the file is touched, so a value that
    is not JSON (``TypeError``, ``ValueError``) leaves ``path`` as it was.

    Parameters
    ----------
    path : path-like
        The file to create or replace; its directory must exist.
    doc : object
        Anything :func:`json.dumps` accepts with ``dumps_kwargs``.
    **dumps_kwargs
        Passed to :func:`json.dumps` (``indent``, ``sort_keys``, ``default``, ...). No
        newline is added after the document.

    Returns
    -------
    Path
        ``path``.
    """
    return atomic_write_text(path, json.dumps(doc, **dumps_kwargs))


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary name and publish it at ``path`` when complete.

    The ``with`` block writes into the yielded temporary directory (a hidden sibling of
    ``path``). When the block ends without an exception, every file in it is synced,
    the directory is renamed to ``path`` and the parent directory is synced. When the
    block raises, the temporary directory is removed and ``path`` is left as it was.

    Parameters
    ----------
    path : path-like
        Where the directory is published. Missing parent directories are created.
    overwrite : bool, default=False
        Replace an existing ``path``: the old directory is renamed aside, the new one
        renamed in, and the old one removed, so ``path`` is never a mix of the two.
        (Between the two renames, a few microseconds, ``path`` does not exist: POSIX
        has no portable atomic exchange of two directories.)

    Yields
    ------
    Path
        The temporary directory to fill.

    Raises
    ------
    FileExistsError
        ``path`` exists and ``overwrite`` is false (checked before the block runs and
        again before publishing).

    Examples
    --------
    >>> with atomic_directory("models/demo/1") as tmp:  # doctest: +SKIP
    ...     (tmp / "arrays").mkdir()
    ...     numpy.save(tmp / "arrays" / "w.npy", w)
    """
    path = Path(path)
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if path.exists():
            if not overwrite:
                raise FileExistsError(f"{path} already exists")
            old = _sibling(path, "old")
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                # Put the old directory back: a failed publish must not lose it.
                os.rename(old, path)
                raise
            fsync_directory(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
            fsync_directory(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
