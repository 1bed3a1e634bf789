"""CSV that a spreadsheet opens as data, never as formulas.

Excel, LibreOffice and Google Sheets run a cell that starts with ``=``, ``+``, ``-`` or
``@`` as a formula (and some take a leading tab or carriage return the same way). A bag
id, a file name or a class label comes from whoever sent the request: written as it is,
``=cmd|' /C calc'!A0`` becomes a live formula on the lab's desktop. OWASP's rule ("CSV
Injection") is applied to every text cell: such a cell gets a leading single quote,
which spreadsheets show as text. Numbers are written as they are, and so is text that
is a plain decimal number (``-1``, ``+2.5e3``), which a spreadsheet reads as that
number and nothing else.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from typing import Any, TextIO

__all__ = ["SafeWriter", "safe_cell"]

#: What OWASP lists as the start of a formula (or of its hiding place).
_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def safe_cell(value: Any) -> Any:
    """``value``, with a leading ``'`` if it is text a spreadsheet would run.

    Examples
    --------
    >>> safe_cell("=1+2"), safe_cell("-1.5"), safe_cell(-1.5), safe_cell("CD4+ T")
    ("'=1+2", '-1.5', -1.5, 'CD4+ T')
    """
    if (
        isinstance(value, str)
        and value.startswith(_TRIGGERS)
        and not _PLAIN_NUMBER.fullmatch(value)
    ):
        return "'" + value
    return value


class SafeWriter:
    """A :func:`csv.writer` whose every text cell passes :func:`safe_cell`.

    Parameters
    ----------
    stream : text stream
    **options
        As for :func:`csv.writer` (``lineterminator``, ``delimiter``).
    """

    def __init__(self, stream: TextIO, **options: Any) -> None:
        self._writer = csv.writer(stream, **options)

    def writerow(self, row: Iterable[Any]) -> None:
        self._writer.writerow([safe_cell(v) for v in row])

    def writerows(self, rows: Iterable[Iterable[Any]]) -> None:
        for row in rows:
            self.writerow(row)
