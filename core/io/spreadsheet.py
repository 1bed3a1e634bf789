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

import re
from collections.abc import Iterable
from typing import Any, TextIO

__all__ = ["SafeWriter", "safe_cell"]

#: What OWASP lists as the start of a formula (or of its hiding place).
_TRIGGERS = ("=", "+", "-", "@", "\t", "\r", "\n")
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
    """Writes CSV rows (RFC 4180 quoting) whose every text cell passes :func:`safe_cell`.

    A cell is quoted when it holds the delimiter, a double quote, a carriage return or a
    line feed, whatever the line terminator. :func:`csv.writer` quotes only the
    characters of its own terminator: with ``"\n"`` a bare carriage return went out
    unquoted, and a spreadsheet that ends rows there read the rest of the cell as a new
    row's first cell, a formula (``"\r=HYPERLINK(...)"``).

    Parameters
    ----------
    stream : text stream
    delimiter : str, default=","
    lineterminator : str, default="\r\n"
    """

    def __init__(
        self, stream: TextIO, *, delimiter: str = ",", lineterminator: str = "\r\n"
    ) -> None:
        self._stream = stream
        self._delimiter = delimiter
        self._end = lineterminator
        self._special = re.compile("[" + re.escape(delimiter) + '"\r\n]')

    def _field(self, value: Any) -> str:
        text = "" if value is None else str(safe_cell(value))
        if self._special.search(text):
            return '"' + text.replace('"', '""') + '"'
        return text

    def writerow(self, row: Iterable[Any]) -> None:
        fields = [self._field(v) for v in row]
        # One empty cell is written quoted, so that the row is not read as no row.
        line = '""' if fields == [""] else self._delimiter.join(fields)
        self._stream.write(line + self._end)

    def writerows(self, rows: Iterable[Iterable[Any]]) -> None:
        for row in rows:
            self.writerow(row)
