"""Estimators on bags (scikit-learn compatible)."""

from .cme import ConditionalMeanEmbedding, incomplete_cholesky
from .ridge import DistributionRidge, DistributionRidgeClassifier
from .transfer import (
    MarginalTransferClassifier,
    MarginalTransferRegressor,
    TaskPrediction,
    TaskReport,
)

__all__ = [
    "ConditionalMeanEmbedding",
    "DistributionRidge",
    "DistributionRidgeClassifier",
    "MarginalTransferClassifier",
    "MarginalTransferRegressor",
    "TaskPrediction",
    "TaskReport",
    "incomplete_cholesky",
]
