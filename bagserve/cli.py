"""The ``bagserve`` command: train, evaluate, validate, predict, list models, build the demo.

Exit codes fit scripts: 0 on success, 1 with one ``error: ...`` line on stderr for any
data, configuration or model problem, 2 for a wrong command line, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from . import __version__

__all__ = ["main"]


def _cmd_train(args: argparse.Namespace) -> int:
    from .core.training import train

    result = train(
        args.config,
        output=args.output,
        progress=not args.quiet,
        overwrite=args.overwrite,
        scheduler=args.scheduler,
        streaming=True if args.streaming else None,
    )
    cv = result.metrics["cv"]
    shown = {k: v for k, v in cv.items() if not isinstance(v, list | dict)}
    print(
        json.dumps(
            {
                "model": str(result.path),
                "cv": shown,
                "best_params": result.metrics["chosen_params"],
            },
            default=str,
        )
    )
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from .core.training import evaluate

    result = evaluate(
        args.model, args.data, include_training=args.include_training, progress=not args.quiet
    )
    # Which bags the metrics cover goes to stderr too, so that a reader of the numbers
    # alone (a script keeping stdout) is not the only one told.
    print(f"evaluate: {result['note']}", file=sys.stderr)
    print(json.dumps(result, default=str))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from .core.validation import validate, write_study

    doc = validate(args.model, args.data)
    paths = write_study(doc, args.out)
    samples = doc["samples"]
    print(
        f"validate: {samples['n']} sample(s), {samples['n_declined']} declined by the model; "
        f"acceptance: {doc['verdict']}",
        file=sys.stderr,
    )
    print(json.dumps({"verdict": doc["verdict"], **{k: str(v) for k, v in paths.items()}}))
    return 0


def _predict_local(
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
    from .core.blas import one_thread
    from .core.io import read_file
    from .core.policy import review_warnings
    from .core.runtime import ModelRuntime
    from .service.options import PredictOptions

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
        explained = list(zip(samples, runtime.explain(bags), strict=True)) if explain else None
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


def _explanation_documents(explained: list[tuple[Any, Any]] | None) -> list[Any] | None:
    """Each explained sample's explanation as every door carries it (the service's
    ``?explain=true``), or None without ``explain``."""
    from .service.explanations import TOP_CELLS

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
    ``control``: the batch's reference control file (:func:`_predict_local`).
    ``explain``: bag-level models, each result's ``explanation`` as the service's
    ``?explain=true`` gives it; ``fcs_dir`` (with ``explain``): each sample written
    there as ``<name>.explained.fcs``, its channels as read plus ``contribution``, each
    cell's contribution to the last output, for gating in FlowJo or FlowKit.
    """
    from .service.encoders import encode_document

    if fcs_dir is not None and not explain:
        raise ValueError("writing FCS files with contributions needs explain")
    result, names, meta, info, inputs, _, _, explained = _predict_local(
        model_path,
        files,
        compensated=compensated,
        coverage=coverage,
        names=names,
        control=control,
        explain=explain,
    )
    documents = _explanation_documents(explained)
    doc = encode_document(
        result, names, meta, info, inputs=inputs, cells=cells, explanations=documents
    )
    if fcs_dir is not None and explained is not None:
        from .core.atomic import atomic_write_bytes
        from .core.io import fcs_with_channel

        out = Path(fcs_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f, (sample, e) in zip(files, explained, strict=True):
            content = fcs_with_channel(sample, "contribution", e.contributions[:, -1])
            atomic_write_bytes(out / f"{Path(f).name}.explained.fcs", content)
    return _as_results(doc, names)


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

    from .service.hl7 import check_orders, oru_r01

    check_orders((refs or {}).get("orders") or [], len(files))

    result, names, meta, info, inputs, acquired, coverage, explained = _predict_local(
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
        explanations=_explanation_documents(explained),
    )


def _as_results(answer: dict[str, Any], files: Sequence[str]) -> dict[str, Any]:
    """A predict answer (the service's or its local twin) keyed by the files asked for:
    ``results`` in the order of ``files``, each with its ``file``."""
    head = {k: v for k, v in answer.items() if k != "predictions"}
    results = [{"file": f, **p} for f, p in zip(files, answer["predictions"], strict=True)]
    return {**head, "results": results}


class RemoteModel:
    """A served model (``name`` or ``name/version`` at ``url``) that predicts files the
    way :func:`predict_files` does locally: asked for what the model gives (an interval
    where it gives one, the population summary of a per-cell model).

    The version is pinned when it is opened (``name`` alone: the latest then), so that
    every answer of one command or one table comes from the same model; ``layout`` is
    the columns of its table answers (:class:`~bagserve.service.tables.TableLayout`).
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        interval: float | None = 0.9,
        cells: bool = False,
        compensated: bool = False,
    ) -> None:
        import os

        from .service.client import Client
        from .service.options import PredictOptions
        from .service.tables import TableLayout

        self.url, self.model = url, model
        self.name, _, version = model.partition("/")
        self.client = Client(url, api_key=api_key or os.environ.get("BAGSERVE_API_KEY"))
        try:
            described = self._call(self.client.model, self.name)
        except Exception:
            self.client.close()
            raise
        self.version = version or str(described.get("latest"))
        about = next(
            (v for v in described.get("versions", []) if v.get("version") == self.version), None
        )
        if about is None:
            self.client.close()
            raise ValueError(f"unknown model {self.name}/{self.version} at {url}")
        self.options = PredictOptions.asked_of(
            about, coverage=interval, cells=cells, compensated=compensated
        )
        self.layout = TableLayout.of(about, self.options)
        self.sha256 = str(about.get("sha256", ""))
        self.markers: list[str] = list((about.get("panel") or {}).get("markers") or [])
        self.params: dict[str, str] = {}
        if about.get("kind") == "cell":
            self.params["cells"] = "true" if cells else "false"
        elif self.options.coverage is not None:
            self.params["interval"] = str(self.options.coverage)
        if compensated:
            self.params["compensated"] = "true"

    def __enter__(self) -> RemoteModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        from .service.client import BagserveError

        try:
            return method(*args, **kwargs)
        except BagserveError as exc:
            if exc.status == 404:
                # Say what is missing, and what the service has instead.
                detail = exc.problem.get("detail", exc)
                raise ValueError(f"unknown model {self.model!r} at {self.url}: {detail}") from exc
            raise ValueError(str(exc)) from exc

    def oru(self, files: Sequence[str | Path], refs: dict[str, Any] | None = None) -> str:
        """The service's HL7 v2 ORU^R01 message for ``files`` (one request); ``refs``:
        ``patient`` and ``orders`` (one per file)."""
        refs = dict(refs or {})
        params: dict[str, Any] = dict(self.params)
        if "patient" in refs:
            params["patient"] = refs["patient"]
        if refs.get("orders"):
            params["order"] = list(refs["orders"])
        message = self._call(
            self.client.predict_files_as,
            self.name,
            files,
            "application/hl7-v2",
            version=self.version,
            params=params,
        )
        return message.decode("utf-8")

    def table_csv(self, files: Sequence[str | Path | tuple[str, bytes]]) -> str:
        """The service's ``text/csv`` answer for ``files`` (paths, or name and bytes),
        one request; :class:`~bagserve.service.client.BagserveError` as it failed."""
        answer = self.client.predict_files_as(
            self.name, files, "text/csv", version=self.version, params=self.params
        )
        return answer.decode("utf-8")

    def predict(self, files: Sequence[str | Path]) -> dict[str, Any]:
        """The service's answer for ``files`` (one request), keyed by file."""
        answer = self._call(
            self.client.predict_files,
            self.name,
            files,
            version=self.version,
            params=self.params,
        )
        return _as_results(answer, [str(f) for f in files])


def _remote(args: argparse.Namespace) -> RemoteModel:
    """The served model a command's ``--url`` and MODEL name (``name[/version]``)."""
    return RemoteModel(
        args.url,
        args.model,
        api_key=args.api_key,
        interval=args.interval,
        cells=getattr(args, "cells", False),
        compensated=args.compensated,
    )


def _remote_predict(args: argparse.Namespace) -> dict[str, Any]:
    """Predict through a running service (MODEL is ``name`` or ``name/version``)."""
    with _remote(args) as remote:
        return remote.predict(args.files)


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
    from .core.policy import review_warnings
    from .service.options import PredictOptions
    from .service.tables import TableLayout

    names = [Path(f).name for f in files]
    result, names, _, info, inputs, _, coverage, _ = _predict_local(
        model_path, files, compensated=compensated, coverage=coverage, names=names, control=control
    )
    shape = info.answer_shape()
    options = PredictOptions.asked_of(
        shape, coverage=coverage, cells=cells, compensated=compensated
    )
    layout = TableLayout.of(shape, options)
    rows = list(layout.rows(result, names, info, inputs=inputs))
    return layout.columns, rows, review_warnings(result, names)


def _cmd_predict(args: argparse.Namespace) -> int:
    if args.control and args.url:
        raise ValueError(
            "--control maps samples with a model on this machine; through a service, send "
            "the control as one of the request's bags and name it with ?control=ID"
        )
    if (args.explain or args.fcs_dir) and (args.format != "json" or args.url):
        raise SystemExit("--explain and --fcs-dir need --format json and a saved model")
    if args.fcs_dir and not args.explain:
        raise SystemExit("--fcs-dir needs --explain")
    plan = _hl7_plan(args) if args.hl7 else None
    if args.format == "json":
        result = (
            _remote_predict(args)
            if args.url
            else predict_files(
                args.model,
                args.files,
                compensated=args.compensated,
                coverage=args.interval,
                cells=args.cells,
                control=args.control,
                explain=args.explain,
                fcs_dir=args.fcs_dir,
            )
        )
        text = json.dumps(result, default=str)
        warnings = result.get("warnings") or []
    elif args.url:
        with _remote(args) as remote:
            text = remote._call(remote.table_csv, args.files).rstrip("\n")
        warnings = _table_warnings(text)
    else:
        from .service.tables import csv_bytes

        columns, rows, warnings = table_for_files(
            args.model,
            args.files,
            compensated=args.compensated,
            coverage=args.interval,
            cells=args.cells,
            control=args.control,
        )
        text = csv_bytes(columns, rows).decode().rstrip("\n")
    # Flags reach whoever runs the command, not only the file it writes.
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if plan is not None:
        _send_hl7(args, plan)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


def _table_warnings(text: str) -> list[str]:
    """The distinct warnings of a results table's rows, in order."""
    import csv

    out: dict[str, None] = {}
    for row in csv.DictReader(io.StringIO(text, newline="")):
        for warning in (row.get("warnings") or "").split(" | "):
            if warning:
                out[warning] = None
    return list(out)


def _hl7_plan(args: argparse.Namespace) -> tuple[dict[str, Any], Any, float]:
    """What ``--hl7`` needs, checked before any work: the patient and placer order
    numbers (one per file), MSH-3..6 and the try timeout from the ``BAGSERVE_HL7_*``
    settings."""
    from .service.errors import Problem
    from .service.hl7 import Parties, check_orders, hl7_references
    from .service.mllp import parse_mllp_url
    from .service.settings import Settings

    parse_mllp_url(args.hl7)  # a wrong address fails before any work
    try:
        refs = hl7_references({"patient": args.patient, "order": args.order or []})
        check_orders(refs.get("orders") or [], len(args.files))
    except Problem as exc:
        raise ValueError(f"HL7: {exc.detail}") from exc
    settings = Settings()
    return refs, Parties.from_settings(settings), settings.hl7_timeout


def _send_hl7(args: argparse.Namespace, plan: tuple[dict[str, Any], Any, float]) -> None:
    """The answer as an HL7 v2 ORU^R01 message to the MLLP peer of ``--hl7``."""
    from .service.mllp import MllpError, send

    refs, parties, timeout = plan
    if args.url:
        # The service builds the message, with its own MSH settings.
        with _remote(args) as remote:
            message = remote.oru(args.files, refs)
    else:
        message = oru_for_files(
            args.model,
            args.files,
            compensated=args.compensated,
            coverage=args.interval,
            refs=refs,
            parties=parties,
            control=args.control,
            explain=args.explain,
        )
    try:
        ack = send(message, args.hl7, timeout=timeout)
    except MllpError as exc:
        raise ValueError(f"HL7: {exc}") from exc
    print(f"hl7: {args.hl7} accepted the ORU^R01 message ({ack.code})", file=sys.stderr)


def _cmd_batch(args: argparse.Namespace) -> int:
    from .batch import LocalPredictor, RemotePredictor, batch, report_counts
    from .service.options import PredictOptions
    from .service.settings import Settings

    # The service's limits, from the same BAGSERVE_* settings: a drop folder is as
    # hostile as an HTTP body.
    settings = Settings()
    with contextlib.ExitStack() as stack:
        if args.url:
            predictor: Any = RemotePredictor(stack.enter_context(_remote(args)))
        else:
            predictor = LocalPredictor(
                args.model,
                PredictOptions(coverage=args.interval, cells=False, compensated=args.compensated),
                settings.request_limits().reading(),
                settings.request_timeout,
            )
            stack.callback(predictor.close)

        def log(line: str) -> None:
            if not args.quiet:
                print(f"batch: {line}", file=sys.stderr, flush=True)

        counts = batch(
            predictor,
            args.folder,
            args.output,
            watch=args.watch,
            poll=args.poll,
            settle=args.settle,
            idle_exit=args.idle_exit,
            max_bytes=settings.max_body_bytes,
            log=log,
        )
    report_counts(counts, Path(args.output))
    return 1 if counts.failed or counts.left else 0


def list_models(directory: str | Path) -> list[dict[str, Any]]:
    """Every artifact under ``directory`` (``<name>/<version>/manifest.json``), verified."""
    from .core.artifact_info import ArtifactInfo
    from .core.artifacts import ArtifactError

    rows = []
    for mpath in sorted(Path(directory).glob("*/*/manifest.json")):
        path = mpath.parent
        row: dict[str, Any] = {"name": path.parent.name, "version": path.name, "path": str(path)}
        try:
            info = ArtifactInfo.read(path)
            kind = str(info.kind)
        except ArtifactError as exc:
            row.update(status=f"FAILED: {exc}")
        else:
            row.update(
                status="ok",
                estimator=info.estimator,
                kind=kind,
                panel=info.markers or None,
                metrics=info.metadata.get("metrics"),
                created=info.manifest.get("created"),
                manifest_sha256=info.sha256,
            )
        rows.append(row)
    return rows


def _cmd_models(args: argparse.Namespace) -> int:
    rows = list_models(args.directory)
    if args.format == "json":
        print(json.dumps(rows, default=str))
        return 0
    if not rows:
        print(f"no models under {args.directory}")
        return 0
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['name']}/{r['version']}  {r['status']}")
            continue
        metrics = ", ".join(
            f"{k}={v:.4g}" for k, v in (r["metrics"] or {}).items() if isinstance(v, int | float)
        )
        head = f"{r['name']}/{r['version']}  {r['estimator']}  panel={r['panel']}"
        print(f"{head}  {metrics}  hashes ok")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _audit_source(args: argparse.Namespace):
    """The audit chain a command reads: ``--database``, else the service's settings
    (BAGSERVE_DATABASE_URL, or the SQLite file in BAGSERVE_DATA_DIR)."""
    from .service.audit import AuditLog
    from .service.database import Database
    from .service.settings import Settings

    settings = Settings()
    data_dir = Path(args.data_dir) if args.data_dir else settings.data_dir
    url = args.database or settings.database_url
    if url is None and not (data_dir / "bagserve.sqlite3").exists():
        raise SystemExit(
            f"error: no audit database: {data_dir / 'bagserve.sqlite3'} does not exist"
        )
    return AuditLog(Database(url, data_dir, pool_size=1, timeout=settings.database_timeout))


