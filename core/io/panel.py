"""Marker panels: which columns a model takes, found by name in any sample.

Cytometers name channels inconsistently (``CD4-PE``, ``cd4 pe``, ``CD4_PE``), so names
are compared by :func:`normalise_marker`, and a :class:`Panel` may accept aliases.
:meth:`Panel.select` reorders a sample's columns into the model's order and names every
missing or ambiguous marker at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import DataError
from .sample import Sample

__all__ = ["Panel", "normalise_marker"]


def normalise_marker(name: str) -> str:
    """Case- and punctuation-insensitive key: ``"CD4-PE"``, ``"cd4 pe"`` → ``"cd4pe"``."""
    return re.sub(r"[\s\-_./:()\[\]]+", "", name).casefold()


@dataclass(frozen=True)
class Panel:
    """The markers a model takes, in input order, with accepted aliases.

    Parameters
    ----------
    markers : sequence of str
        Canonical names in the model's column order.
    aliases : mapping of str to sequence of str
        Other names accepted for a marker (e.g. ``{"FITC-A": ["GFP"]}``).
    """

    markers: tuple[str, ...]
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "markers", tuple(self.markers))
        object.__setattr__(self, "aliases", {k: tuple(v) for k, v in dict(self.aliases).items()})
        unknown = set(self.aliases) - set(self.markers)
        if unknown:
            raise ValueError(f"aliases for markers not in the panel: {sorted(unknown)}")
        keys = [normalise_marker(m) for m in self.markers]
        if len(set(keys)) != len(keys):
            raise ValueError(
                f"panel markers collide when case and punctuation are ignored: {self.markers}"
            )

    def to_json(self) -> dict[str, Any]:
        """The panel as stored in a model's manifest (see :meth:`from_json`)."""
        return {
            "markers": list(self.markers),
            "aliases": {k: list(v) for k, v in self.aliases.items()},
        }

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> Panel:
        """The panel that :meth:`to_json` described."""
        return cls(tuple(spec["markers"]), dict(spec.get("aliases", {})))

    def columns(
        self, names: Sequence[str], alt_names: Sequence[str] | None = None, *, source: str = "input"
    ) -> NDArray[np.int64]:
        """Column index of each panel marker among ``names`` (and ``alt_names``).

        Raises
        ------
        DataError
            Listing every missing marker (with the names that were available) and every
            marker matched by more than one column.
        """
        alt = list(alt_names) if alt_names is not None else list(names)
        keys = [{normalise_marker(a), normalise_marker(b)} for a, b in zip(names, alt, strict=True)]
        out, missing, ambiguous = [], [], []
        for m in self.markers:
            wanted = {normalise_marker(m)} | {normalise_marker(a) for a in self.aliases.get(m, ())}
            hits = [j for j, k in enumerate(keys) if k & wanted]
            if not hits:
                missing.append(m)
            elif len(hits) > 1:
                ambiguous.append(f"{m!r} matches columns {[names[j] for j in hits]}")
            else:
                out.append(hits[0])
        problems = []
        if missing:
            problems.append(f"missing marker(s) {missing} (available: {list(names)})")
        problems += [f"ambiguous marker {a}" for a in ambiguous]
        if problems:
            raise DataError(f"{source}: " + "; ".join(problems))
        return np.asarray(out, dtype=np.int64)

    def extra(self, names: Sequence[str], alt_names: Sequence[str] | None = None) -> list[str]:
        """Columns of a sample that the panel does not use."""
        used = set(self.columns(names, alt_names).tolist())
        return [n for j, n in enumerate(names) if j not in used]

    def select(self, sample: Sample) -> NDArray[np.float64]:
        """The sample's columns for this panel, in panel order."""
        cols = self.columns(sample.names, sample.alt_names, source=sample.source)
        return np.ascontiguousarray(sample.points[:, cols])
