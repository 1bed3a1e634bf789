"""Validation of a saved model against a laboratory's reference method.

Before a laboratory uses a model on patients, it compares the model's results with its
reference method on samples the model was not trained on, and its director signs that
comparison (CLSI EP09 for quantitative results, EP12 for qualitative ones, EP05 for
precision, H62 for flow-cytometry assays). :func:`validate` runs the model as it is
served on such samples and returns the study; :func:`write_study` writes it as
``validation.json``, a self-contained printable ``validation.html`` with a signature
block, and ``per_sample.csv``. ``bagserve validate MODEL DATA.toml --out DIR`` does both.

One module per concept; each imports only modules listed below it::

    study.py        validate(): the model run as served, the analyses, the document
    outputs.py      the three files, one builder each
    html.py         the report page
    acceptance.py   estimates against the limits, pass or fail
    config.py       the validation file (TOML)
    agreement.py    Bland–Altman bias and limits of agreement (difference, ratio)
    regression.py   Deming and Passing–Bablok regression, correlation
    qualitative.py  concordance, sensitivity, specificity, PPV, NPV, kappa, intervals
    precision.py    repeatability and within-laboratory SD and CV from replicates
"""

from __future__ import annotations

from .agreement import Agreement, bland_altman, proportional_trend
from .config import ValidationConfig, load_validation_config
from .html import render_html
from .outputs import per_sample_csv, study_json, write_study
from .precision import precision
from .qualitative import confusion, kappa, proportion, qualitative_agreement
from .regression import Correlation, LineFit, correlation, deming, passing_bablok
from .study import TrainingSampleError, validate

__all__ = [
    "Agreement",
    "Correlation",
    "LineFit",
    "TrainingSampleError",
    "ValidationConfig",
    "bland_altman",
    "confusion",
    "correlation",
    "deming",
    "kappa",
    "load_validation_config",
    "passing_bablok",
    "per_sample_csv",
    "precision",
    "proportion",
    "proportional_trend",
    "qualitative_agreement",
    "render_html",
    "study_json",
    "validate",
    "write_study",
]