@contextlib.contextmanager
def _audit_chain(args: argparse.Namespace) -> Iterator[Any]:
    """The audit chain a command reads (:func:`_audit_source`), closed afterwards; a
    database that cannot be opened or read ends the command with the reason."""
    from .service.database import from_database

    log = None
    try:
        log = _audit_source(args)
        yield log
    except Exception as exc:
        if not from_database(exc):
            raise
        # Opening errors name the database themselves (without its password).
        where = "" if log is None else f"{log.db.where}: cannot read the audit chain: "
        raise SystemExit(f"error: {where}{' '.join(str(exc).split())}") from exc
    finally:
        if log is not None:
            log.db.close()


def _cmd_audit_verify(args: argparse.Namespace) -> int:
    from .service.audit import read_head, verify

    earlier = read_head(args.head) if args.head else None
    if args.file is not None:
        where, result = args.file, verify(args.file, earlier)
    else:
        with _audit_chain(args) as log:
            where, result = log.db.where, log.verify(earlier)
    if not result.ok:
        print(f"error: {where}: {result.problem}", file=sys.stderr)
        return 1
    matched = f"; holds the head of {args.head} (record {earlier[0]})" if earlier else ""
    print(f"ok: {result.lines} record(s), chain intact, last hash {result.last_hash}{matched}")
    return 0


