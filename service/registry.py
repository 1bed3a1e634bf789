"""The models a service instance serves: ``MODELS_DIR/<name>/<version>/`` artifacts.

Every artifact is verified (format and sha256 of every file) at start-up; a broken one
is recorded with its reason and skipped, the others still serve. Models are never
uploaded over HTTP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagserve.core.artifacts import ArtifactError, read_manifest
from bagserve.core.io import Panel, Preprocessing

__all__ = ["ModelEntry", "Registry", "kind_of"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _version_key(version: str) -> tuple[Any, ...]:
    """Numeric-aware ordering: "10" after "9", "1.10" after "1.9"."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[._-]", version))


def kind_of(estimator: str) -> str:
    """What a model answers, from its estimator class name.

    ``"cell"`` (a label per cell), ``"classification"``, ``"conditional"`` (a conditional
    distribution: mean, quantiles, exceedance) or ``"regression"``.
    """
    if estimator.startswith("MarginalTransfer"):
        return "cell"
    if estimator == "ConditionalMeanEmbedding":
        return "conditional"
    return "classification" if estimator.endswith("Classifier") else "regression"


@dataclass(frozen=True)
class ModelEntry:
    """One loadable model version (its manifest already verified)."""

    name: str
    version: str
    path: Path
    manifest: dict[str, Any] = field(repr=False)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.version}"

    @property
    def sha256(self) -> str:
        return str(self.manifest["manifest_sha256"])

    @property
    def estimator(self) -> str:
        return str(self.manifest["estimator"]["class"])

    @property
    def panel(self) -> Panel | None:
        spec = self.manifest["metadata"].get("panel")
        return Panel.from_json(spec) if spec else None

    @property
    def preprocessing(self) -> Preprocessing:
        spec = self.manifest["metadata"].get("preprocessing")
        return Preprocessing.from_json(spec) if spec else Preprocessing()

    @property
    def n_features(self) -> int:
        state = self.manifest["model"]["state"]
        return int(state["n_features_in_"])

    @property
    def kind(self) -> str:
        """See :func:`kind_of`."""
        return kind_of(self.estimator)

    @property
    def n_outputs(self) -> int:
        return int(self.manifest["model"]["state"].get("n_outputs_", 1))

    def describe(self) -> dict[str, Any]:
        meta = self.manifest["metadata"]
        panel = self.panel
        return {
            "name": self.name,
            "version": self.version,
            "estimator": self.estimator,
            "kind": self.kind,
            "panel": None if panel is None else panel.to_json(),
            "n_markers": self.n_features,
            "preprocessing": meta.get("preprocessing"),
            "metrics": meta.get("metrics"),
            "description": meta.get("description"),
            "created": self.manifest.get("created"),
            "training_data_sha256": meta.get("training_data_sha256"),
            "sha256": self.sha256,
        }


class Registry:
    """Scan a models directory once; keep the valid artifacts and the reasons for the rest."""

    def __init__(self, models_dir: str | Path):
        self.models_dir = Path(models_dir)
        self.entries: dict[str, dict[str, ModelEntry]] = {}
        self.failures: dict[str, str] = {}
        self._scan()

    def _scan(self) -> None:
        if not self.models_dir.is_dir():
            self.failures[str(self.models_dir)] = "models directory does not exist"
            return
        for mdir in sorted(p for p in self.models_dir.iterdir() if p.is_dir()):
            if not _NAME.match(mdir.name):
                continue
            for vdir in sorted(p for p in mdir.iterdir() if p.is_dir()):
                if not _NAME.match(vdir.name):
                    continue
                key = f"{mdir.name}/{vdir.name}"
                try:
                    manifest = read_manifest(vdir)
                    if manifest["estimator"].get("format") != "arrays":
                        raise ArtifactError("pickle artifacts are not served")
                    if (
                        kind_of(manifest["estimator"]["class"]) == "conditional"
                        and manifest["model"]["params"].get("representation") is None
                    ):
                        raise ArtifactError(
                            "a ConditionalMeanEmbedding on points (no representation) cannot "
                            "be served: the service predicts on bags"
                        )
                except ArtifactError as exc:
                    self.failures[key] = str(exc)
                    continue
                self.entries.setdefault(mdir.name, {})[vdir.name] = ModelEntry(
                    mdir.name, vdir.name, vdir, manifest
                )

    def all(self) -> list[ModelEntry]:
        return [e for versions in self.entries.values() for e in versions.values()]

    def versions(self, name: str) -> list[ModelEntry]:
        return sorted(self.entries.get(name, {}).values(), key=lambda e: _version_key(e.version))

    def get(self, name: str, version: str | None = None) -> ModelEntry | None:
        """A model version, or the latest one (``None`` or ``"latest"``)."""
        versions = self.versions(name)
        if not versions:
            return None
        if version in (None, "latest"):
            return versions[-1]
        return self.entries[name].get(version)
