"""A drop folder's sample files, and reading one of them as hostile input.

The folder is shared with instruments, copy jobs and people: a file may still be
arriving, may be a symlink to anything on the machine, a FIFO that blocks whoever opens
it, or larger than anything a service would accept. Nothing here follows a link or
reads a file that is not a complete, regular file of the folder itself:

* :func:`list_folder` lists the entries without following links (``lstat``): a symlink
  or a non-regular file with a sample's name is an :class:`Entry` with a ``refusal``;
* :func:`read_settled` reads a regular file only when it has not changed for ``settle``
  seconds (its modification and status-change times: the latter no tool can set back),
  opened without following a link swapped in meanwhile, at most ``max_bytes`` bytes,
  unchanged while read, and, for FCS, holding every segment it declares
  (:func:`bagserve.core.io.completeness.incomplete`). A file that is not ready raises
  :class:`NotReady` (it is tried again later, never given a row).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..core.io.completeness import incomplete
from ..core.io.readers import SUPPORTED_SUFFIXES

__all__ = ["Entry", "Incomplete", "NotReady", "Refused", "list_folder", "read_settled"]


class NotReady(Exception):
    """The file is still being written, or incomplete: try it again later."""


class Incomplete(NotReady):
    """Unchanged for ``settle`` seconds, yet shorter than it declares: try it again
    when it changes."""


class Refused(Exception):
    """The file is not read at all (its row's error says why)."""


@dataclass(frozen=True)
class Entry:
    """One sample file of the folder, as listed (links not followed).

    Attributes
    ----------
    name : str
        Its name in the folder (the table's ``id``).
    path : Path
    mark : tuple of int
        Size, modification and status-change times (ns), inode: any change of the
        file changes it.
    changed : float
        When it last changed (the later of its modification and status-change times),
        seconds since the epoch.
    refusal : str or None
        ``refused: symlink`` or ``refused: not a regular file``: never opened.
    """

    name: str
    path: Path
    mark: tuple[int, int, int, int]
    changed: float
    refusal: str | None = None


def _is_sample_name(name: str) -> bool:
    lower = name.lower()
    if lower.startswith(".") or lower.endswith((".part", ".tmp")):
        return False
    return lower.endswith(SUPPORTED_SUFFIXES)


def _mark(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def list_folder(folder: Path, exclude: Path | None = None) -> list[Entry]:
    """The entries of ``folder`` with a sample file's name (by suffix, as
    :func:`~bagserve.core.io.read_sample` reads them), sorted by name; hidden and
    partial files (``.name``, ``*.part``, ``*.tmp``) and ``exclude`` (the output
    table) are left out. Links are not followed: a symlink is listed with its refusal."""
    skip = None
    if exclude is not None:
        try:
            st = os.stat(exclude)
        except OSError:
            pass
        else:
            skip = (st.st_dev, st.st_ino)
    out = []
    with os.scandir(folder) as it:
        for item in it:
            if not _is_sample_name(item.name):
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone since it was listed
            if skip == (st.st_dev, st.st_ino):
                continue
            refusal = None
            if stat.S_ISLNK(st.st_mode):
                refusal = "refused: symlink"
            elif not stat.S_ISREG(st.st_mode):
                refusal = "refused: not a regular file"
            changed = max(st.st_mtime_ns, st.st_ctime_ns) / 1e9
            out.append(Entry(item.name, Path(item.path), _mark(st), changed, refusal))
    return sorted(out, key=lambda e: e.name)


def read_settled(entry: Entry, *, settle: float, max_bytes: int, now: float) -> bytes:
    """The bytes of a complete regular file of the folder.

    Parameters
    ----------
    entry : Entry
        As :func:`list_folder` listed it.
    settle : float
        Seconds the file must have been unchanged.
    max_bytes : int
        The largest file read (the service's body limit).
    now : float
        The current time (seconds since the epoch).

    Raises
    ------
    NotReady
        Changed less than ``settle`` seconds ago, changed since it was listed or
        while it was read; :class:`Incomplete`: an FCS file shorter than its segments.
    Refused
        A symlink or non-regular file (swapped in since it was listed), or larger
        than ``max_bytes``.
    """
    age = now - entry.changed
    if age < settle:
        raise NotReady(f"still being written (changed {age:.1f} s ago)")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(entry.path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused("refused: symlink") from None
        if exc.errno == errno.ENOENT:
            raise NotReady("gone since it was listed") from None
        raise Refused(f"refused: cannot open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("refused: not a regular file")
        if _mark(st) != entry.mark:
            raise NotReady("changed since it was listed")
        if st.st_size > max_bytes:
            raise Refused(f"refused: {st.st_size} bytes, more than the limit of {max_bytes} bytes")
        data = _read_all(fd, st.st_size)
        if len(data) != st.st_size or _mark(os.fstat(fd)) != entry.mark:
            raise NotReady("changed while it was read")
    finally:
        os.close(fd)
    why = incomplete(data, entry.name)
    if why is not None:
        raise Incomplete(f"incomplete: {why}")
    return data


def _read_all(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes and one more (a file that grew shows it)."""
    chunks = []
    left = size + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