def _cmd_audit_head(args: argparse.Namespace) -> int:
    """The chain's head, after verifying the chain: to be kept away from the database."""
    from datetime import UTC, datetime

    from .core.atomic import atomic_write_json

    with _audit_chain(args) as log:
        where, result = log.db.where, log.verify()
    if not result.ok:
        print(f"error: {where}: {result.problem}; no head written", file=sys.stderr)
        return 1
    head = {
        "lines": result.lines,
        "last_hash": result.last_hash,
        "taken": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if args.output:
        atomic_write_json(args.output, head)
        print(f"{args.output}: {result.lines} record(s), last hash {result.last_hash}")
    else:
        print(json.dumps(head))
    return 0


def _cmd_audit_export(args: argparse.Namespace) -> int:
    with _audit_chain(args) as log:
        where, result = log.db.where, log.export(args.output)
    if not result.ok:
        print(f"error: {where}: {result.problem}; nothing written", file=sys.stderr)
        return 1
    print(f"{args.output}: {result.lines} record(s), last hash {result.last_hash}")
    return 0


def _cmd_sign(args: argparse.Namespace) -> int:
    import os

    from .core.signing import sign_model, signature_key_sha256

    password = None
    if args.password_env:
        # From the environment, never the command line (which `ps` shows to everyone).
        password = os.environ.get(args.password_env)
        if password is None:
            raise ValueError(f"the environment variable {args.password_env} is not set")
    signature = sign_model(args.model, args.key, password=password)
    print(f"{signature}: signed with the key of sha256 {signature_key_sha256(args.model)}")
    return 0


def _key_entries(values: Sequence[str]) -> list[str]:
    """``--trusted-key`` values, each one entry, a comma-separated list or a JSON list,
    as ``BAGSERVE_TRUSTED_KEYS`` is written."""
    entries: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            entries += [str(v) for v in json.loads(value)]
        else:
            entries += [v.strip() for v in value.split(",") if v.strip()]
    return entries


def _cmd_verify_signature(args: argparse.Namespace) -> int:
    from .core.signing import load_trusted_keys, verify_model

    keys = load_trusted_keys(_key_entries(args.trusted_keys))
    # A SignatureError (an ArtifactError) is reported by main(): "error: ...", exit 1.
    signer = verify_model(args.model, keys)
    print(f"ok: {args.model} signed by {signer.name} (key sha256 {signer.key_sha256})")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .core.demo import build_demo_models

    for path in build_demo_models(args.models, overwrite=args.force):
        print(path)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from .service.worker_server import start_worker_server

    # First: the workers' server imports scipy and the estimators (seconds) while this
    # process imports the web framework; the workers are forked from it, ready at once.
    start_worker_server()
    import uvicorn

    from .service.app import create_app
    from .service.settings import Settings

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "workers": args.workers,
            "models_dir": args.models,
        }.items()
        if v is not None
    }
    settings = Settings(**overrides)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # The app routes uvicorn's loggers to its own handler (JSON when asked);
        # uvicorn's default configuration would put plain-text lines beside them.
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return 0


