"""Estimators on bags (scikit-learn compatible)."""

from .ridge import DistributionRidge, DistributionRidgeClassifier
from .transfer import (
    MarginalTransferClassifier,
    MarginalTransferRegressor,
    TaskPrediction,
    TaskReport,
)

__all__ = [
    "DistributionRidge",
    "DistributionRidgeClassifier",
    "MarginalTransferClassifier",
    "MarginalTransferRegressor",
    "TaskPrediction",
    "TaskReport",
]
