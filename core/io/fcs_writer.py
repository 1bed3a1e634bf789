"""Writing a sample back as FCS 3.1 with an extra channel (an explanation's contributions).

FlowJo, FlowKit and every cytometry tool gate on channels: a sample written with the
contribution of each cell as a channel of its own lets a person gate on "the cells that
moved this prediction" beside the channels the instrument measured. The cells are
written as read (every channel of the file, in its order, before compensation and
transforms), as 32-bit floats (``$DATATYPE F``), with ``$PnN`` and ``$PnS`` as the
file had them; flowio writes the file.
"""

from __future__ import annotations

import io
import re

import numpy as np
from numpy.typing import ArrayLike

from ..errors import DataError
from .sample import Sample

__all__ = ["fcs_with_channel"]


def fcs_with_channel(sample: Sample, name: str, values: ArrayLike) -> bytes:
    """The FCS 3.1 bytes of ``sample`` with one more channel ``name`` holding ``values``.

    Parameters
    ----------
    sample : Sample
        The cells as read (:func:`~.readers.read_sample`).
    name : str
        The new channel's ``$PnN`` (letters, digits, ``-_.``).
    values : array-like of shape (n_cells,)
        One finite value per cell, in the sample's cell order.

    Raises
    ------
    DataError
        ``values`` does not have one finite value per cell, or ``name`` is taken or not
        a plain channel name.
    """
    v = np.asarray(values, dtype=np.float64)
    n, d = sample.points.shape
    if v.shape != (n,):
        raise DataError(f"{sample.source}: {v.size} value(s) for {n} cell(s)")
    if not np.isfinite(v).all():
        raise DataError(f"{sample.source}: the {name} values are not all finite")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise DataError(f"channel name {name!r}: letters, digits, '-', '_' and '.' only")
    short = list(sample.alt_names) if len(sample.alt_names) == d else list(sample.names)
    if name in short or name in sample.names:
        raise DataError(f"{sample.source} has a channel named {name!r} already")
    import flowio

    data = np.empty((n, d + 1), dtype=np.float32)
    data[:, :d] = sample.points
    data[:, d] = v
    out = io.BytesIO()
    flowio.create_fcs(
        out,
        data.ravel(),
        [*short, name],
        opt_channel_names=[*sample.names, name],
        metadata_dict={"$FIL": f"{sample.file_name or sample.source}"},
    )
    return out.getvalue()