def openapi_document() -> dict[str, Any]:
    """The service's OpenAPI description, as ``openapi/openapi.json`` holds it."""
    from .service.app import create_app
    from .service.settings import Settings

    return create_app(Settings()).openapi()


def _cmd_openapi(args: argparse.Namespace) -> int:
    text = json.dumps(openapi_document(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagserve", description="Learning on bags of points.")
    p.add_argument("--version", action="version", version=f"bagserve {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model from a TOML configuration")
    t.add_argument("config")
    t.add_argument("--output", help="models directory (default: [model] output)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing version")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="train on a Dask cluster (e.g. tcp://host:8786): its workers read and "
        "featurise the bags; default: [compute] scheduler",
    )
    t.add_argument(
        "--streaming",
        action="store_true",
        help="read bags from their files a few at a time (memory-bounded); "
        "default: [compute] streaming",
    )
    t.set_defaults(func=_cmd_train)

    e = sub.add_parser(
        "evaluate",
        help="metrics of a model on the data of a configuration (its unseen bags only)",
    )
    e.add_argument("model")
    e.add_argument(
        "data",
        help="a TOML file with a [data] table (files and their labels); a training "
        "configuration will do, its other tables are not read",
    )
    e.add_argument(
        "--include-training",
        action="store_true",
        help="also count the bags the model was trained on (optimistic); the unseen bags' "
        "metrics are then under unseen_only",
    )
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=_cmd_evaluate)

    v = sub.add_parser(
        "validate",
        help="compare a model with a reference method on new samples (CLSI EP09/EP12)",
        description="Runs a saved model exactly as served on samples with reference "
        "results (a validation TOML: [data] with files and references, [acceptance] "
        "limits, [statistics], [precision], [report]) and writes validation.html "
        "(printable, with a signature block), validation.json and per_sample.csv into "
        "--out. Samples the model was trained on are refused.",
    )
    v.add_argument("model", help="a saved model's directory")
    v.add_argument("data", help="the validation TOML file")
    v.add_argument("--out", required=True, help="directory for the three files")
    v.set_defaults(func=_cmd_validate)

    ba = sub.add_parser(
        "batch",
        help="predict every sample file of a folder into one table (CSV or Parquet)",
        description="One row per file with the trust fields, in the columns every CSV "
        "door writes; files already in the table (by sha256) are skipped; a failing file "
        "becomes a row with its error and the run goes on; symlinks and files still being "
        "written are not read (exit 1 when any failed or was left for a later run).",
    )
    ba.add_argument("model", help="a saved model's directory, or name[/version] with --url")
    ba.add_argument("folder", help="the folder of sample files (not read recursively)")
    ba.add_argument("output", help="the table: OUT.csv, or OUT.parquet (pyarrow)")
    ba.add_argument("--url", help="use a running service")
    ba.add_argument("--api-key", help="service API key (default: BAGSERVE_API_KEY)")
    ba.add_argument("--interval", type=float, default=0.9, help="interval coverage (0.9)")
    ba.add_argument("--compensated", action="store_true", help="as for predict")
    ba.add_argument(
        "--watch", action="store_true", help="keep taking new files as they arrive (Ctrl-C)"
    )
    ba.add_argument("--poll", type=float, default=2.0, help="seconds between looks (2)")
    ba.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="a file is read once unchanged for this many seconds (5): a copy in progress "
        "is left for later",
    )
    ba.add_argument(
        "--idle-exit",
        type=float,
        default=None,
        help="with --watch: stop after this many seconds without a new file",
    )
    ba.add_argument("--quiet", action="store_true", help="no line per file on stderr")
    ba.set_defaults(func=_cmd_batch)

    pr = sub.add_parser("predict", help="predict sample files (FCS, CSV, TSV, NPY)")
    pr.add_argument("model")
    pr.add_argument("files", nargs="+")
    pr.add_argument("--format", choices=("json", "csv"), default="json")
    pr.add_argument(
        "--interval",
        type=float,
        default=0.9,
        help="coverage of the prediction interval or set, where the model has one (default 0.9)",
    )
    pr.add_argument(
        "--cells",
        action="store_true",
        help="per-cell models: every cell's label (default: the population summary)",
    )
    pr.add_argument(
        "--explain",
        action="store_true",
        help="bag-level models: which cells moved each prediction (an explanation per "
        "result: baseline, total, by marker, top cells)",
    )
    pr.add_argument(
        "--fcs-dir",
        metavar="DIR",
        help="with --explain: write each sample to DIR as NAME.explained.fcs, its channels "
        "plus 'contribution', for gating on the cells that moved the prediction",
    )
    pr.add_argument("--output", help="write here instead of stdout")
    pr.add_argument(
        "--control",
        metavar="FILE",
        help="per-cell models trained with a reference control: the control measured in "
        "the files' batch; every file is mapped by it onto the training batch first",
    )
    pr.add_argument(
        "--hl7",
        metavar="mllp://HOST:PORT",
        help="also send the answer as an HL7 v2.5.1 ORU^R01 message to this MLLP peer "
        "(exit 1 unless it is accepted; MSH-3..6 and the try timeout from the "
        "BAGSERVE_HL7_* variables, with --url the service's)",
    )
    pr.add_argument("--patient", help="with --hl7: the patient identifier (PID-3)")
    pr.add_argument(
        "--order",
        action="append",
        help="with --hl7: the placer order number (ORC-2, OBR-2) of each file, repeated "
        "in the files' order (one order per file, or none)",
    )
    pr.add_argument("--url", help="use a running service (MODEL is then name or name/version)")
    pr.add_argument("--api-key", help="service API key (default: BAGSERVE_API_KEY)")
    pr.add_argument(
        "--compensated",
        action="store_true",
        help="the files hold compensated cells: skip the model's own compensation",
    )
    pr.set_defaults(func=_cmd_predict)

    m = sub.add_parser("models", help="model artifacts")
    msub = m.add_subparsers(dest="models_command", required=True)
    ml = msub.add_parser("list", help="name, version, estimator, panel, metrics, hash status")
    ml.add_argument("directory")
    ml.add_argument("--format", choices=("text", "json"), default="text")
    ml.set_defaults(func=_cmd_models)

    s = sub.add_parser("serve", help="serve the models over HTTP (settings: BAGSERVE_* variables)")
    s.add_argument("--host", help="default: BAGSERVE_HOST or 127.0.0.1")
    s.add_argument("--port", type=int, help="default: BAGSERVE_PORT or 8000")
    s.add_argument("--workers", type=int, help="compute processes; default: BAGSERVE_WORKERS or 2")
    s.add_argument("--models", help="models directory; default: BAGSERVE_MODELS_DIR or ./models")
    s.set_defaults(func=_cmd_serve)

    a = sub.add_parser("audit", help="the service's audit trail")
    asub = a.add_subparsers(dest="audit_command", required=True)
    av = asub.add_parser(
        "verify", help="check the hash chain: exit 1 on an edited, reordered or deleted record"
    )
    av.add_argument("file", nargs="?", help="an exported trail; default: the service's database")
    av.add_argument(
        "--head",
        metavar="HEAD_FILE",
        help="a head taken earlier (`bagserve audit head`) and kept elsewhere: the chain must "
        "still hold it (catches records cut from the end with the head row edited to match)",
    )
    av.set_defaults(func=_cmd_audit_verify)
    ah = asub.add_parser(
        "head", help="the chain's head (count, last hash) after verifying it, to keep elsewhere"
    )
    ah.add_argument("--output", help="write it here (JSON) instead of printing it")
    ah.set_defaults(func=_cmd_audit_head)
    ae = asub.add_parser(
        "export", help="write the chain as JSON lines (+ FILE.head) after verifying it"
    )
    ae.add_argument("output")
    ae.set_defaults(func=_cmd_audit_export)
    for audit_parser in (av, ae, ah):
        audit_parser.add_argument(
            "--database", help="postgresql://... ; default: BAGSERVE_DATABASE_URL, else SQLite"
        )
        audit_parser.add_argument(
            "--data-dir", help="where the SQLite database is; default: BAGSERVE_DATA_DIR"
        )

    sg = sub.add_parser(
        "sign",
        help="sign a model version for release (OpenSSF model-signing, elliptic-curve key)",
    )
    sg.add_argument("model", help="the model version's directory (MODELS_DIR/<name>/<version>)")
    sg.add_argument("--key", required=True, help="the private key, PEM (kept offline)")
    sg.add_argument(
        "--password-env", metavar="VAR", help="the environment variable holding its password"
    )
    sg.set_defaults(func=_cmd_sign)
    vs = sub.add_parser(
        "verify-signature", help="check a model version's signature against trusted keys"
    )
    vs.add_argument("model", help="the model version's directory")
    vs.add_argument(
        "--trusted-key",
        "--trusted-keys",
        dest="trusted_keys",
        action="append",
        required=True,
        metavar="KEY",
        help="PATH or NAME=PATH of a PEM public key, or a directory of them (repeatable, "
        "or a list written as BAGSERVE_TRUSTED_KEYS); exit 1 with the reason unless the "
        "signature verifies against one of them",
    )
    vs.set_defaults(func=_cmd_verify_signature)

    o = sub.add_parser("openapi", help="print (or write) the service's OpenAPI document")
    o.add_argument("--output", help="e.g. openapi/openapi.json")
    o.set_defaults(func=_cmd_openapi)

    d = sub.add_parser("demo", help="train the bundled demo models (generated data)")
    d.add_argument("--models", default="models", help="models directory (default: ./models)")
    d.add_argument("--force", action="store_true", help="rebuild existing demo models")
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bagserve`` command."""
    from .core.errors import CoreError

    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        hint = (
            "; `bagserve train --streaming` reads a few bags at a time, "
            "`--scheduler ADDRESS` trains on a Dask cluster"
            if args.command == "train"
            else ""
        )
        print(f"error: out of memory{hint}", file=sys.stderr)
        return 1
    except (CoreError, OSError, ValueError, ImportError) as exc:
        message = " ".join(str(exc).split())
        print(f"error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
