"""bagserve core: learning on bags of points (distributions seen through samples).

Public API (DESIGN.md section 4)::

    from core import Bags, SlicedWasserstein, MeanEmbedding
    from core import DistributionRidge, DistributionRidgeClassifier
    from core import MarginalTransferClassifier, MarginalTransferRegressor
    from core import save, load
"""

from .artifacts import ArtifactError, load, read_manifest, save
from .bags import Bags, BagValidationError, as_bags
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
    "as_bags",
    "get_kernel",
    "load",
    "read_manifest",
    "save",
    "sliced_wasserstein_distance",
    "wasserstein_1d",
]

__version__ = "0.1.0"
