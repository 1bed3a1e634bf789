"""Marginal transfer as it was before issue 44, frozen so that models saved with it
load and answer as they did (:func:`core.estimators.transfer.artifact_class`).

New models use :mod:`core.estimators.transfer`; nothing here changes but to keep
loading.
"""

from .estimator import MarginalTransferClassifier, MarginalTransferRegressor

__all__ = ["MarginalTransferClassifier", "MarginalTransferRegressor"]
