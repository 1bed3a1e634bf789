"""Fluorescence compensation: undoing the spillover between a sample's channels.

A fluorochrome is also seen, at a fixed fraction, in its neighbours' detectors. With the
spillover matrix ``S`` (row ``i``: what fluorochrome ``i`` puts into each detector, 1 on
the diagonal), the measured events are ``observed = true · S`` and compensation solves
for ``true`` (Roederer 2001, *Cytometry* 45:194; FCS 3.1 ``$SPILLOVER``). The solve is
done by ``flowutils`` (the FlowKit authors' library, also behind FlowKit's
compensation), on the spillover channels only; other columns are left as measured.

:class:`Compensation` is stored in a model's preprocessing and re-applied at every
prediction, before the panel's columns are picked (a panel marker's compensated value
depends on every spillover channel, also those the panel does not use):

* ``"none"``: the values are used as they are (already compensated, or mass cytometry);
* ``"file"``: each FCS file's own matrix (``$SPILLOVER``, ``SPILL`` or ``$COMP``), as
  each acquisition has its own; a sample without one is refused;
* a matrix given once (a CSV with channel names, :func:`read_spillover_csv`), stored in
  the model and applied to every sample alike.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from ..errors import DataError
from ..hashing import bytes_sha256
from .panel import normalise_marker
from .readers import _is_number
from .sample import Sample

__all__ = ["Compensation", "Spillover", "parse_spillover_keyword", "read_spillover_csv"]


@dataclass(frozen=True)
class Spillover:
    """A spillover matrix and the channels (``$PnN`` names) of its rows and columns."""

    channels: tuple[str, ...]
    matrix: NDArray[np.float64]


def parse_spillover_keyword(
    value: str, channel_names: Sequence[str], *, source: str = "input"
) -> Spillover:
    """The matrix of an FCS ``$SPILLOVER`` / ``SPILL`` / ``$COMP`` keyword value.

    The value is ``n, name_1, ..., name_n, s_11, s_12, ..., s_nn`` (row-major). Some
    FCS 3.0 writers give ``$COMP`` without names: ``n, s_11, ..., s_nn``, for the first
    ``n`` channels of the file (``channel_names``).

    Raises
    ------
    DataError
        A count that does not fit the values, or a value that is not a number.
    """
    parts = [p.strip() for p in value.replace("\n", "").split(",")]
    try:
        n = int(float(parts[0]))
    except ValueError:
        raise DataError(f"{source}: spillover keyword does not start with a count") from None
    if n < 1:
        raise DataError(f"{source}: spillover keyword has count {n}")
    named = len(parts) > 1 and not _is_number(parts[1])
    if named and len(parts) == 1 + n + n * n:
        names, values = parts[1 : 1 + n], parts[1 + n :]
    elif not named and len(parts) == 1 + n * n and n <= len(channel_names):
        names, values = list(channel_names[:n]), parts[1:]
    else:
        raise DataError(
            f"{source}: spillover keyword holds {len(parts) - 1} value(s) after its count "
            f"{n}, expected {n + n * n} (names and matrix)"
        )
    try:
        matrix = np.asarray(values, dtype=np.float64).reshape(n, n)
    except ValueError:
        bad = next(v for v in values if not _is_number(v))
        raise DataError(f"{source}: spillover value {bad!r} is not a number") from None
    return Spillover(tuple(names), matrix)


def read_spillover_csv(path: str | os.PathLike[str]) -> Spillover:
    """A spillover matrix from a CSV: a header row of channel names, one row per channel.

    A first column of row names (as FlowJo and FlowKit export) is accepted when it
    repeats the header's names in the same order.

    Raises
    ------
    DataError
        Not square, row names that differ from the header, or a non-number.
    """
    label = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise DataError(f"{label}: cannot read ({exc.strerror or exc})") from exc
    rows = [r for r in csv.reader(io.StringIO(text)) if any(c.strip() for c in r)]
    if len(rows) < 2:
        raise DataError(f"{label}: a spillover CSV needs a header row and one row per channel")
    header = [h.strip() for h in rows[0]]
    body = [[c.strip() for c in r] for r in rows[1:]]
    if (header and header[0] == "") or all(len(r) == len(header) + 1 for r in body):
        # Row names in the first column.
        header = header[1:] if header and header[0] == "" else header
        row_names = [r[0] for r in body]
        if row_names != header:
            raise DataError(
                f"{label}: row names {row_names} do not repeat the header's channels {header}"
            )
        body = [r[1:] for r in body]
    n = len(header)
    if len(body) != n or any(len(r) != n for r in body):
        raise DataError(
            f"{label}: the matrix must be square: {n} channel(s) in the header, "
            f"{len(body)} row(s) of {sorted({len(r) for r in body})} value(s)"
        )
    for i, r in enumerate(body):
        for j, c in enumerate(r):
            if not _is_number(c):
                raise DataError(
                    f"{label}: row {i + 2}, channel {header[j]!r}: {c!r} is not a number"
                )
    return Spillover(tuple(header), np.asarray(body, dtype=np.float64))


def _key(name: str) -> str:
    return normalise_marker(name)


@dataclass(frozen=True)
class Compensation:
    """How a model compensates its input (stored with the model, see the module docstring).

    Parameters
    ----------
    mode : {"none", "file", "matrix"}
    spillover : Spillover, optional
        The matrix of ``mode="matrix"``.
    source : str, optional
        Where the matrix came from (a file name, for provenance).
    """

    mode: Literal["none", "file", "matrix"] = "none"
    spillover: Spillover | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("none", "file", "matrix"):
            raise ValueError(f"compensation must be 'none', 'file' or a matrix, got {self.mode!r}")
        if (self.mode == "matrix") != (self.spillover is not None):
            raise ValueError("a spillover matrix is given exactly when mode is 'matrix'")
        if self.spillover is not None:
            m = np.asarray(self.spillover.matrix, dtype=np.float64)
            n = len(self.spillover.channels)
            if m.shape != (n, n) or not np.isfinite(m).all():
                raise ValueError(f"the spillover matrix must be finite and {n} x {n}")
            if np.linalg.cond(m) > 1e12:
                raise ValueError("the spillover matrix is singular: it cannot be inverted")

    @property
    def active(self) -> bool:
        """Whether :meth:`apply` changes anything."""
        return self.mode != "none"

    @classmethod
    def from_config(cls, value: Any, base: str | os.PathLike[str] = ".") -> Compensation:
        """The compensation of a training config's ``[preprocessing] compensation``.

        ``"none"`` (default), ``"file"``, or the path of a spillover CSV (relative to
        the config's folder), which is read now and stored in the model.
        """
        if value is None or isinstance(value, Compensation):
            return value or cls()
        if isinstance(value, Mapping):
            return cls.from_json(value)
        if value in ("none", "file"):
            return cls(value)
        path = Path(value) if Path(value).is_absolute() else Path(base) / value
        return cls("matrix", read_spillover_csv(path), Path(value).name)

    def to_json(self) -> str | dict[str, Any]:
        """``"none"``, ``"file"`` or the matrix with its channels (manifest form)."""
        if self.spillover is None:
            return self.mode
        return {
            "mode": "matrix",
            "channels": list(self.spillover.channels),
            "spillover": np.asarray(self.spillover.matrix).tolist(),
            "source": self.source,
        }

    @classmethod
    def from_json(cls, spec: str | Mapping[str, Any]) -> Compensation:
        """The compensation that :meth:`to_json` described."""
        if isinstance(spec, str):
            return cls(spec)  # type: ignore[arg-type]
        matrix = np.asarray(spec["spillover"], dtype=np.float64)
        return cls("matrix", Spillover(tuple(spec["channels"]), matrix), spec.get("source"))

    def describe(self) -> str:
        """One line for model cards and reports."""
        if self.mode == "none":
            return "none"
        if self.mode == "file":
            return "each file's own spillover matrix"
        assert self.spillover is not None
        digest = bytes_sha256(np.ascontiguousarray(self.spillover.matrix).tobytes())[:12]
        return (
            f"spillover matrix {self.source or ''} over {len(self.spillover.channels)} "
            f"channel(s), sha256 {digest}"
        ).replace("  ", " ")

    def apply(self, sample: Sample) -> Sample:
        """The sample with its spillover channels compensated (others as measured).

        Raises
        ------
        DataError
            ``mode="file"`` and the sample carries no spillover matrix (a CSV, an NPY,
            an FCS file without the keyword), or a spillover channel is missing from
            the sample; both name the sample.
        """
        if self.mode == "none":
            return sample
        if self.mode == "matrix":
            spill = self.spillover
        elif sample.spillover is not None:
            spill = parse_spillover_keyword(
                sample.spillover, sample.alt_names, source=sample.source
            )
        else:
            raise DataError(
                f"{sample.source}: the model compensates each sample with its FCS file's own "
                "spillover matrix ($SPILLOVER, SPILL or $COMP), and this sample carries none; "
                "send the FCS file, or data that were compensated already (declared as such)"
            )
        assert spill is not None
        columns = self._columns(sample, spill.channels)
        from flowutils.compensate import compensate

        try:
            points = compensate(sample.points, np.asarray(spill.matrix), list(columns))
        except np.linalg.LinAlgError:
            raise DataError(f"{sample.source}: its spillover matrix is singular") from None
        return replace(sample, points=points)

    @staticmethod
    def _columns(sample: Sample, channels: Sequence[str]) -> list[int]:
        """The sample's column of each spillover channel: ``$PnN`` first, then ``$PnS``."""
        exact = {n: j for j, n in enumerate(sample.alt_names)}
        loose: dict[str, list[int]] = {}
        for j, (a, b) in enumerate(zip(sample.alt_names, sample.names, strict=True)):
            for k in {_key(a), _key(b)}:
                loose.setdefault(k, []).append(j)
        out, missing = [], []
        for c in channels:
            if c in exact:
                out.append(exact[c])
            elif len(loose.get(_key(c), [])) == 1:
                out.append(loose[_key(c)][0])
            else:
                missing.append(c)
        if missing:
            raise DataError(
                f"{sample.source}: spillover channel(s) {missing} not found among the "
                f"sample's channels {list(sample.alt_names)}"
            )
        if len(set(out)) != len(out):
            raise DataError(f"{sample.source}: two spillover channels match the same column")
        return out
