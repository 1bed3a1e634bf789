"""The validation report as one self-contained, printable HTML page.

:func:`render_html` builds the page from the study document alone (the one
``validation.json`` holds), so the page shows nothing the JSON does not: the same
numbers, rounded for reading, proportions as percentages. Styles and plots (SVG) are
inline; the page fetches nothing, runs no script, and prints on A4 with a signature
block for the laboratory director. Every text that came from outside (sample and file
names, class labels, the laboratory's own words) is escaped.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .acceptance import NOT_SHOWN
from .study import PER_SAMPLE_COLUMNS
from .svg import scatter

__all__ = ["render_html"]

_CSS = """
body{font:13px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1b1f24;
max-width:1040px;margin:24px auto;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;border-bottom:2px solid #d0d7de;
padding-bottom:3px;margin-top:28px}h3{font-size:14px;margin:18px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:12px}
th,td{border:1px solid #d0d7de;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f5f7}td.num{text-align:right;font-variant-numeric:tabular-nums}
code,.hash{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11px;word-break:break-all}
.pass{color:#116329;font-weight:600}.fail{color:#a40e26;font-weight:600}
.unshown{color:#7d4e00;font-weight:600}
.verdict{display:inline-block;padding:4px 12px;border-radius:4px;font-weight:700;font-size:15px}
.verdict.pass{background:#dafbe1}.verdict.fail{background:#ffebe9}.verdict.none{background:#eaeef2}
.verdict.unshown{background:#fff8c5}
.muted{color:#57606a}.plots{display:flex;flex-wrap:wrap;gap:12px}
.plots figure{margin:0;width:340px}.plots figcaption{font-size:11px;color:#57606a}
.sign{border:1px solid #8c959f;padding:12px 16px;margin-top:18px}
.sign td{border:none;padding:14px 10px 2px 0}.line{border-bottom:1px solid #1b1f24;min-width:230px}
.declined td{background:#fff8c5}
@page{size:A4;margin:14mm}
@media print{body{margin:0;max-width:none;font-size:11px}section{break-inside:avoid}
h2{break-after:avoid}.sign{break-inside:avoid}}
"""

_SET_NAMES = {"all": "all samples", "without_declined": "without the declined samples"}
_SAME = (
    "The model declined no sample: the results without the declined samples are those on "
    "all samples (validation.json gives both)."
)


def _nothing_declined(doc: Mapping[str, Any]) -> bool:
    return doc["samples"]["n_declined"] == 0


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "—"
        return f"{value:.{digits}g}"
    return _e(value)


def _pct(value: Any) -> str:
    return "—" if value is None else f"{100.0 * float(value):.1f} %"


def _ci(ci: Any, fmt: Any = _num) -> str:
    if not ci:
        return "—"
    if ci[0] is None and ci[1] is None:
        return "unbounded"
    return f"{fmt(ci[0])} to {fmt(ci[1])}"


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]], classes: Sequence[str] = ()) -> str:
    out = ["<table><thead><tr>", *(f"<th>{_e(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if i < len(classes) and classes[i] else ""
        out.append(f"<tr{cls}>")
        for cell in row:
            if isinstance(cell, tuple):  # (html, css class): already escaped
                out.append(f'<td class="{cell[1]}">{cell[0]}</td>')
            elif isinstance(cell, bool):
                out.append(f"<td>{_num(cell)}</td>")
            elif isinstance(cell, int | float) or cell is None:
                out.append(f'<td class="num">{_num(cell)}</td>')
            else:
                out.append(f"<td>{_e(cell)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _passfail(verdict: str) -> tuple[str, str]:
    """A criterion's verdict as shown, and its style."""
    return {"pass": ("PASS", "pass"), "fail": ("FAIL", "fail")}.get(
        verdict, ("NOT SHOWN", "unshown")
    )


# ------------------------------------------------------------------------------ plots
_SCATTER_CAPTION = (
    "Model against reference; dotted: identity, purple: Deming, green dashed: "
    "Passing–Bablok; open squares: declined samples."
)
_BLAND_CAPTION = (
    "Bland–Altman: difference against mean; red: bias and 95 % limits of agreement "
    "(all samples); open squares: declined samples."
)


def _plots(doc: Mapping[str, Any], analysis: Mapping[str, Any], index: int) -> str:
    """The comparison and Bland–Altman plots of one measurand (all samples)."""
    name = analysis["measurand"]
    rows = [
        r
        for r in doc["per_sample"]
        if r.get("measurand") == name and r["reference"] is not None and r["model"] is not None
    ]
    if len(rows) < 2:
        return ""
    pts = [(r["reference"], r["model"], r["declined"]) for r in rows]
    diff = [((r["reference"] + r["model"]) / 2, r["difference"], r["declined"]) for r in rows]
    ba = analysis["bland_altman"]
    hl = [(0.0, "#57606a", "2 2")]
    if "bias" in ba:
        hl += [(ba["bias"], "#cf222e", "none")]
        hl += [(ba[k], "#cf222e", "5 3") for k in ("lower", "upper")]
    lines = [(0.0, 1.0, "#57606a", "2 2")]
    for key, colour, dash in (("deming", "#8250df", "none"), ("passing_bablok", "#1a7f37", "6 3")):
        fit = analysis[key]
        if fit.get("slope") is not None and fit.get("intercept") is not None:
            lines.append((fit["intercept"], fit["slope"], colour, dash))
    comparison = scatter(
        pts, xlabel=f"reference: {name}", ylabel="model", lines=lines, uid=f"s{index}"
    )
    bland = scatter(
        diff, xlabel="mean of model and reference", ylabel="model − reference", hlines=hl,
        uid=f"b{index}",
    )  # fmt: skip
    return (
        f'<div class="plots"><figure>{comparison}<figcaption>{_SCATTER_CAPTION}</figcaption>'
        f"</figure><figure>{bland}<figcaption>{_BLAND_CAPTION}</figcaption></figure></div>"
    )


# --------------------------------------------------------------------------- sections
def _hash(value: Any) -> tuple[str, str]:
    return (f'<span class="hash">{_e(value)}</span>', "")


def _provenance(doc: Mapping[str, Any]) -> str:
    m = doc["model"]
    model_rows = [
        ("name / version", f"{m['name']} / {m['version']}"),
        ("sha256 (manifest)", _hash(m["sha256"])),
        ("estimator, kind", f"{m['estimator']}, {m['kind']}"),
        ("signer (key sha256, as recorded)", _hash(m["signer_key_sha256"] or "unsigned")),
        ("out-of-domain policy", m["out_of_domain_policy"]),
        ("intended use (model card)", m["intended_use"] or "not stated"),
    ]
    d = doc["data"]
    files = [(f["sample"], f["file"], _hash(f["sha256"])) for f in d["files"]]
    tables = [(t["name"], _hash(t["sha256"])) for t in [d["validation_file"], *d["tables"]]]
    software = (
        f"<p>Software: bagserve {_e(doc['software']['bagserve'])}. Report created "
        f"{_e(doc['created'])}. Overlap with the model's training samples: "
        f"{_e(doc['training_overlap'])}.</p>"
    )
    return (
        "<section><h2>Provenance</h2><h3>Model</h3>"
        + _table(["", ""], model_rows)
        + software
        + "<h3>Validation file and reference tables</h3>"
        + _table(["file", "sha256"], tables)
        + f"<h3>Sample files ({len(files)})</h3>"
        + _table(["sample", "file", "sha256"], files)
        + "</section>"
    )


_PROPORTIONS = ("concordance", "sensitivity", "specificity", "ppv", "npv")


def _acceptance(doc: Mapping[str, Any]) -> str:
    rows = doc["acceptance"]
    if not rows:
        return (
            "<section><h2>Acceptance</h2><p>No acceptance limits were given ([acceptance] "
            "in the validation file).</p></section>"
        )
    same = _nothing_declined(doc)
    body = []
    for r in rows:
        if same and r["set"] != "all":
            continue
        fmt = _pct if r["criterion"] in _PROPORTIONS else _num
        est = r["estimate"]
        shown = " to ".join(fmt(v) for v in est) if isinstance(est, list) else fmt(est)
        limits = f"{fmt(r['low'])} to {fmt(r['high'])}"
        where = _SET_NAMES[r["set"]]
        ci = _ci(r["ci"], fmt)
        verdict = _passfail(r["verdict"])
        body.append((r["statistic"], where, r["subject"], shown, ci, limits, verdict))
    head = ["criterion", "samples", "of", "estimate", "CI", "limits", "result"]
    rule = _RULE + (f" {_UNSHOWN}" if any(r["verdict"] == NOT_SHOWN for r in rows) else "")
    return (
        "<section><h2>Acceptance</h2>"
        + (f"<p class='muted'>{_SAME}</p>" if same else "")
        + _table(head, body)
        + f"<p class='muted'>{rule}</p></section>"
    )


_RULE = (
    "A criterion passes when its confidence interval lies within the limits, and fails "
    "when its estimate lies outside them (CLSI EP09 judges a bias through its interval)."
)
_UNSHOWN = (
    "NOT SHOWN: the estimate lies within the limits but its confidence interval reaches "
    "beyond them, so these samples cannot show the criterion met; EP09 asks for at least "
    "40 samples spread over the measuring range."
)


def _samples(doc: Mapping[str, Any]) -> str:
    s = doc["samples"]
    text = (
        f"<p>{s['n']} samples; the model declined {s['n_declined']} ({s['n_withheld']} "
        f"withheld by its policy, {s['n_out_of_domain']} outside its applicability domain). "
        "Declined samples are never dropped: every analysis is given on all samples and "
        "without them.</p>"
    )
    if s["declined"]:
        rows = [
            (
                d["sample"],
                d["status"],
                d["out_of_domain"],
                d["domain_score"],
                " ".join(d["warnings"]),
            )
            for d in s["declined"]
        ]
        text += _table(["sample", "status", "out of domain", "domain score", "why"], rows)
    return "<section><h2>Samples and what the model declined</h2>" + text + "</section>"


def _estimate(stat: Mapping[str, Any], key: str) -> str:
    """``estimate (lower to upper)``, or why there is none."""
    if key not in stat:
        return "not estimable"
    return f"{_num(stat[key])} ({_ci(stat.get(f'{key}_ci'))})"


_QUANT_HEAD = [
    "measurand",
    "n",
    "bias (CI)",
    "lower limit of agreement (CI)",
    "upper limit of agreement (CI)",
    "ratio scale: bias (CI)",
    "|difference| vs level",
    "Deming slope (CI)",
    "Deming intercept (CI)",
    "Passing–Bablok slope (CI)",
    "Passing–Bablok intercept (CI)",
    "Pearson r (CI)",
]


def _quantitative_row(a: Mapping[str, Any]) -> tuple[Any, ...]:
    ba, ratio, trend = a["bland_altman"], a["ratio"], a["trend"]
    rat = _estimate(ratio, "bias")
    if "bias" in ratio:
        rat += f"; limits {_num(ratio['lower'])} to {_num(ratio['upper'])}"
    tr = "—"
    if "rho" in trend:
        tr = f"ρ = {_num(trend['rho'], 3)}, p = {_num(trend['p_value'], 3)}"
    dem, pb = a["deming"], a["passing_bablok"]
    return (
        a["measurand"],
        a["n"],
        _estimate(ba, "bias"),
        _estimate(ba, "lower"),
        _estimate(ba, "upper"),
        rat,
        tr,
        _estimate(dem, "slope"),
        _estimate(dem, "intercept"),
        _estimate(pb, "slope"),
        _estimate(pb, "intercept"),
        _estimate(a["correlation"], "r"),
    )


def _quantitative(doc: Mapping[str, Any]) -> str:
    q = doc["quantitative"]
    if q is None:
        return ""
    st = doc["statistics"]
    out = [
        "<section><h2>Quantitative comparison (CLSI EP09)</h2>",
        f"<p class='muted'>Estimates with their {_pct(st['confidence'])} confidence "
        f"intervals. Deming error ratio λ = {_num(st['error_ratio'])} (the model's error "
        "variance over the reference's).</p>",
    ]
    for which, analyses in q.items():
        if which != "all" and _nothing_declined(doc):
            out.append(f"<p class='muted'>{_SAME}</p>")
            continue
        out.append(f"<h3>{_e(_SET_NAMES[which]).capitalize()}</h3>")
        out.append(_table(_QUANT_HEAD, [_quantitative_row(a) for a in analyses]))
    for index, a in enumerate(q["all"]):
        out.append(f"<h3>{_e(a['measurand'])}</h3>" + _plots(doc, a, index))
    out.append("</section>")
    return "".join(out)


_QUAL_HEAD = [
    "class",
    "TP",
    "FP",
    "FN",
    "TN",
    "sensitivity (CI)",
    "specificity (CI)",
    "PPV (CI)",
    "NPV (CI)",
]


_RATES = ("sensitivity", "specificity", "ppv", "npv")


def _share(share: Mapping[str, Any]) -> str:
    return f"{_pct(share['estimate'])} ({_ci(share['ci'], _pct)})"


def _per_sample_agreement(a: Mapping[str, Any]) -> str:
    """Each sample's cell agreement: concordance, kappa, each class's sensitivity."""
    head = ["sample", "cells", "concordance (CI)", "kappa (CI)"]
    head += [f"sensitivity {c}" for c in a["classes"]]
    rows = [
        (
            s["sample"],
            s["n"],
            _share(s["concordance"]),
            f"{_num(s['kappa']['kappa'])} ({_ci(s['kappa']['kappa_ci'])})",
            *(_pct(c["sensitivity"]["estimate"]) for c in s["per_class"]),
        )
        for s in a["per_sample"]
    ]
    return _table(head, rows)


def _qualitative(doc: Mapping[str, Any]) -> str:
    q = doc["qualitative"]
    if q is None:
        return ""
    out = ["<section><h2>Qualitative comparison (CLSI EP12)</h2>"]
    for which, a in q.items():
        if which != "all" and _nothing_declined(doc):
            out.append(f"<p class='muted'>{_SAME}</p>")
            continue
        conc, kap = a["concordance"], a["kappa"]
        out.append(f"<h3>{_e(_SET_NAMES[which]).capitalize()} ({a['n']} results)</h3>")
        out.append(
            f"<p>Concordance {_share(conc)}, {conc['k']}/{conc['n']} ({_e(a['interval'])} "
            f"interval); Cohen's kappa {_num(kap['kappa'])} (CI {_ci(kap['kappa_ci'])}).</p>"
        )
        rows = [
            (c["class"], c["tp"], c["fp"], c["fn"], c["tn"], *(_share(c[k]) for k in _RATES))
            for c in a["per_class"]
        ]
        out.append(_table(_QUAL_HEAD, rows))
        matrix = [(f"reference {c}", *r) for c, r in zip(a["classes"], a["confusion"], strict=True)]
        out.append("<p class='muted'>Confusion matrix: rows reference, columns model.</p>")
        out.append(_table(["", *(f"model {c}" for c in a["classes"])], matrix))
        if a.get("per_sample"):
            out.append(f"<p>Per sample (its cells):</p>{_per_sample_agreement(a)}")
    out.append("</section>")
    return "".join(out)


def _precision(doc: Mapping[str, Any]) -> str:
    p = doc["precision"]
    text = ""
    if p["rows"]:
        text = _table(
            [
                "measurand",
                "specimen",
                "n",
                "runs",
                "mean",
                "repeatability SD",
                "CV %",
                "within-lab SD",
                "CV %",
            ],
            [
                (
                    r["measurand"],
                    r["specimen"],
                    r["n"],
                    r["n_runs"],
                    r["mean"],
                    r["sd_repeatability"],
                    r["cv_repeatability"],
                    r["sd_within_lab"],
                    r["cv_within_lab"],
                )
                for r in p["rows"]
            ],
        )
    if p["note"]:
        text += f"<p>{_e(p['note'])}</p>"
    return "<section><h2>Precision (CLSI EP05)</h2>" + text + "</section>"


#: Per-sample fields the page leaves to the CSV: the provenance section lists the files
#: with their sha256, and declined rows are highlighted instead.
_OFF_THE_PAGE = ("file", "sha256", "declined")


def _per_sample(doc: Mapping[str, Any]) -> str:
    rows = doc["per_sample"]
    if not rows:
        return ""
    keys = [k for k in PER_SAMPLE_COLUMNS if k in rows[0] and k not in _OFF_THE_PAGE]
    return (
        "<section><h2>Per-sample results</h2>"
        + _table(
            keys,
            [[r[k] for k in keys] for r in rows],
            ["declined" if r["declined"] else "" for r in rows],
        )
        + "<p class='muted'>Highlighted: declined samples (withheld or outside the "
        "applicability domain).</p></section>"
    )


_METHODS = (
    "<section><h2>Methods</h2><p>The model was run exactly as it is served (the same "
    "runtime, the same out-of-domain policy) on samples it was not trained on. "
    "Bland–Altman bias and 95 % limits of agreement (bias ± 1.96 SD) with intervals from "
    "SE(bias) = SD/√n and SE(limit) ≈ √(3 SD²/n) (Bland &amp; Altman, Lancet 1986); the "
    "ratio scale uses log ratios, back-transformed (Bland &amp; Altman 1999). Deming "
    "regression with the stated error ratio and Linnet's jackknife intervals (Linnet, Stat "
    "Med 1990); Passing–Bablok regression with its rank-based intervals (Passing &amp; "
    "Bablok, J Clin Chem Clin Biochem 1983); Pearson r with the Fisher-z interval "
    "(CLSI EP09). Qualitative results: concordance, sensitivity, specificity, PPV and NPV "
    "with Wilson score or Clopper–Pearson exact intervals, Cohen's kappa with Cohen's "
    "large-sample interval (CLSI EP12). Precision: repeatability and within-laboratory SD "
    "from a one-way analysis of variance by run (CLSI EP05). A criterion passes when its "
    "estimate lies within the laboratory's limits. For per-cell models the cells of one "
    "sample are not independent: the per-cell intervals are narrower than the per-sample "
    "evidence supports; judge by the per-sample results.</p></section>"
)


def _signature(doc: Mapping[str, Any]) -> str:
    blank = '<td class="line">&nbsp;</td>'
    return (
        '<section class="sign"><h2 style="margin-top:0;border:none">Review and approval</h2>'
        "<p>I have reviewed this method comparison and the model's intended use. The model "
        "is &#9744; accepted &#9744; not accepted for use in this laboratory as a "
        "laboratory-developed test, for the intended use stated above.</p>"
        f"<table><tr><td>Laboratory director (name)</td>{blank}<td>Signature</td>{blank}</tr>"
        f"<tr><td>Date</td>{blank}<td>Comments</td>{blank}</tr></table>"
        "<p class='muted'>This page shows the study of <code>validation.json</code>, sha256 "
        f"<span class='hash'>{_e(doc['sha256'])}</span> (of its canonical JSON without this "
        "field).</p></section>"
    )


#: Nothing is fetched: no script, no image, no font; styles inline only.
_CSP = "default-src 'none'; style-src 'unsafe-inline'"


def render_html(doc: Mapping[str, Any]) -> str:
    """The report page of a study document (:func:`core.validation.validate`)."""
    verdict = doc["verdict"]
    css = {"pass": "pass", "fail": "fail", NOT_SHOWN: "unshown"}.get(verdict, "none")
    m = doc["model"]
    lab = f" — {_e(doc['laboratory'])}" if doc.get("laboratory") else ""
    model = f"{_e(m['name'])} / {_e(m['version'])}"
    head = (
        f"<header><h1>{_e(doc['title'])}</h1><p>Model <b>{model}</b> against "
        f"{_e(doc['reference_method'])}{lab}. {doc['samples']['n']} samples not used in "
        f"training. Created {_e(doc['created'])}.</p><p>Overall: "
        f"<span class='verdict {css}'>{_e(verdict.upper())}</span></p></header>"
    )
    body = "".join(
        [
            head,
            _acceptance(doc),
            _samples(doc),
            _quantitative(doc),
            _qualitative(doc),
            _precision(doc),
            _per_sample(doc),
            _provenance(doc),
            _METHODS,
            _signature(doc),
        ]
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>{_e(doc['title'])}: {model}</title><style>{_CSS}</style></head><body>"
        + body
        + "</body></html>\n"
    )
