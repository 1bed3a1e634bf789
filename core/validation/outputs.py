"""The study's three files: ``validation.json``, ``validation.html``, ``per_sample.csv``.

One builder per format, each from the study document alone (:func:`study_json`,
:func:`~core.validation.html.render_html`, :func:`per_sample_csv`);
:func:`write_study` writes the three into a directory, each file atomically.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from ..io.spreadsheet import SafeWriter
from .html import render_html
from .study import PER_SAMPLE_COLUMNS

__all__ = ["CSV_COLUMNS", "per_sample_csv", "study_json", "write_study"]

#: The columns of per_sample.csv, in order; a model's kind fills some of them.
CSV_COLUMNS = PER_SAMPLE_COLUMNS


def study_json(doc: Mapping[str, Any]) -> str:
    """``validation.json``: the study, indented; strict JSON (no NaN)."""
    return json.dumps(doc, indent=2, allow_nan=False, ensure_ascii=False) + "\n"


def per_sample_csv(doc: Mapping[str, Any]) -> str:
    """``per_sample.csv``: the study's per-sample rows, formula-safe for spreadsheets."""
    rows = doc["per_sample"]
    columns = [c for c in CSV_COLUMNS if any(c in r for r in rows)]
    buffer = io.StringIO()
    writer = SafeWriter(buffer)
    writer.writerow(columns)
    writer.writerows([[_cell(r.get(c)) for c in columns] for r in rows])
    return buffer.getvalue()


def _cell(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return value


def write_study(doc: Mapping[str, Any], out: str | Path) -> dict[str, Path]:
    """Write the three files into ``out`` (created if missing).

    Returns
    -------
    dict
        ``json``, ``html``, ``csv``: the paths written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return {
        "json": atomic_write_text(out / "validation.json", study_json(doc)),
        "html": atomic_write_text(out / "validation.html", render_html(doc)),
        "csv": atomic_write_text(out / "per_sample.csv", per_sample_csv(doc)),
    }
