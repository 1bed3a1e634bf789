"""sha256 digests: of files, of bytes, of a sequence of chunks, of canonical JSON.

Every digest bagserve records (a model file's hash in its manifest, the manifest's own
hash, a training data set's fingerprint, an input's hash) is a lowercase hexadecimal
sha256 computed here, so that one algorithm, one encoding of text (UTF-8) and one
canonical JSON form hold everywhere. Changing any of them would make existing
artifacts fail verification: they are part of the artifact format.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Iterable, Mapping
from typing import Any

__all__ = [
    "bytes_sha256",
    "canonical_json",
    "chunks_sha256",
    "file_sha256",
    "json_sha256",
    "points_sha256",
    "text_sha256",
]

#: Bytes read at a time by :func:`file_sha256`: large enough that the hashing, not the
#: system calls, dominates; small enough that a multi-gigabyte file costs no memory.
CHUNK_SIZE = 1 << 20


def file_sha256(path: str | os.PathLike[str], *, chunk_size: int = CHUNK_SIZE) -> str:
    """sha256 of a file's bytes, read in chunks.

    Parameters
    ----------
    path : path-like
        The file.
    chunk_size : int, default=1 MiB
        Bytes read at a time; memory use does not grow with the file.

    Returns
    -------
    str
        64 lowercase hexadecimal digits.

    Raises
    ------
    OSError
        The file cannot be opened or read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk_size), b""):
            h.update(block)
    return h.hexdigest()


def bytes_sha256(data: bytes | bytearray | memoryview) -> str:
    """sha256 of bytes already in memory (a memoryview is hashed without a copy).

    Parameters
    ----------
    data : bytes, bytearray or memoryview
        Any C-contiguous buffer; its raw bytes are hashed whatever its item format.

    Returns
    -------
    str
        64 lowercase hexadecimal digits.
    """
    return hashlib.sha256(data).hexdigest()


def text_sha256(text: str) -> str:
    """sha256 of a string's UTF-8 encoding.

    Parameters
    ----------
    text : str

    Returns
    -------
    str
        64 lowercase hexadecimal digits.
    """
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def chunks_sha256(chunks: Iterable[bytes | bytearray | memoryview | str]) -> str:
    """sha256 of the concatenation of ``chunks`` (strings as UTF-8), fed one at a time.

    For a digest over several parts (names, other digests, array buffers) without
    joining them into one copy in memory. The chunks are concatenated as they are: a
    caller whose parts could run into each other (``"ab" + "c"`` and ``"a" + "bc"``)
    adds its own separators.

    Parameters
    ----------
    chunks : iterable of bytes-like or str

    Returns
    -------
    str
        64 lowercase hexadecimal digits.
    """
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk.encode("utf-8") if isinstance(chunk, str) else chunk)
    return h.hexdigest()


def canonical_json(doc: Mapping[str, Any], *, exclude: Collection[str] = ()) -> bytes:
    """The canonical JSON bytes of a document, the input of :func:`json_sha256`.

    Keys sorted, no whitespace, non-ASCII escaped (``json.dumps`` defaults otherwise):
    the same document gives the same bytes whatever the order its keys were set in and
    however it was indented on disk.

    Parameters
    ----------
    doc : mapping of str to JSON values
    exclude : collection of str, optional
        Top-level keys left out, typically the one that will hold the digest itself
        (``"manifest_sha256"``, an audit record's ``"hash"``).

    Returns
    -------
    bytes
        UTF-8 (in fact ASCII) JSON.
    """
    body = {k: v for k, v in doc.items() if k not in exclude}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def json_sha256(doc: Mapping[str, Any], *, exclude: Collection[str] = ()) -> str:
    """sha256 of :func:`canonical_json` of ``doc``: a digest a document can carry itself.

    Parameters
    ----------
    doc : mapping of str to JSON values
    exclude : collection of str, optional
        Top-level keys left out (see :func:`canonical_json`).

    Returns
    -------
    str
        64 lowercase hexadecimal digits.

    Examples
    --------
    >>> doc = {"b": 1, "a": [1, 2]}
    >>> doc["sha256"] = json_sha256(doc, exclude={"sha256"})
    >>> json_sha256(doc, exclude={"sha256"}) == doc["sha256"]
    True
    """
    return bytes_sha256(canonical_json(doc, exclude=exclude))


def points_sha256(points: Any) -> str:
    """sha256 of one bag's cells as C-ordered float64 bytes (a view when they already
    are): how a bag is recognised whatever file or request it came in."""
    import numpy as np

    flat = np.ascontiguousarray(points, dtype=np.float64).reshape(-1)
    # A byte view of the flat array: memoryview.cast refuses empty shapes (an empty bag
    # is reported as such by validation, after hashing).
    return bytes_sha256(memoryview(flat.view(np.uint8)))
