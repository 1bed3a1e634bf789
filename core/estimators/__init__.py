"""Estimators on bags (scikit-learn compatible)."""

from .ridge import DistributionRidge, DistributionRidgeClassifier

__all__ = ["DistributionRidge", "DistributionRidgeClassifier"]
