"""Data generators from the papers (all seeded) and small bundled point clouds.

* :func:`make_gmm_modes` — count the modes of a Gaussian mixture (paper 000 §5.1,
  after Oliva et al. 2014), with :class:`GaussianMixtures` to redraw the points of
  fixed mixtures as the paper's repeats do;
* :func:`make_entropy_bags` — learn the entropy of the first marginal of rotated 2-D
  Gaussians (paper 003 supplement A.2.1; the paper's formula, not ITE's);
* :func:`load_digits_clouds` — scikit-learn's bundled 8×8 digits as weighted 2-D point
  clouds, optionally rotated and translated (paper 000 §5.2's MNIST recipe);
* :func:`make_ellipse_tasks` — the rotated-ellipse domain-generalization tasks of
  paper 004 (Algorithm 1);
* :func:`make_cytometry_tasks` — synthetic flow-cytometry-like samples: shared cell
  populations, sample-specific proportions and instrument/batch shifts;
* :func:`make_batched_cytometry_tasks` — the same in batches with affine, non-linear
  and population shifts per batch (domain generalisation across batches);
* :func:`emulate_batches` — new samples in instrument batches emulated from real
  labelled samples (their populations' own shapes, the ungated cells as they are);
* :func:`make_pendulum_transitions` — transitions of the under-actuated pendulum of
  paper 002's experiment (Deisenroth et al. 2009);
* :func:`load_flowcap_gvhd` — the FlowCAP-I GvHD samples with per-cell gates, read from
  a directory of the shared test data (never bundled: tests and benchmarks only).
"""

from __future__ import annotations

from .cytometry import emulate_batches, make_batched_cytometry_tasks, make_cytometry_tasks
from .real import CENSUS_DIVISIONS, GVHD_CHANNELS, load_flowcap_gvhd, load_state_productivity
from .synthetic import (
    GaussianMixtures,
    load_digits_clouds,
    make_dose_response_bags,
    make_ellipse_tasks,
    make_entropy_bags,
    make_gmm_modes,
    make_pendulum_transitions,
)

__all__ = [
    "CENSUS_DIVISIONS",
    "GVHD_CHANNELS",
    "GaussianMixtures",
    "emulate_batches",
    "load_digits_clouds",
    "load_flowcap_gvhd",
    "load_state_productivity",
    "make_batched_cytometry_tasks",
    "make_cytometry_tasks",
    "make_dose_response_bags",
    "make_ellipse_tasks",
    "make_entropy_bags",
    "make_gmm_modes",
    "make_pendulum_transitions",
]
