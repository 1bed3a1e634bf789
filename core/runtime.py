"""One model runtime: a saved artifact that knows what it answers, and answers it typed.

Everything that predicts with a saved model goes through here: the ``bagserve predict``
and ``bagserve evaluate`` commands and the service's worker processes. Nothing else
aligns and preprocesses a model's input or shapes its answer.

* :class:`~bagserve.core.artifact_info.ArtifactInfo`: a verified manifest: kind, panel,
  preprocessing, sizes, hashes, and what can be asked of the model.
* :class:`ModelRuntime`: the info plus the fitted estimator; :meth:`ModelRuntime.predict`
  returns one of the typed results of :mod:`bagserve.core.results`, with the status
  the model's out-of-domain policy (:mod:`bagserve.core.policy`) gives each bag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

# The estimators (scikit-learn, scipy) are imported where a model is loaded or its
# class asked about: reading a manifest (ArtifactInfo, ``bagserve models list``) does
# without them.
from .artifact_info import ArtifactInfo, kind_of
from .artifacts import VerifiedArtifact, load_verified, read_verified
from .bags import Bags
from .domain import DomainReport
from .io import Sample
from .policy import statuses
from .results import (
    CellPrediction,
    ClassificationPrediction,
    ConditionalPrediction,
    ModelKind,
    Prediction,
    RegressionPrediction,
)

if TYPE_CHECKING:
    from .explanations import Explanation

# ArtifactInfo is documented here too (docs/reference/artifacts.md): the runtime's
# public pair.
__all__ = ["ArtifactInfo", "ModelRuntime"]

#: Bag-level models predict chunks of bags of at most this many points in all (a bag
#: larger than that is a chunk of its own): it bounds the memory of one call.
CHUNK_POINTS = 2_000_000


class ModelRuntime:
    """A loaded model that aligns, preprocesses and predicts bags, with typed answers.

    Parameters
    ----------
    info : ArtifactInfo
    model : estimator
        The fitted estimator of the artifact.

    Examples
    --------
    >>> runtime = ModelRuntime.open("models/yeast-dose/1")  # doctest: +SKIP
    >>> bags = runtime.align([read_sample("Yeast_B1_B01.fcs")])  # doctest: +SKIP
    >>> runtime.predict(bags).values  # doctest: +SKIP
    """

    def __init__(self, info: ArtifactInfo, model: Any) -> None:
        self.info = info
        self.model = model
        self.kind = kind_of(type(model))

    @classmethod
    def open(cls, path: str | Path, *, mmap: bool = False, trusted: bool = False) -> ModelRuntime:
        """Load the artifact at ``path``: its files read once, verified, and computed
        from in memory (:func:`~bagserve.core.artifacts.read_verified`); changing the
        files afterwards changes none of its answers.

        Parameters
        ----------
        path : path
        mmap : bool, default=False
            Hold the arrays in a sealed anonymous memory file (read-only, shareable
            with other processes) instead of memory of this process.
        trusted : bool, default=False
            Allow a joblib (pickle) artifact.

        Raises
        ------
        ArtifactError
            The artifact does not verify (a file tampered with, truncated or missing),
            or cannot be loaded.
        """
        return cls.from_verified(read_verified(path, shared=mmap), trusted=trusted)

    @classmethod
    def from_verified(cls, verified: VerifiedArtifact, *, trusted: bool = False) -> ModelRuntime:
        """The runtime of an artifact read and verified already, in this process or
        in another one (:meth:`VerifiedArtifact.attach`): manifest and arrays both
        from its verified bytes."""
        info = ArtifactInfo(verified.path, verified.manifest)
        return cls(info, load_verified(verified, trusted=trusted))

    def align(self, samples: Sequence[Sample], *, compensated: bool = False) -> Bags:
        """Bags of the samples' columns, compensated as the model was trained, in the
        model's panel order (matched by name).

        Raises
        ------
        DataError
            A sample lacks one of the model's markers or, for a model that compensates,
            a spillover channel or its matrix (the error names it). With
            ``compensated=True`` the caller vouches that the cells were compensated
            already, and the model's compensation is skipped.
        """
        panel = self.info.panel
        compensation = self.info.preprocessing.compensation
        if not compensated:
            samples = [compensation.apply(s) for s in samples]
        if panel is None:
            return Bags.from_arrays([s.points for s in samples])
        return Bags.from_arrays([panel.select(s) for s in samples])

    def preprocess(self, bags: Bags) -> Bags:
        """The artifact's preprocessing (transforms, scaling) applied to aligned bags."""
        return self.info.preprocessing.apply(bags, self.info.markers)

    def predict(
        self,
        bags: Bags,
        *,
        quantiles: Sequence[float] = (),
        exceed: Sequence[float] = (),
        coverage: float | None = None,
        probabilities: bool = False,
        unassigned: float | None = None,
        control: Bags | None = None,
        preprocessed: bool = False,
    ) -> Prediction:
        """The model's typed answer for aligned bags.

        Parameters
        ----------
        bags : Bags
            Columns in the model's panel order (:meth:`align`).
        quantiles, exceed : sequence of float
            Quantile levels and exceedance thresholds (conditional models only).
        coverage : float in (0, 1), optional
            Add a prediction interval of this coverage to each bag's answer (conformal
            jackknife+ for regressors, the conditional quantiles ``(1 ∓ coverage) / 2``
            for conditional models) or a conformal prediction set (classifiers).
        probabilities : bool, default=False
            Per-cell classifiers: every cell's class probabilities (the population
            summary's mean probabilities come without asking).
        unassigned : float in (0, 1), optional
            Per-cell classifiers: cells beyond this χ² level of Mahalanobis distance
            from the population they were given (under its training covariance) are
            answered ``"unassigned"`` (:meth:`MarginalTransferClassifier.far_from_populations`),
            a row of their own in the population summary. The model's probabilities
            say nothing of that rule: asked together with ``probabilities`` it is
            refused, and the summary's mean probabilities are left out where it adds
            the row.
        control : Bags, optional
            Per-cell models fitted with a reference control: the control measured in
            the bags' batch (one bag, aligned like them), which maps every bag onto
            the training batch before the model answers
            (:meth:`MarginalTransferClassifier.predict_tasks`). Preprocessed with
            the bags.
        preprocessed : bool, default=False
            The bags (and the control) already went through :meth:`preprocess`.

        Returns
        -------
        Prediction
            A :class:`CellPrediction`, :class:`ClassificationPrediction`,
            :class:`ConditionalPrediction` or :class:`RegressionPrediction`.
        """
        problem = self.info.distribution_query_problem() if quantiles or exceed else None
        if problem is None and coverage is not None:
            problem = self.info.interval_problem(coverage)
        if problem is None and probabilities:
            problem = self.info.probability_problem()
        if problem is None and unassigned is not None:
            problem = self.info.far_cells_problem()
            if problem is None and not 0.0 < unassigned < 1.0:
                problem = f"unassigned must be a level in (0, 1) such as 0.999, got {unassigned!r}"
            if problem is None and probabilities:
                problem = "ask for probabilities or unassigned cells, not both"
        if problem is None and control is not None:
            problem = self.info.control_problem(control)
        if problem is not None:
            raise ValueError(problem)
        if not preprocessed:
            bags = self.preprocess(bags)
            control = None if control is None else self.preprocess(control)
        result = self._predict(
            bags, quantiles, exceed, coverage, probabilities, unassigned, control
        )
        # The one place the out-of-domain policy is applied: every door reads status.
        domain = result.domain
        status = statuses(
            self.info.out_of_domain_policy,
            None if domain is None else domain.out_of_range,
            result.n_bags,
        )
        return dataclasses.replace(result, status=status)

    def explain(
        self, bags: Bags, *, control: Bags | None = None, preprocessed: bool = False
    ) -> list[Explanation]:
        """Per-cell contributions to each bag's prediction (:func:`core.explain`), the
        cells as the model sees them (after its preprocessing) and named by its panel.
        A per-cell model explains the share of each bag's cells in each class (or their
        mean value), calibrated by the batch's ``control`` where given, as
        :meth:`predict` labels them.

        Raises
        ------
        TypeError
            A model without an explanation: a representation without one (histograms),
            or a per-cell model saved by the design before issue 44.
        """
        from .explanations import explain

        if self.kind is ModelKind.CELL and not hasattr(self.model, "explain"):
            raise TypeError(
                "this per-cell model was saved by the marginal-transfer design before "
                "issue 44, which has no explanation; retrain it with this version to "
                "explain its answers"
            )
        if not preprocessed:
            bags = self.preprocess(bags)
            control = None if control is None else self.preprocess(control)
        markers = self.info.markers or None
        if self.kind is ModelKind.CELL:
            cells = None if control is None else control.points
            return [
                self.model.explain(bags[i], control=cells, markers=markers)
                for i in range(len(bags))
            ]
        return [
            explain(self.model, bags.take(np.array([i])), markers=markers) for i in range(len(bags))
        ]

    def _predict(
        self,
        bags: Bags,
        quantiles: Sequence[float],
        exceed: Sequence[float],
        coverage: float | None,
        probabilities: bool,
        unassigned: float | None = None,
        control: Bags | None = None,
    ) -> Prediction:
        sizes = np.asarray(bags.sizes, dtype=np.int64)
        if self.kind is ModelKind.CELL:
            return self._predict_cells(bags, sizes, probabilities, unassigned, control)
        parts = [
            self._predict_chunk(bags[a:b], quantiles, exceed, coverage) for a, b in _chunks(sizes)
        ]
        merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k != "domain"}
        extra: dict[str, Any] = {
            "sizes": sizes,
            "clipped": self._clipped(bags),
            "domain": _concat_domains([p["domain"] for p in parts]),
            "interval": merged.get("interval"),
        }
        if self.kind is ModelKind.CONDITIONAL:
            return ConditionalPrediction(
                mean=merged["mean"],
                levels=np.asarray(quantiles, dtype=np.float64),
                quantiles=merged["quantiles"],
                thresholds=np.asarray(exceed, dtype=np.float64),
                exceedance=merged["exceedance"],
                **extra,
            )
        if self.kind is ModelKind.CLASSIFICATION:
            scores = merged["scores"]
            if scores.shape[1] == 1:  # binary: one margin for classes[1]
                scores = np.hstack([-scores, scores])
            return ClassificationPrediction(
                labels=merged["values"],
                classes=np.asarray(self.model.classes_),
                scores=scores,
                probabilities=merged.get("probabilities"),
                sets=merged.get("sets"),
                **extra,
            )
        return RegressionPrediction(values=merged["values"], **extra)

    def _predict_chunk(
        self,
        bags: Bags,
        quantiles: Sequence[float],
        exceed: Sequence[float],
        coverage: float | None,
    ) -> dict[str, Any]:
        """One chunk of bags, embedded once for the answer, its interval or set, and
        the domain check."""
        model = self.model
        emb = model.representation_.embed(bags)
        out: dict[str, Any] = {"domain": model.domain_check(emb)}
        if self.kind is ModelKind.CONDITIONAL:
            levels = list(quantiles)
            if coverage is not None:
                levels += [(1.0 - coverage) / 2.0, (1.0 + coverage) / 2.0]
            # One kernel evaluation for the mean and every quantity.
            mean, q, out["exceedance"] = model.summary(
                emb, np.asarray(levels, dtype=np.float64), np.asarray(exceed, dtype=np.float64)
            )
            out["mean"], out["quantiles"] = mean, q[:, : len(quantiles)]
            if coverage is not None:
                out["interval"] = q[:, len(quantiles) :]
            return out
        out["values"] = np.asarray(model.predict(emb))
        if self.kind is ModelKind.REGRESSION and coverage is not None:
            out["interval"] = np.asarray(
                model.predict_interval(emb, coverage, domain_scores=out["domain"].score)
            )
        if self.kind is ModelKind.CLASSIFICATION:
            scores = np.asarray(model.decision_function(emb))
            out["scores"] = scores[:, None] if scores.ndim == 1 else scores
            if self.info.calibrated:
                out["probabilities"] = np.asarray(model.predict_proba(emb))
            if coverage is not None:
                out["sets"] = np.asarray(
                    model.predict_set(emb, coverage, domain_scores=out["domain"].score)
                )
        return out

    def _predict_cells(
        self,
        bags: Bags,
        sizes: NDArray[np.int64],
        probabilities: bool,
        unassigned: float | None = None,
        control: Bags | None = None,
    ) -> CellPrediction:
        cells = None if control is None else control.points
        results = self.model.predict_tasks(bags, control=cells)
        labels = np.concatenate([r.predictions for r in results])
        domain = self.model.domain_report([r.report for r in results])
        classes = getattr(self.model, "classes_", None)
        if classes is None:
            return CellPrediction(labels=labels, sizes=sizes, domain=domain)
        classes = np.asarray(classes)
        codes = np.searchsorted(classes, labels)
        added = False
        if unassigned is not None:
            from .estimators.transfer.open_set import UNASSIGNED

            far = self.model.far_from_populations(bags, labels, unassigned, control=cells)
            rest = [k for k, c in enumerate(classes.tolist()) if c == UNASSIGNED]
            if not rest:
                # The model has no rest class: "unassigned" becomes a row of its own.
                classes = np.append(classes.astype(str), UNASSIGNED)
                rest, added = [classes.size - 1], True
            # Strings throughout: the answer crosses processes as plain arrays.
            labels = np.where(far, UNASSIGNED, labels.astype(str))
            codes = np.where(far, rest[0], codes)
        # Counts per (bag, class) in one bincount: bag index times K plus class code.
        bag_of = np.repeat(np.arange(sizes.shape[0]), sizes)
        counts = np.bincount(
            bag_of * classes.size + codes, minlength=sizes.shape[0] * classes.size
        ).reshape(sizes.shape[0], classes.size)
        temperature = self.info.probability_temperature
        mean_p = per_cell = None
        if temperature is not None and not added:
            from .calibration import probabilities as calibrated_probabilities

            per_cell = calibrated_probabilities(
                np.concatenate([r.scores for r in results]), temperature
            )
            # A bag's cells are contiguous (no bag is empty): sums by reduceat.
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            mean_p = np.add.reduceat(per_cell, starts, axis=0) / sizes[:, None]
        return CellPrediction(
            labels=labels,
            sizes=sizes,
            domain=domain,
            classes=classes,
            counts=counts.astype(np.int64),
            mean_probabilities=mean_p,
            probabilities=per_cell if probabilities else None,
        )

    def _clipped(self, bags: Bags) -> NDArray[np.int64] | None:
        # Representations with a bounded domain (density features) clip new points into
        # the training range: callers are told how many, per bag.
        rep = getattr(self.model, "representation_", None)
        if hasattr(rep, "clipped_counts"):
            return np.asarray(rep.clipped_counts(bags), dtype=np.int64)
        return None


def _concat_domains(parts: list[DomainReport | None]) -> DomainReport | None:
    if any(p is None for p in parts):
        return None
    # Fields no part has (a control's report on bag-level models) stay unset.
    fields = [
        f.name
        for f in dataclasses.fields(DomainReport)
        if all(getattr(p, f.name) is not None for p in parts)
    ]
    return DomainReport(
        **{f: np.concatenate([getattr(p, f) for p in parts]) for f in fields}  # type: ignore[arg-type]
    )


def _chunks(sizes: NDArray[np.int64], limit: int = CHUNK_POINTS) -> list[tuple[int, int]]:
    """Consecutive ranges of bags with at most ``limit`` points each (a larger bag
    alone); a loop over bags, never over points."""
    out = []
    start, n = 0, len(sizes)
    while start < n:
        stop, total = start + 1, int(sizes[start])
        while stop < n and total + int(sizes[stop]) <= limit:
            total += int(sizes[stop])
            stop += 1
        out.append((start, stop))
        start = stop
    return out
