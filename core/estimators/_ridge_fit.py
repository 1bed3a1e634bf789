"""The search and the solve of kernel ridge on bags, for any subset of the training bags.

:class:`RidgeDesign` holds the training bags as the ridge sees them, computed once:
the kernel's base matrix (squared distances or inner products, dual models), explicit
features (primal models), or explicit features and random Fourier frequencies (the
random-feature path). :meth:`RidgeDesign.fit` searches ``γ`` and ``λ`` by the
closed-form leave-one-bag-out (or leave-one-group-out) criterion and solves, on the
bags it is given: all of them for the model, or the training side of a calibration
fold (:mod:`._ridge_calibration`), where the search is repeated exactly as for the
model. :meth:`RidgeDesign.rows` gives the design rows of new bags for a fitted ``γ``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg
from numpy.typing import ArrayLike, NDArray

from .._random import check_generator
from ..kernels import DistanceKernel, random_fourier_features
from ..representations.base import Embedding, FeatureEmbedding
from ..selection import GroupBlocks, as_grid, gamma_grid, ridge_selection_scores

__all__ = ["RidgeDesign", "RidgeFit", "spd_solve"]

# The median heuristic of the random-feature path looks at this many bags at most.
_MEDIAN_BAGS = 1000


@dataclass
class RidgeFit:
    """One fitted ridge: the choice, its search, and the coefficients.

    Attributes
    ----------
    gamma : float or None
    alpha : float
    gammas, alphas : ndarray
        The grids searched.
    scores : ndarray of shape (n_gamma, n_alpha)
        The criterion (NaN when nothing was searched).
    coef : ndarray of shape (n_bags, k) (dual) or (n_features, k) (primal)
    intercept : ndarray of shape (k,)
    """

    gamma: float | None
    alpha: float
    gammas: NDArray[np.float64]
    alphas: NDArray[np.float64]
    scores: NDArray[np.float64]
    coef: NDArray[np.float64]
    intercept: NDArray[np.float64]

    @property
    def searched(self) -> bool:
        return self.gammas.size * self.alphas.size > 1

    @property
    def choice(self) -> tuple[int, int]:
        """Indices of the chosen ``γ`` and ``λ`` in their grids."""
        gi = 0 if self.gamma is None else int(np.argmin(np.abs(self.gammas - self.gamma)))
        return gi, int(np.argmin(np.abs(self.alphas - self.alpha)))


class RidgeDesign:
    """The training bags of a kernel ridge on bags, for fits on any subset of them.

    Parameters
    ----------
    emb : Embedding
        The training bags' embedding.
    kernel : DistanceKernel
    n_components : int or None
        Random Fourier features of the embeddings (the primal path of paper 001 eq. 7).
    random_state : int, Generator or None
        Seeds the random frequencies.
    """

    def __init__(
        self, emb: Embedding, kernel: DistanceKernel, n_components: int | None, random_state: Any
    ) -> None:
        self.kernel = kernel
        T = len(emb)
        self.rff_base: NDArray[np.float64] | None = None
        self.features: NDArray[np.float64] | None = None
        self.base: NDArray[np.float64] | None = None
        if n_components is not None:
            if kernel.name != "gaussian" or not isinstance(emb, FeatureEmbedding):
                raise ValueError(
                    "n_components (random features of the embeddings) needs kernel='gaussian' "
                    "and a representation with explicit features"
                )
            if int(n_components) != n_components or n_components < 2:
                raise ValueError(f"n_components must be an integer >= 2, got {n_components!r}")
            self.kind = "rff"
            self.rng = check_generator(random_state)
            half = int(n_components) // 2
            self.features = emb.features
            self.geometry = emb.geometry
            if emb.geometry == "euclidean":
                self.rff_base = self.rng.standard_normal((half, emb.features.shape[1]))
            else:
                self.rff_base = self.rng.standard_cauchy((half, emb.features.shape[1]))
        elif (
            kernel.name == "linear"
            and isinstance(emb, FeatureEmbedding)
            and emb.geometry == "euclidean"
            and emb.features.shape[1] < T
        ):
            # Explicit features narrower than the number of bags: solve in feature space.
            self.kind = "linear"
            self.features = emb.features
        else:
            self.kind = "dual"
            self.base = emb.inner() if kernel.uses_inner_product else emb.sq_distances()

    @property
    def primal(self) -> bool:
        return self.kind != "dual"

    # ------------------------------------------------------------------ new bags
    def rff(self, F: NDArray[np.float64], gamma: float) -> NDArray[np.float64]:
        """``z(φ)`` with ``z(a)ᵀz(b) ≈ exp(-γ D²(a, b))``: Gaussian frequencies of variance
        ``2γ`` for Euclidean embeddings, Cauchy of scale ``γ`` for ℓ1 ones (SW_1)."""
        assert self.rff_base is not None
        scale = np.sqrt(2.0 * gamma) if self.geometry == "euclidean" else gamma
        return random_fourier_features(F, self.rff_base * scale)

    def train_rows(self, idx: NDArray[np.int64], gamma: float | None) -> NDArray[np.float64]:
        """Design rows of training bags ``idx`` against the same bags (dual: the Gram
        block; primal: their features)."""
        if self.kind == "dual":
            assert self.base is not None
            return self.kernel(self.base[np.ix_(idx, idx)], gamma)
        assert self.features is not None
        F = self.features[idx]
        return self.rff(F, gamma) if self.kind == "rff" else F  # type: ignore[arg-type]

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        idx: NDArray[np.int64],
        Y: NDArray[np.float64],
        *,
        gamma: float | ArrayLike | None,
        alpha: float | ArrayLike | None,
        default_alphas: NDArray[np.float64],
        fit_intercept: bool,
        criterion: str,
        groups: GroupBlocks | None = None,
    ) -> RidgeFit:
        """Search ``γ`` and ``λ`` on the bags ``idx`` (targets ``Y``, their rows) and
        solve with the choice; the ridge is ``λ·len(idx)``.

        ``groups`` (of the bags ``idx``) makes the criterion leave-one-group-out.
        """
        T = idx.size
        alphas = as_grid(alpha, default_alphas, "alpha")
        intercept = Y.mean(axis=0) if fit_intercept else np.zeros(Y.shape[1])
        Yc = Y - intercept
        kern = self.kernel
        if self.kind == "dual":
            assert self.base is not None
            base = self.base[np.ix_(idx, idx)]
            if kern.has_gamma:
                gammas = as_grid(gamma, gamma_grid(base, kern), "gamma")
            else:
                gammas = np.array([np.nan])
        elif self.kind == "rff":
            assert self.features is not None
            F = self.features[idx]
            # The model's own fit draws from the generator right after the frequencies,
            # as it always has; calibration folds draw next.
            sample = F if T <= _MEDIAN_BAGS else F[self.rng.choice(T, _MEDIAN_BAGS, replace=False)]
            sq = FeatureEmbedding(sample, self.geometry).sq_distances()
            gammas = as_grid(gamma, gamma_grid(sq, kern), "gamma")
        else:
            gammas = np.array([np.nan])
        scores = np.full((gammas.size, alphas.size), np.nan)
        if gammas.size * alphas.size > 1:
            for gi, g in enumerate(gammas):
                rows = self.train_rows(idx, None if np.isnan(g) else float(g))
                if self.kind == "dual":
                    vals, vecs = np.linalg.eigh(rows)
                else:
                    vecs, sv, _ = np.linalg.svd(rows, full_matrices=False)
                    vals = sv**2
                scores[gi] = ridge_selection_scores(
                    vals,
                    vecs,
                    Y,
                    alphas,
                    fit_intercept=fit_intercept,
                    criterion=criterion,  # type: ignore[arg-type]
                    groups=groups,
                )
            gi, ai = argmin_prefer_smooth(scores)
        else:
            gi, ai = 0, 0
        chosen_gamma = None if np.isnan(gammas[gi]) else float(gammas[gi])
        chosen_alpha = float(alphas[ai])
        rows = self.train_rows(idx, chosen_gamma)
        if self.kind == "dual":
            K = rows.copy()
            K[np.diag_indices_from(K)] += chosen_alpha * T
            coef = spd_solve(K, Yc)
        else:
            A = rows.T @ rows
            A[np.diag_indices_from(A)] += chosen_alpha * T
            coef = spd_solve(A, rows.T @ Yc)
        return RidgeFit(chosen_gamma, chosen_alpha, gammas, alphas, scores, coef, intercept)


def argmin_prefer_smooth(scores: NDArray[np.float64]) -> tuple[int, int]:
    """Index of the smallest score; ties go to the largest ``λ`` then smallest ``γ``."""
    if not np.isfinite(scores).any():
        raise FloatingPointError(
            "every (gamma, alpha) pair interpolates the training targets exactly, so the "
            "leave-one-out error is undefined; give larger alpha values"
        )
    flipped = scores[:, ::-1]
    gi, ai = np.unravel_index(int(np.argmin(flipped)), flipped.shape)
    return int(gi), int(scores.shape[1] - 1 - ai)


def spd_solve(A: NDArray[np.float64], B: NDArray[np.float64]) -> NDArray[np.float64]:
    """Solve ``A x = B`` for symmetric positive (semi)definite ``A`` (Cholesky first)."""
    try:
        return scipy.linalg.solve(A, B, assume_a="pos")
    except (np.linalg.LinAlgError, scipy.linalg.LinAlgError):
        return scipy.linalg.solve(A, B, assume_a="sym")
