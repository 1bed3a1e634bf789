"""Bag representations: bags → embeddings whose distance is a distribution distance."""

from .base import BagRepresentation, Embedding, FeatureEmbedding
from .density import DensityFeatures, HistogramEmbedding
from .mean import MeanEmbedding, SetKernelEmbedding, set_kernel_gram
from .sliced import (
    SlicedWasserstein,
    sliced_wasserstein_distance,
    uniform_directions,
    wasserstein_1d,
)

__all__ = [
    "BagRepresentation",
    "DensityFeatures",
    "Embedding",
    "FeatureEmbedding",
    "HistogramEmbedding",
    "MeanEmbedding",
    "SetKernelEmbedding",
    "SlicedWasserstein",
    "set_kernel_gram",
    "sliced_wasserstein_distance",
    "uniform_directions",
    "wasserstein_1d",
]
