"""bagserve core: learning on bags of points (distributions seen through samples).

Public API (DESIGN.md section 4)::

    from bagserve.core import Bags, SlicedWasserstein, MeanEmbedding
    from bagserve.core import DistributionRidge, DistributionRidgeClassifier
    from bagserve.core import MarginalTransferClassifier, MarginalTransferRegressor
    from bagserve.core import save, load

Every error the core raises on purpose derives from :class:`CoreError` (and from
``ValueError``): see :mod:`core.errors`.

The names above are imported on first use (PEP 562): ``import bagserve.core`` and the
light modules under it (:mod:`.errors`, :mod:`.hashing`, :mod:`.atomic`) load neither
scikit-learn nor scipy, so that ``bagserve --version``, ``bagserve models list`` and
the service's auditor start in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .. import __version__

if TYPE_CHECKING:  # the eager imports, for type checkers and IDEs only
    from .artifacts import ArtifactError, load, read_manifest, save
    from .bags import Bags, BagValidationError, as_bags
    from .errors import CoreError
    from .estimators import (
        ConditionalMeanEmbedding,
        DistributionRidge,
        DistributionRidgeClassifier,
        MarginalTransferClassifier,
        MarginalTransferRegressor,
        TaskPrediction,
        TaskReport,
    )
    from .explanations import Explanation, explain
    from .kernels import DistanceKernel, get_kernel
    from .representations import (
        DensityFeatures,
        HistogramEmbedding,
        MeanEmbedding,
        SlicedWasserstein,
        sliced_wasserstein_distance,
        wasserstein_1d,
    )

#: Where each public name lives (a submodule relative to this package).
_EXPORTS: dict[str, str] = {
    "ArtifactError": ".errors",
    "BagValidationError": ".errors",
    "CoreError": ".errors",
    "load": ".artifacts",
    "read_manifest": ".artifacts",
    "save": ".artifacts",
    "Bags": ".bags",
    "as_bags": ".bags",
    "ConditionalMeanEmbedding": ".estimators",
    "DistributionRidge": ".estimators",
    "DistributionRidgeClassifier": ".estimators",
    "MarginalTransferClassifier": ".estimators",
    "MarginalTransferRegressor": ".estimators",
    "TaskPrediction": ".estimators",
    "TaskReport": ".estimators",
    "Explanation": ".explanations",
    "explain": ".explanations",
    "DistanceKernel": ".kernels",
    "get_kernel": ".kernels",
    "DensityFeatures": ".representations",
    "HistogramEmbedding": ".representations",
    "MeanEmbedding": ".representations",
    "SlicedWasserstein": ".representations",
    "sliced_wasserstein_distance": ".representations",
    "wasserstein_1d": ".representations",
}

__all__ = [
    "ArtifactError",
    "BagValidationError",
    "Bags",
    "ConditionalMeanEmbedding",
    "CoreError",
    "DensityFeatures",
    "DistanceKernel",
    "DistributionRidge",
    "DistributionRidgeClassifier",
    "Explanation",
    "HistogramEmbedding",
    "MarginalTransferClassifier",
    "MarginalTransferRegressor",
    "MeanEmbedding",
    "SlicedWasserstein",
    "TaskPrediction",
    "TaskReport",
    "__version__",
    "as_bags",
    "explain",
    "get_kernel",
    "load",
    "read_manifest",
    "save",
    "sliced_wasserstein_distance",
    "wasserstein_1d",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and keep the name here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
