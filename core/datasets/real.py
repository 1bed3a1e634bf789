"""Real data sets read from the shared test data or an optional package (never bundled)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from ..bags import Bags

__all__ = ["CENSUS_DIVISIONS", "GVHD_CHANNELS", "load_flowcap_gvhd", "load_state_productivity"]


GVHD_CHANNELS = ("FSC.H", "SSC.H", "FL1.H", "FL2.H", "FL3.H", "FL4.H")


#: US Census divisions of the 48 contiguous states (the batches of
#: :func:`load_state_productivity`).
CENSUS_DIVISIONS = {
    "New England": ("CT", "ME", "MA", "NH", "RI", "VT"),
    "Middle Atlantic": ("NJ", "NY", "PA"),
    "East North Central": ("IL", "IN", "MI", "OH", "WI"),
    "West North Central": ("IA", "KS", "MN", "MO", "NE", "ND", "SD"),
    "South Atlantic": ("DE", "FL", "GA", "MD", "NC", "SC", "VA", "WV"),
    "East South Central": ("AL", "KY", "MS", "TN"),
    "West South Central": ("AR", "LA", "OK", "TX"),
    "Mountain": ("AZ", "CO", "ID", "MT", "NV", "NM", "UT", "WY"),
    "Pacific": ("CA", "OR", "WA"),
}


def load_state_productivity() -> tuple[Bags, NDArray[np.float64], NDArray[np.str_], list[str]]:
    """Munnell's state productivity and public capital panel as grouped regression tasks.

    Munnell, "Why has productivity declined? Productivity and public investment", New
    England Economic Review (1990): 48 contiguous US states x 17 years (1970-1986), as
    the ``linearmodels`` package ships it (``linearmodels.datasets.munnell``; install
    ``linearmodels``, which the dev extra has). Each state is a task, each state-year a
    point with 4 inputs: log public capital, log private capital, log employment and
    the unemployment rate; the target is log gross state product. Real per-site data
    with strong site effects: the test bed of marginal-transfer *regression*.

    Returns
    -------
    tasks : Bags
        One bag per state (17 points x 4 inputs), states in alphabetical order of
        their postal codes.
    y : ndarray of shape (816,)
        Log gross state product, task after task.
    divisions : ndarray of str, shape (48,)
        Each state's census division (:data:`CENSUS_DIVISIONS`): its batch.
    states : list of str
        The postal codes.
    """
    try:
        from linearmodels.datasets import munnell
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ImportError(
            "load_state_productivity reads the data linearmodels ships: pip install linearmodels"
        ) from exc
    df = munnell.load().sort_values(["ST_ABB", "YR"])
    division = {st: name for name, states in CENSUS_DIVISIONS.items() for st in states}
    arrays, targets, groups, states = [], [], [], []
    for st, part in df.groupby("ST_ABB", sort=True):
        arrays.append(
            np.column_stack(
                [np.log(part["P_CAP"]), np.log(part["PC"]), np.log(part["EMP"]), part["UNEMP"]]
            ).astype(np.float64)
        )
        targets.append(np.log(part["GSP"].to_numpy(dtype=np.float64)))
        groups.append(division[str(st)])
        states.append(str(st))
    return Bags.from_arrays(arrays), np.concatenate(targets), np.array(groups), states


def load_flowcap_gvhd(
    directory: str | Path,
    samples: list[int] | None = None,
    *,
    labels: Literal["aligned", "binary", "raw"] = "aligned",
    transform: Literal["channel", "arcsinh", "none"] = "channel",
    cofactor: float = 150.0,
) -> tuple[Bags, NDArray[np.int64], list[int]]:
    """FlowCAP-I GvHD flow samples with per-cell manual gates (one task per sample).

    Reads ``sample{k}.csv.gz`` (6 channels: FSC.H, SSC.H, FL1.H..FL4.H) and
    ``labels{k}.csv.gz`` from ``directory``. The data are not shipped with bagserve;
    they are test inputs only (see the data set's README for source and licence).

    Parameters
    ----------
    directory : path
        Folder with the 12 sample/label pairs.
    samples : list of int, optional
        Sample numbers to read (default 1..12).
    labels : {"aligned", "binary", "raw"}, default="aligned"
        Gate IDs are not aligned across samples except 1, 3 and 4 (README).
        ``"aligned"``: keep 1, 3, 4 and map every other gate (0, 2, 5) to 0 ("other");
        ``"binary"``: 1 for gates {1, 3, 4}, 0 otherwise; ``"raw"``: the file's IDs.
    transform : {"channel", "arcsinh", "none"}, default="channel"
        ``"channel"``: the values are 1024-channel numbers; divide by 1023 to put every
        channel in ``[0, 1]``. ``"arcsinh"``: ``arcsinh(x / cofactor)``.
        ``"none"``: raw values.

    Returns
    -------
    tasks : Bags
        One bag per sample (12,751–32,700 cells each).
    y : ndarray of shape (n_cells_total,)
        Per-cell labels, sample after sample.
    samples : list of int
        The sample numbers, in order.
    """
    import gzip

    directory = Path(directory)
    samples = list(range(1, 13)) if samples is None else list(samples)
    arrays, ys = [], []
    for k in samples:
        with gzip.open(directory / f"sample{k}.csv.gz", "rt") as fh:
            header = fh.readline().strip().replace('"', "").split(",")
            if tuple(header) != GVHD_CHANNELS:
                raise ValueError(
                    f"sample{k}.csv.gz: expected columns {GVHD_CHANNELS}, got {header}"
                )
            x = np.loadtxt(fh, delimiter=",", dtype=np.float64, ndmin=2)
        lab = np.loadtxt(directory / f"labels{k}.csv.gz", dtype=np.int64, ndmin=1)
        if lab.shape[0] != x.shape[0]:
            raise ValueError(f"sample {k}: {x.shape[0]} cells but {lab.shape[0]} labels")
        if labels == "aligned":
            lab = np.where(np.isin(lab, (1, 3, 4)), lab, 0)
        elif labels == "binary":
            lab = np.isin(lab, (1, 3, 4)).astype(np.int64)
        elif labels != "raw":
            raise ValueError(f"labels must be 'aligned', 'binary' or 'raw', got {labels!r}")
        if transform == "channel":
            x = x / 1023.0
        elif transform == "arcsinh":
            x = np.arcsinh(x / cofactor)
        elif transform != "none":
            raise ValueError(f"transform must be 'channel', 'arcsinh' or 'none', got {transform!r}")
        arrays.append(x)
        ys.append(lab)
    return Bags.from_arrays(arrays), np.concatenate(ys), samples
