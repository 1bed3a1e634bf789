"""bagserve core: learning on bags of points (distributions seen through samples).

Public API (DESIGN.md section 4)::

    from bagserve.core import Bags, SlicedWasserstein, MeanEmbedding
    from bagserve.core import DistributionRidge, DistributionRidgeClassifier
    from bagserve.core import MarginalTransferClassifier, MarginalTransferRegressor
    from bagserve.core import save, load

Every error the core raises on purpose derives from :class:`CoreError` (and from
``ValueError``): see :mod:`core.errors`.
"""

from .. import __version__
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
from .kernels import DistanceKernel, get_kernel
from .representations import (
    DensityFeatures,
    HistogramEmbedding,
    MeanEmbedding,
    SlicedWasserstein,
    sliced_wasserstein_distance,
    wasserstein_1d,
)

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
    "HistogramEmbedding",
    "MarginalTransferClassifier",
    "MarginalTransferRegressor",
    "MeanEmbedding",
    "SlicedWasserstein",
    "TaskPrediction",
    "TaskReport",
    "__version__",
    "as_bags",
    "get_kernel",
    "load",
    "read_manifest",
    "save",
    "sliced_wasserstein_distance",
    "wasserstein_1d",
]
