"""Marginal-transfer models saved by the design before issue 44, loaded: they answer as
they did, bit for bit (:func:`core.estimators.transfer.artifact_class` routes their
manifests here; new models use :mod:`core.estimators.transfer`).

That design (paper 004, Blanchard et al., JMLR 2021) scored every cell ``x`` of a new
task ``P`` with the product kernel ``k_X(x, x') (τ + (1 - τ) k_P(P, P'))``. Only what a
saved model's answer runs through is kept, in this order:

1. a batch's reference control maps the task onto the training batch
   (``control_quantiles_``, :func:`~.calibration.mapped_by_control`);
2. the task is normalised (``normalise_``: ``"none"``, ``"standard"`` or
   ``"quantile"`` onto ``quantile_reference_``), embedded, and compared with the
   training tasks (:mod:`.reports`);
3. a task out of range is calibrated (``calibration_``: quantile, landmark or MMD
   maps, :mod:`.calibration`, :mod:`.mmd`) and answered by the primary model, or
   answered by the invariant fallback (``fallback_``, a model of the same class on
   standardised tasks) where there is one; a task on which the two disagree by more
   than ``disagreement_threshold_`` is out of range too;
4. a model answers with its solver (:mod:`.scoring`) or its boosted trees
   (``trees_``), averaged with its blend partner's scores (``blend_``), refined by a
   per-task mixture where it refines (``refine_``, :mod:`.refine`);
5. cells no population claims go to the rest class (``reject_threshold_``,
   :mod:`.reject`).

:mod:`.estimator` holds the two classes. The fitting, search and solver training of
that design went with the rebuild: such a model loads and answers, and cannot be
fitted again.
"""

from .estimator import MarginalTransferClassifier, MarginalTransferRegressor

__all__ = ["MarginalTransferClassifier", "MarginalTransferRegressor"]
