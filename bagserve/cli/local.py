"""A saved model's answer for sample files on this machine, as the service gives it.

The ``bagserve predict`` command without ``--url`` and ``bagserve batch``'s tests use
these: one typed answer (:func:`predict_local`) encoded by the service's own builders
(JSON, the CSV table, HL7 v2).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "as_results",
    "explanation_documents",
    "oru_for_files",
    "predict_files",
    "predict_local",
    "table_for_files",
]


def predict_local(
    model_path: str | Path | Any,
    files: Sequence[str | Path],
    *,
    compensated: bool,
    coverage: float | None,
    names: Sequence[str] | None,
    control: str | Path | None = None,
    explain: bool = False,
) -> tuple[Any, list[str], dict[str, Any], Any, list[str], list[str | None], float | None, Any]:
    """A saved model's typed answer for files, with what every encoding of it needs:
    (result, names, meta, info, file sha256s, acquisition times, coverage used, and
    with ``explain`` each sample as read with its explanation, else None).
    ``control``: the file of the batch's reference control (per-cell models fitted
    with one), which maps every sample first; named with its sha256 in ``meta``."""
    from ..core.blas import one_thread
    from ..core.io import read_file
    from ..core.policy import review_warnings
    from ..core.runtime import ModelRuntime
    from ..service.options import PredictOptions

    runtime = model_path if isinstance(model_path, ModelRuntime) else ModelRuntime.open(model_path)
    info = runtime.info
    coverage = PredictOptions.asked_of(info.answer_shape(), coverage=coverage).coverage
    names = [str(f) for f in files] if names is None else list(names)
    # Each file read once: its hash is of the bytes decoded.
    samples, inputs = map(list, zip(*(read_file(f) for f in files), strict=True))
    reference = None
    if control is not None:
        sample, digest = read_file(control)
        reference = runtime.align([sample], compensated=compensated)
    # The service's workers compute with one BLAS thread; so does this, so that the
    # command's answer is the service's to the last bit (a multi-threaded sum is not).
    with one_thread():
        bags = runtime.align(samples, compensated=compensated)
        result = runtime.predict(bags, coverage=coverage, control=reference)
        explained = (
            list(zip(samples, runtime.explain(bags, control=reference), strict=True))
            if explain
            else None
        )
    meta = {
        "model": {
            "name": info.metadata.get("name"),
            "version": info.metadata.get("version"),
            "sha256": info.sha256,
            "estimator": info.estimator,
            "kind": str(info.kind),
        },
        "warnings": review_warnings(result, names),
    }
    if control is not None:
        meta["control"] = {"file": str(control), "sha256": digest}
    acquired = [s.acquired for s in samples]
    return result, names, meta, info, inputs, acquired, coverage, explained


def explanation_documents(explained: list[tuple[Any, Any]] | None) -> list[Any] | None:
    """Each explained sample's explanation as every door carries it (the service's
    ``?explain=true``), or None without ``explain``."""
    from ..service.explanations import TOP_CELLS

    return None if explained is None else [e.to_dict(top=TOP_CELLS) for _, e in explained]


def predict_files(
    model_path: str | Path | Any,
    files: Sequence[str | Path],
    *,
    compensated: bool = False,
    coverage: float | None = 0.9,
    cells: bool = False,
    names: Sequence[str] | None = None,
    control: str | Path | None = None,
    explain: bool = False,
    fcs_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Predictions of a saved model for sample files, as the service answers them.

    Every result carries the same trust fields as the service's JSON answer: the
    status under the model's out-of-domain policy, the domain report, the interval
    (or prediction set) of ``coverage`` where the model has one, the file's sha256
    (``input_sha256``); the model's sha256 heads the answer.

    ``model_path``: a saved model's directory, or a :class:`~bagserve.core.runtime.
    ModelRuntime` already open. ``compensated``: the files hold compensated cells
    already; the model's own compensation (if it has one) is skipped. ``cells``: a
    per-cell model's label of every cell besides its population summary. ``names``:
    the bags' ids in the answer and its warnings (default: the paths as given).
    ``control``: the batch's reference control file (:func:`predict_local`).
    ``explain``: each result's ``explanation`` (a per-cell model's: of its shares) as the
    service's ``?explain=true`` gives it; ``fcs_dir`` (with ``explain``): each sample written
    there as ``<name>.explained.fcs``, its channels as read plus ``contribution``, each
    cell's contribution to the last output, for gating in FlowJo or FlowKit.
    """
    from ..service.encoders import encode_document

    if fcs_dir is not None and not explain:
        raise ValueError("writing FCS files with contributions needs explain")
    result, names, meta, info, inputs, _, _, explained = predict_local(
        model_path,
        files,
        compensated=compensated,
        coverage=coverage,
        names=names,
        control=control,
        explain=explain,
    )
    documents = explanation_documents(explained)
    doc = encode_document(
        result, names, meta, info, inputs=inputs, cells=cells, explanations=documents
    )
    if fcs_dir is not None and explained is not None:
        from ..core.atomic import atomic_write_bytes
        from ..core.io import fcs_with_channel

        out = Path(fcs_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f, (sample, e) in zip(files, explained, strict=True):
            content = fcs_with_channel(sample, "contribution", e.contributions[:, -1])
            atomic_write_bytes(out / f"{Path(f).name}.explained.fcs", content)
    return as_results(doc, names)


def oru_for_files(
    model_path: str | Path | Any,
    files: Sequence[str | Path],
    *,
    compensated: bool = False,
    coverage: float | None = 0.9,
    refs: dict[str, Any] | None = None,
    parties: Any = None,
    control: str | Path | None = None,
    explain: bool = False,
) -> str:
    """The HL7 v2.5.1 ORU^R01 message of a saved model's answer for files (the same
    message ``Accept: application/hl7-v2`` gets from the service), bags named by
    their file names. ``refs``: ``patient`` and ``orders`` (one per file);
    ``parties``: MSH-3..6 (:class:`~bagserve.service.hl7.Parties`)."""
    import uuid

    from ..service.hl7 import check_orders, oru_r01

    check_orders((refs or {}).get("orders") or [], len(files))

    result, names, meta, info, inputs, acquired, coverage, explained = predict_local(
        model_path,
        files,
        compensated=compensated,
        coverage=coverage,
        names=[Path(f).name for f in files],
        control=control,
        explain=explain,
    )
    meta = {**meta, "request_id": uuid.uuid4().hex}
    return oru_r01(
        result,
        names,
        meta,
        info,
        inputs=inputs,
        coverage=coverage,
        refs=refs,
        acquired=acquired,
        parties=parties,
        explanations=explanation_documents(explained),
    )


def table_for_files(
    model_path: str | Path | Any,
    files: Sequence[str | Path],
    *,
    compensated: bool = False,
    coverage: float | None = 0.9,
    cells: bool = False,
    control: str | Path | None = None,
) -> tuple[list[str], list[list[Any]], list[str]]:
    """A saved model's answer for files as the one results table
    (:mod:`bagserve.service.tables`, the service's ``text/csv``): its columns, its rows
    (bags named by their file names, as an upload names them) and the warnings."""
    from ..core.policy import review_warnings
    from ..service.options import PredictOptions
    from ..service.tables import TableLayout

    names = [Path(f).name for f in files]
    result, names, _, info, inputs, _, coverage, _ = predict_local(
        model_path, files, compensated=compensated, coverage=coverage, names=names, control=control
    )
    shape = info.answer_shape()
    options = PredictOptions.asked_of(
        shape, coverage=coverage, cells=cells, compensated=compensated
    )
    layout = TableLayout.of(shape, options)
    rows = list(layout.rows(result, names, info, inputs=inputs))
    return layout.columns, rows, review_warnings(result, names)


def as_results(answer: dict[str, Any], files: Sequence[str]) -> dict[str, Any]:
    """A predict answer (the service's or its local twin) keyed by the files asked for:
    ``results`` in the order of ``files``, each with its ``file``."""
    head = {k: v for k, v in answer.items() if k != "predictions"}
    results = [{"file": f, **p} for f, p in zip(files, answer["predictions"], strict=True)]
    return {**head, "results": results}
