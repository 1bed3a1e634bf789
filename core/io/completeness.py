"""Whether a sample file that is still arriving holds everything it declares.

A cytometer or a copy writes an export in pieces; a drop folder sees the file before its
last byte. A CSV cut short is still a CSV (of fewer cells), so for text formats only
time tells (``bagserve batch --settle``). An FCS file says how long it is: its HEADER
gives the byte offsets of the TEXT, DATA and ANALYSIS segments (FCS 3.1, section 3.1),
and for segments past the header's eight digits, TEXT gives them (``$BEGINDATA``,
``$ENDDATA``, ``$BEGINANALYSIS``, ``$ENDANALYSIS``). A file shorter than its last
declared segment is not complete yet.
"""

from __future__ import annotations

__all__ = ["incomplete"]

#: FCS HEADER: the version (6 bytes), 4 spaces, then six offsets of 8 ASCII digits.
_HEADER = 58
_TEXT_KEYS = (b"$BEGINDATA", b"$ENDDATA", b"$BEGINANALYSIS", b"$ENDANALYSIS")


def incomplete(data: bytes | memoryview, name: str) -> str | None:
    """Why ``data`` is not yet the whole file, or None when nothing shows it.

    Parameters
    ----------
    data : bytes-like
        The file's bytes as read so far.
    name : str
        The file's name: FCS files (``.fcs``, or an ``FCS`` magic) are checked.

    Returns
    -------
    str or None
        For an FCS file shorter than a segment it declares: which, and how long the
        file is. None for complete files, other formats, and files too broken to say
        (their reader names the problem).
    """
    view = memoryview(data).cast("B")
    if not (name.lower().endswith(".fcs") or bytes(view[:3]) == b"FCS"):
        return None
    size = len(view)
    if size < _HEADER:
        return f"{size} bytes, fewer than the 58 of an FCS HEADER"
    offsets = []
    for k in range(6):
        field = bytes(view[10 + 8 * k : 18 + 8 * k]).strip()
        if field and not field.isdigit():
            return None  # not an offset: a broken header, the reader says so
        offsets.append(int(field or 0))
    text_start, text_end = offsets[0], offsets[1]
    if text_end >= size:
        return f"its TEXT segment ends at byte {text_end}; the file has {size} bytes"
    ends = {"DATA": offsets[3], "ANALYSIS": offsets[5]}
    if text_end > text_start:
        declared = _text_offsets(bytes(view[text_start : text_end + 1]))
        for segment in ("DATA", "ANALYSIS"):
            end = declared.get(f"$END{segment}".encode())
            if end is not None and not ends[segment]:
                ends[segment] = end
    for segment, end in ends.items():
        if end >= size:
            return f"its {segment} segment ends at byte {end}; the file has {size} bytes"
    return None


def _text_offsets(text: bytes) -> dict[bytes, int]:
    """The segment offsets a TEXT segment gives (keywords upper case, with ``$``)."""
    if len(text) < 2:
        return {}
    delimiter = text[:1]
    # A delimiter inside a value is written twice (FCS 3.1, 3.2.8): keep it whole.
    body = text[1:].replace(delimiter * 2, b"\0")
    parts = body.split(delimiter)
    out: dict[bytes, int] = {}
    for key, value in zip(parts[0::2], parts[1::2], strict=False):
        key = key.strip().upper()
        if key in _TEXT_KEYS and value.strip().isdigit():
            out[key] = int(value.strip())
    return out
