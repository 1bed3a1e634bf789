"""Strong simple baselines for per-cell labels on an unseen sample (issue: marginal
transfer must beat them to earn its place).

Each baseline pools the training samples' cells and fits one scikit-learn classifier:

* ``LDA``: linear discriminant analysis (closed form; a pooled linear model),
* ``logistic``: multinomial logistic regression (lbfgs),
* ``HGB``: histogram gradient boosting (early stopping off, 200 iterations),

each on the cells as given, and ``+ std`` after *per-sample standardisation*: every
sample's cells (training and test alike) are centred and scaled by that sample's own
mean and standard deviation per marker, the simplest batch normalisation a lab would
try. Training and test samples are normalised the same way, with nothing fitted on the
test sample's labels.

:func:`baseline_predictions` returns every baseline's per-cell predictions for one
split; :func:`scores` their accuracy and macro-F1. :func:`refined_predictions` gives a
baseline's labels the refinement the marginal-transfer model may apply (a Gaussian
mixture per test sample started at them), to show what that step does for any model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from bagserve.core import Bags
from bagserve.core.bags import standardise_each_bag
from numpy.typing import NDArray
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

__all__ = [
    "BASELINES",
    "baseline_predictions",
    "per_sample_standardised",
    "refined_predictions",
    "scores",
]


def _lda() -> Any:
    return LinearDiscriminantAnalysis()


def _logistic() -> Any:
    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))


def _hgb(seed: int) -> Any:
    return HistGradientBoostingClassifier(max_iter=200, early_stopping=False, random_state=seed)


#: name -> (factory taking the seed, per-sample standardisation)
BASELINES: dict[str, tuple[Any, bool]] = {
    "LDA": (lambda s: _lda(), False),
    "LDA + std": (lambda s: _lda(), True),
    "logistic": (lambda s: _logistic(), False),
    "logistic + std": (lambda s: _logistic(), True),
    "HGB": (_hgb, False),
    "HGB + std": (_hgb, True),
}


def per_sample_standardised(samples: Sequence[NDArray[np.float64]]) -> list[NDArray[np.float64]]:
    """Each sample's cells centred and scaled by its own per-marker mean and std (the
    model's own ``normalise="standard"``, :func:`core.bags.standardise_each_bag`)."""
    bags = standardise_each_bag(Bags.from_arrays([np.asarray(x, np.float64) for x in samples]))
    return np.split(np.asarray(bags.points), bags.offsets[1:-1])


def refined_predictions(
    test: Sequence[NDArray[np.float64]], predictions: Sequence[NDArray[Any]], classes: NDArray[Any]
) -> list[NDArray[Any]]:
    """Each test sample's predicted labels refined by a Gaussian mixture fitted to its
    own (standardised) cells, started at them
    (:func:`bagserve.core.estimators._transfer_refine.refine_scores`)."""
    from bagserve.core.estimators._transfer_refine import refine_scores

    out = []
    for x, labels in zip(per_sample_standardised(test), predictions, strict=True):
        codes = np.searchsorted(classes, labels)
        scores = -np.ones((codes.size, classes.size))
        scores[np.arange(codes.size), codes] = 1.0
        refined, _ = refine_scores(x, scores, seed=0)
        out.append(classes[np.argmax(refined, axis=1)])
    return out


def baseline_predictions(
    train: Sequence[NDArray[np.float64]],
    y_train: Sequence[NDArray[Any]],
    test: Sequence[NDArray[np.float64]],
    *,
    seed: int = 0,
    names: Sequence[str] | None = None,
) -> dict[str, tuple[list[NDArray[Any]], float]]:
    """Per baseline: the predicted label of every test cell (one array per test sample)
    and the fit time in seconds.

    Parameters
    ----------
    train, y_train : sequences of arrays
        Training samples (cells x markers) and each cell's label.
    test : sequence of arrays
        Unseen samples.
    """
    y = np.concatenate([np.asarray(v) for v in y_train])
    sizes = [len(t) for t in test]
    cuts = np.cumsum(sizes)[:-1]
    std_train, std_test = per_sample_standardised(train), per_sample_standardised(test)
    out: dict[str, tuple[list[NDArray[Any]], float]] = {}
    for name in names or BASELINES:
        factory, standardise = BASELINES[name]
        x_train = np.vstack(std_train if standardise else train)
        x_test = np.vstack(std_test if standardise else test)
        model = factory(seed)
        t0 = time.perf_counter()
        model.fit(x_train, y)
        fit = time.perf_counter() - t0
        out[name] = (np.split(model.predict(x_test), cuts), fit)
    return out


def scores(y_true: NDArray[Any], y_pred: NDArray[Any]) -> dict[str, float]:
    """Per-cell accuracy and macro-F1."""
    return {
        "accuracy": float(np.mean(y_true == y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, average="macro")),
    }
