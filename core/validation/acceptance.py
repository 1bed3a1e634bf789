"""The study's results against the laboratory's acceptance limits: pass, fail, or not
shown.

Every limit of ``[acceptance]`` (:data:`~core.validation.config.ACCEPTANCE_KEYS`) is a
closed interval ``[low, high]``. As CLSI EP09 compares a bias with the allowable bias
through its confidence interval, a criterion

* **passes** when its confidence interval lies in the limits (the data show the
  criterion met at the stated confidence),
* **fails** when its point estimate lies outside them (for ``limits_of_agreement``:
  either limit), or it could not be estimated,
* is **not shown** when its point estimate lies inside but its confidence interval
  reaches beyond: too few samples to tell, which a director must not read as a pass.

A statistic without a confidence interval (the limits of agreement themselves) is
judged on its estimate. Each criterion is judged on every analysis set (all samples,
and without the declined ones), for every measurand (per-cell models: every
population) and, for sensitivity, specificity, PPV and NPV, every class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from .config import ACCEPTANCE_KEYS

__all__ = ["NOT_SHOWN", "judge", "overall"]

#: The verdict of an estimate inside the limits whose confidence interval is not.
NOT_SHOWN = "not shown"

_QUANTITATIVE = ("bias", "limits_of_agreement", "ratio_bias", "slope", "intercept", "r")
_PER_CLASS = ("sensitivity", "specificity", "ppv", "npv")


def judge(
    limits: Mapping[str, tuple[float, float]],
    quantitative: Mapping[str, Sequence[Mapping[str, Any]]] | None,
    qualitative: Mapping[str, Mapping[str, Any]] | None,
) -> list[dict[str, Any]]:
    """One row per judged estimate.

    Returns
    -------
    list of dict
        ``criterion``, ``statistic`` (what was judged), ``set``, ``subject`` (the
        measurand or class), ``estimate`` (or ``[lower, upper]`` for the limits of
        agreement), ``ci``, ``low``, ``high``, ``verdict`` (``"pass"``, ``"fail"`` or
        :data:`NOT_SHOWN`) and ``pass`` (the verdict is ``"pass"``).

    Raises
    ------
    ConfigError
        A limit applies to nothing the model gives (a regression limit for a
        classifier, a qualitative one for a regressor).
    """
    rows: list[dict[str, Any]] = []
    for key, (low, high) in limits.items():
        if key in _QUANTITATIVE:
            if quantitative is None:
                raise ConfigError(
                    f"[acceptance] {key}: the model gives classes, not values; no "
                    f"{ACCEPTANCE_KEYS[key]} to judge"
                )
            for which, analyses in quantitative.items():
                for a in analyses:
                    for statistic, estimate, ci in _quantitative_estimates(key, a):
                        rows.append(
                            _row(key, statistic, which, a["measurand"], estimate, ci, low, high)
                        )
        else:
            if qualitative is None:
                raise ConfigError(
                    f"[acceptance] {key}: the model gives values, not classes; no "
                    f"{ACCEPTANCE_KEYS[key]} to judge"
                )
            for which, q in qualitative.items():
                if key == "concordance":
                    rows.append(
                        _row(
                            key,
                            "concordance",
                            which,
                            "all classes",
                            q["concordance"]["estimate"],
                            q["concordance"]["ci"],
                            low,
                            high,
                        )
                    )
                elif key == "kappa":
                    rows.append(
                        _row(
                            key,
                            "Cohen's kappa",
                            which,
                            "all classes",
                            q["kappa"]["kappa"],
                            q["kappa"]["kappa_ci"],
                            low,
                            high,
                        )
                    )
                else:
                    for c in q["per_class"]:
                        share = c[key]
                        rows.append(
                            _row(
                                key,
                                key,
                                which,
                                c["class"],
                                share["estimate"],
                                share["ci"],
                                low,
                                high,
                            )
                        )
    return rows


def _quantitative_estimates(key: str, a: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(statistic, estimate, ci) of one measurand's analysis for a limit."""
    ba, ratio = a["bland_altman"], a["ratio"]
    if key == "bias":
        return [("Bland–Altman bias", ba.get("bias"), ba.get("bias_ci"))]
    if key == "ratio_bias":
        return [("Bland–Altman bias, ratio scale", ratio.get("bias"), ratio.get("bias_ci"))]
    if key == "limits_of_agreement":
        both = None if "lower" not in ba else [ba["lower"], ba["upper"]]
        return [("95 % limits of agreement", both, None)]
    if key == "r":
        return [("Pearson r", a["correlation"].get("r"), a["correlation"].get("r_ci"))]
    return [
        (f"{label} {key}", a[method].get(key), a[method].get(f"{key}_ci"))
        for method, label in (("deming", "Deming"), ("passing_bablok", "Passing–Bablok"))
    ]


def _row(
    key: str,
    statistic: str,
    which: str,
    subject: str,
    estimate: Any,
    ci: Any,
    low: float,
    high: float,
) -> dict[str, Any]:
    values = estimate if isinstance(estimate, list) else [estimate]
    inside = all(v is not None and v == v and low <= v <= high for v in values)
    bounds = [v for v in (ci or []) if v is not None]
    shown = len(bounds) == 2 and all(v == v and low <= v <= high for v in bounds)
    verdict = "fail" if not inside else "pass" if shown or ci is None else NOT_SHOWN
    return {
        "criterion": key,
        "statistic": statistic,
        "set": which,
        "subject": subject,
        "estimate": estimate,
        "ci": ci,
        "low": low,
        "high": high,
        "verdict": verdict,
        "pass": verdict == "pass",
    }


def overall(rows: Sequence[Mapping[str, Any]]) -> str:
    """The study's verdict: ``"fail"`` if any criterion fails, else :data:`NOT_SHOWN`
    if any is not shown, else ``"pass"`` (or that no limits were given)."""
    if not rows:
        return "no acceptance limits given"
    verdicts = {r["verdict"] for r in rows}
    return "fail" if "fail" in verdicts else NOT_SHOWN if NOT_SHOWN in verdicts else "pass"
