"""The bundled demo models, trained in seconds on generated data (no third-party data).

* ``demo-dose/1``: :class:`~core.DistributionRidge` with a sliced-Wasserstein kernel,
  predicting an inducer dose from a sample's reporter distribution
  (:func:`~core.datasets.make_dose_response_bags`).
* ``demo-gating/1``: :class:`~core.MarginalTransferClassifier` labelling every cell of
  a new sample with its population despite batch effects
  (:func:`~core.datasets.make_cytometry_tasks`).

Both carry a panel, a preprocessing description, a fingerprint of the generated
training data, and hold-out metrics, like models trained from a configuration.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .artifacts import save
from .bags import Bags
from .calibration import fit_temperature
from .datasets import make_cytometry_tasks, make_dose_response_bags
from .estimators import DistributionRidge, MarginalTransferClassifier
from .hashing import chunks_sha256
from .io import Panel, Preprocessing
from .representations import SlicedWasserstein

__all__ = ["DEMO_MODELS", "GATING_MARKERS", "POPULATIONS", "build_demo_models", "demo_samples"]

DEMO_MODELS = ("demo-dose", "demo-gating")
GATING_MARKERS = ["CD3", "CD4", "CD8", "CD19", "CD45", "CD56"]
POPULATIONS = np.array(["T helper", "T cytotoxic", "B", "NK"])


def _fingerprint(bags: Bags, y: np.ndarray) -> str:
    """sha256 of the generated training data (cells, bag boundaries, labels)."""
    return chunks_sha256(
        [
            np.ascontiguousarray(bags.points).tobytes(),
            np.ascontiguousarray(bags.offsets).tobytes(),
            np.asarray(y).astype(str).astype("S").tobytes(),
        ]
    )


def demo_samples(kind: str, n: int, seed: int) -> tuple[Bags, np.ndarray, list[str]]:
    """New samples of the demo data (for trying the models or the service)."""
    if kind == "dose":
        return make_dose_response_bags(n, 2000, random_state=[7, seed])
    bags, y = make_cytometry_tasks(n, 3000, n_markers=6, random_state=[11, seed])
    return bags, POPULATIONS[y], GATING_MARKERS


def build_demo_models(models_dir: str | Path, *, overwrite: bool = False) -> list[Path]:
    """Train the demo models into ``models_dir/<name>/1`` (skipped if present)."""
    models_dir = Path(models_dir)
    written = []
    dose_path = models_dir / "demo-dose" / "1"
    if overwrite or not dose_path.exists():
        bags, dose, markers = make_dose_response_bags(80, 2000, random_state=[7, 0])
        test, dose_test, _ = demo_samples("dose", 20, 1)
        # Seeded as a whole (its calibration folds too): two builds answer the same.
        model = DistributionRidge(
            SlicedWasserstein(n_directions=50, n_levels=50, random_state=0), random_state=0
        )
        model.fit(bags, dose)
        rmse = float(np.sqrt(np.mean((model.predict(test) - dose_test) ** 2)))
        written.append(
            save(
                model,
                dose_path,
                overwrite=overwrite,
                name="demo-dose",
                version="1",
                description="Inducer dose (log10 units) from a sample's reporter distribution.",
                panel=Panel(tuple(markers)).to_json(),
                preprocessing=Preprocessing().to_json(),
                training_data_sha256=_fingerprint(bags, dose),
                metrics={
                    "holdout_rmse": rmse,
                    "holdout_bags": 20,
                    "dose_std": float(np.std(dose_test)),
                },
            )
        )
    gating_path = models_dir / "demo-gating" / "1"
    if overwrite or not gating_path.exists():
        tasks, y, markers = demo_samples("gating", 10, 0)
        test, y_test, _ = demo_samples("gating", 3, 1)
        model = MarginalTransferClassifier(random_state=0).fit(tasks, y)
        scores = model.decision_function(test)
        accuracy = float(np.mean(model.decode_scores(scores) == y_test))
        # The held-out samples calibrate the class probabilities (never the training
        # cells, whose scores are over-confident).
        calibration = fit_temperature(scores, y_test, model.classes_)
        calibration["method"] += " on the 3 held-out demo samples"
        written.append(
            save(
                model,
                gating_path,
                overwrite=overwrite,
                name="demo-gating",
                version="1",
                description="Population of every cell of a new sample (marginal transfer).",
                panel=Panel(tuple(markers)).to_json(),
                preprocessing=Preprocessing().to_json(),
                training_data_sha256=_fingerprint(tasks, y),
                metrics={"holdout_cell_accuracy": accuracy, "holdout_samples": 3},
                probability_calibration=calibration,
            )
        )
    return written
