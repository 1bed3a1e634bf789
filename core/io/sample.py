"""A sample as read from a file (:class:`Sample`), and what reading one may allocate
(:class:`ReadLimits`): the types every reader of :mod:`.readers` returns and obeys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..errors import SizeLimitError

__all__ = ["NO_LIMITS", "ReadLimits", "Sample"]


@dataclass(frozen=True)
class ReadLimits:
    """What reading one sample may allocate; each bound is checked before allocating.

    Attributes
    ----------
    max_decoded_bytes : int, optional
        A compressed stream may inflate to at most this many bytes, and the cells may
        take at most this many bytes as float64 (what a header or the rows of a text
        file declare, before they are decoded).
    max_cells : int, optional
        Rows (cells) of the sample.
    max_columns : int, optional
        Columns (markers and other channels) of the sample.
    """

    max_decoded_bytes: int | None = None
    max_cells: int | None = None
    max_columns: int | None = None

    def check_shape(self, rows: int, columns: int, source: str, declared: str = "") -> None:
        """Refuse a sample of ``rows`` x ``columns`` cells beyond the limits.

        Raises
        ------
        SizeLimitError
            Naming the limit and what declared the size (``declared``: e.g. "its header").
        """
        by = f" ({declared})" if declared else ""
        if self.max_columns is not None and columns > self.max_columns:
            raise SizeLimitError(
                f"{source}: {columns} columns{by}, more than the limit of {self.max_columns}"
            )
        if self.max_cells is not None and rows > self.max_cells:
            raise SizeLimitError(
                f"{source}: {rows} cells{by}, more than the limit of {self.max_cells} per bag"
            )
        size = rows * columns * 8
        if self.max_decoded_bytes is not None and size > self.max_decoded_bytes:
            raise SizeLimitError(
                f"{source}: {rows} x {columns} cells{by} take {size} bytes decoded, more than "
                f"the decoded-size limit of {self.max_decoded_bytes} bytes"
            )


#: No limit at all (trusted files: training data, the command line).
NO_LIMITS = ReadLimits()


@dataclass(frozen=True)
class Sample:
    """One bag of cells read from a file.

    Attributes
    ----------
    points : ndarray of shape (n_cells, n_columns)
    names : list of str
        Display name of each column (``$PnS`` if set, else ``$PnN``, or the CSV header).
    alt_names : list of str
        A second name per column (``$PnN`` for FCS), also accepted when matching.
    source : str
        Where it came from (file name).
    spillover : str, optional
        The FCS file's spillover keyword as written (``$SPILLOVER``, else ``SPILL``,
        else ``$COMP``), parsed only when a model compensates with it (a broken keyword
        then fails only the models that need it).
    file_name : str, optional
        The name the file gives itself (FCS ``$FIL``): a sample sent without a name is
        known by it.
    acquired : str, optional
        When the instrument acquired it (FCS ``$BEGINDATETIME``, else ``$DATE`` and
        ``$BTIM``), ISO 8601: with its zone when the file gives one, else local time
        without a zone (``2012-12-02T09:45:26``), or a date alone.
    """

    points: NDArray[np.float64]
    names: list[str]
    alt_names: list[str]
    source: str
    spillover: str | None = None
    file_name: str | None = None
    acquired: str | None = None
