"""An existing model version is refused before training, not after it.

``bagserve train`` (and :func:`bagserve.core.training.train`) on a version that exists
used to train fully and only then refuse to save, naming ``overwrite=True`` where the
command's flag is ``--overwrite``. The spies below fail the test if either training
path (in memory, streamed) is entered; the stored artifact is compared byte for byte.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from bagserve.core.artifacts import ArtifactError
from bagserve.core.training import fit, train

from bagserve.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::bagserve.core.training.GridEdgeWarning")


def _config(root: Path) -> Path:
    """Ten small CSV bags whose label is their mean, and a configuration for them."""
    rng = np.random.default_rng(0)
    data = root / "data"
    data.mkdir(parents=True)
    rows = ["file,label"]
    for t in range(10):
        x = rng.normal(loc=0.2 * t, size=(40, 2))
        body = "\n".join(f"{a!r},{b!r}" for a, b in x.tolist())
        (data / f"b{t:02d}.csv").write_text(f"A,B\n{body}\n")
        rows.append(f"b{t:02d}.csv,{0.2 * t!r}")
    (data / "labels.csv").write_text("\n".join(rows) + "\n")
    path = root / "small.toml"
    path.write_text(
        textwrap.dedent(
            """
            [model]
            name = "small"
            version = "1"
            output = "models"
            [data]
            files = "data/*.csv"
            labels = "data/labels.csv"
            [panel]
            markers = ["A", "B"]
            [estimator]
            class = "DistributionRidge"
            random_state = 0
            [estimator.representation]
            class = "MeanEmbedding"
            [cv]
            n_splits = 3
            """
        )
    )
    return path


def _contents(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of a directory: its bytes and modification time."""
    return {
        str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, Path]:
    """A configuration and the model version it trained."""
    config = _config(tmp_path)
    return config, train(config).path


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Spies on both training paths: any call is recorded and fails the training."""
    calls: list[str] = []

    def spy(name: str):
        def entered(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} trained a version that exists")

        return entered

    for name in ("train_in_memory", "train_streaming"):
        monkeypatch.setattr(fit, name, spy(name))
    return calls


@pytest.mark.parametrize("streaming", [False, True])
def test_train_refuses_an_existing_version_before_training(trained, no_training, streaming):
    config, path = trained
    before = _contents(path)
    with pytest.raises(ArtifactError, match="already exists") as info:
        train(config, streaming=streaming)
    assert "overwrite=True" in str(info.value) and "--overwrite" in str(info.value)
    assert no_training == []
    assert _contents(path) == before


def test_bagserve_train_refuses_an_existing_version_naming_its_flag(trained, no_training, capsys):
    config, path = trained
    before = _contents(path)
    code = main(["train", str(config), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith("error: ") and "already exists" in err and "--overwrite" in err
    assert str(path) in err
    assert no_training == []
    assert _contents(path) == before


def test_overwrite_still_trains_and_replaces_the_version(trained, capsys):
    config, path = trained
    stray = path / "stray.txt"  # not part of the artifact: gone once it is replaced
    stray.write_text("left here")
    assert main(["train", str(config), "--quiet", "--overwrite"]) == 0
    capsys.readouterr()
    assert (path / "manifest.json").is_file() and not stray.exists()
