"""Streaming and Dask training (core.streaming) against in-memory training.

The oracle is the in-memory path (`core.training.train` reading every cell): for the
same configuration and seed, training that streams bags from their files, on local
threads or on a Dask ``LocalCluster`` of worker processes on 127.0.0.1, must give the
same cross-validated predictions, the same chosen parameters and the same model.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from bagserve.core import load
from bagserve.core.bags import Bags
from bagserve.core.io import Preprocessing
from bagserve.core.representations import MeanEmbedding, SlicedWasserstein
from bagserve.core.training import ConfigError, TrainingResult, train

from bagserve.cli import main

MARKERS = ["CD3", "CD4", "CD8"]


def _write_data(root: Path, n_bags: int = 24, seed: int = 0) -> None:
    """CSV samples (one gzip) whose label is the mixing weight of a shifted population."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    rows = ["file,label,group"]
    for t in range(n_bags):
        w = rng.uniform(0.1, 0.9)
        n = int(rng.integers(300, 700))
        shifted = rng.random(n) < w
        x = rng.normal(size=(n, 3)) * [200.0, 50.0, 80.0] + [500.0, 100.0, 300.0]
        x[shifted] += [800.0, 0.0, 400.0]
        name = f"s{t:02d}.csv.gz" if t == 3 else f"s{t:02d}.csv"
        header = ",".join(MARKERS[::-1])  # columns in another order than the panel
        body = "\n".join(",".join(f"{v:.6f}" for v in r[::-1]) for r in x)
        text = f"{header}\n{body}\n"
        if name.endswith(".gz"):
            import gzip

            (root / name).write_bytes(gzip.compress(text.encode()))
        else:
            (root / name).write_text(text)
        rows.append(f"{name},{w:.6f},{'high' if w > 0.5 else 'low'}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")


def _config(root: Path, estimator: str, extra: str = "", label: str = "label") -> Path:
    text = textwrap.dedent(
        f"""
        [model]
        name = "m"
        version = "1"
        [data]
        files = "data/*.csv*"
        labels = "data/labels.csv"
        file_column = "file"
        label_column = "{label}"
        n_jobs = 2
        [panel]
        markers = {json.dumps(MARKERS)}
        [preprocessing]
        transform = "arcsinh"
        cofactor = 150.0
        scale = "standard"
        max_points = 500
        seed = 3
        {estimator}
        [cv]
        n_splits = 4
        seed = 1
        {extra}
        """
    )
    path = root / "train.toml"
    path.write_text(text)
    return path


SW_RIDGE = """
[estimator]
class = "DistributionRidge"
random_state = 7
[estimator.representation]
class = "SlicedWasserstein"
n_directions = 12
n_levels = 16
[search]
"representation__p" = [1, 2]
"kernel" = ["gaussian", "linear"]
"""


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("streaming")
    _write_data(root / "data")
    return root


def _query() -> list[np.ndarray]:
    rng = np.random.default_rng(99)
    return [np.abs(rng.normal(size=(400, 3))) * 500.0 for _ in range(5)]


def _assert_same_training(a: TrainingResult, b: TrainingResult) -> None:
    """Same CV metrics, search, chosen parameters, scaling and predictions, bit for bit."""
    assert a.metrics["cv"] == b.metrics["cv"]
    assert a.metrics["search"] == b.metrics["search"]
    assert a.metrics["best_params"] == b.metrics["best_params"]
    assert a.metrics["n_cells"] == b.metrics["n_cells"]
    ma, mb = load(a.path), load(b.path)
    qa = [np.asarray(q) for q in _query()]
    np.testing.assert_array_equal(ma.predict(qa), mb.predict(qa))
    man_a = json.loads((a.path / "manifest.json").read_text())["metadata"]
    man_b = json.loads((b.path / "manifest.json").read_text())["metadata"]
    for key in ("preprocessing", "training_data_sha256", "training_files", "panel"):
        assert man_a[key] == man_b[key], key
    # Where the model looks: the same table, streamed bag by bag (sums in another order).
    ra, rb = a.metrics["explained_regions"], b.metrics["explained_regions"]
    assert ra is not None and rb is not None
    table_a, table_b = ra.pop("mean_contribution"), rb.pop("mean_contribution")
    assert ra == rb and ra["n_samples"] == len(man_a["training_files"])
    np.testing.assert_allclose(table_b, table_a, rtol=1e-9, atol=1e-12)
    assert np.abs(table_a).max() > 0


def test_preprocessing_moments_match_pooled_statistics() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(int(rng.integers(5, 400)), 4)) * 1e3 + 1e4 for _ in range(30)]
    bags = Bags.from_arrays(arrays)
    pre = Preprocessing(scale="standard").fit(bags, list("abcd"))
    pooled = np.concatenate(arrays)
    np.testing.assert_allclose(pre.mean_, pooled.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(pre.std_, pooled.std(axis=0), rtol=1e-11)


def test_data_free_fit_equals_fit_on_data() -> None:
    bags = Bags.from_arrays([np.random.default_rng(1).normal(size=(50, 4)) for _ in range(3)])
    for rep in (
        SlicedWasserstein(n_directions=9, n_levels=5, random_state=4),
        MeanEmbedding(method="rff", n_components=30, bandwidth=1.5, random_state=4),
    ):
        a = rep.fit(bags).transform(bags)
        b = type(rep)(**rep.get_params()).fit_to_dimension(4).transform(bags)
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="median heuristic"):
        MeanEmbedding(method="rff", n_components=30).fit_to_dimension(4)


def test_streaming_on_threads_equals_in_memory(data_root: Path, tmp_path: Path) -> None:
    cfg = _config(data_root, SW_RIDGE)
    memory = train(cfg, output=tmp_path / "memory")
    streamed = train(cfg, output=tmp_path / "streamed", streaming=True)
    assert memory.metrics["compute"] == {"mode": "in-memory"}
    assert streamed.metrics["compute"]["executor"] == "threads"
    assert len(memory.metrics["search"]) == 4
    _assert_same_training(memory, streamed)


def test_streaming_classifier_and_rff_mean_embedding(data_root: Path, tmp_path: Path) -> None:
    estimator = """
    [estimator]
    class = "DistributionRidgeClassifier"
    random_state = 2
    n_components = 64
    [estimator.representation]
    class = "MeanEmbedding"
    method = "rff"
    n_components = 40
    bandwidth = 1.0
    [search]
    "representation__bandwidth" = [0.5, 1.0]
    """
    cfg = _config(data_root, textwrap.dedent(estimator), label="group")
    memory = train(cfg, output=tmp_path / "memory")
    streamed = train(cfg, output=tmp_path / "streamed", streaming=True)
    _assert_same_training(memory, streamed)


def test_streaming_refuses_what_needs_all_cells(data_root: Path, tmp_path: Path) -> None:
    needs_data = """
    [estimator]
    class = "DistributionRidge"
    [estimator.representation]
    class = "MeanEmbedding"
    method = "exact"
    """
    cfg = _config(data_root, textwrap.dedent(needs_data))
    with pytest.raises(ConfigError, match="method='exact' keeps every training cell"):
        train(cfg, output=tmp_path, streaming=True)
    cfg = _config(data_root, SW_RIDGE, extra="[compute]\nstreaming = 'yes'\n")
    with pytest.raises(ConfigError, match=r"\[compute\] streaming must be true or false"):
        train(cfg, output=tmp_path)


def test_dask_local_cluster_equals_in_memory(data_root: Path, tmp_path: Path) -> None:
    distributed = pytest.importorskip("dask.distributed")
    cfg = _config(data_root, SW_RIDGE)
    memory = train(cfg, output=tmp_path / "memory")
    with distributed.LocalCluster(
        n_workers=3,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        worker_dashboard_address=None,
    ) as cluster:
        # Through the command line, as a lab would run it.
        args = ["train", str(cfg), "--quiet", "--output", str(tmp_path / "dask")]
        assert main([*args, "--scheduler", cluster.scheduler_address]) == 0
    path = tmp_path / "dask" / "m" / "1"
    metrics = json.loads((path / "report" / "metrics.json").read_text())
    assert metrics["compute"] == {"mode": "streaming", "executor": "dask", "workers": 3}
    _assert_same_training(memory, TrainingResult(path, metrics))


def test_unreachable_scheduler_is_named() -> None:
    pytest.importorskip("dask.distributed")
    from bagserve.core.streaming import DaskExecutor

    with pytest.raises(ConnectionError, match=r"cannot reach the Dask scheduler at 'tcp://127"):
        DaskExecutor("tcp://127.0.0.1:9", timeout=2)


def test_cli_train_streaming(data_root: Path, tmp_path: Path, capsys) -> None:
    cfg = _config(data_root, SW_RIDGE)
    assert main(["train", str(cfg), "--streaming", "--quiet", "--output", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert Path(out["model"]) == tmp_path / "m" / "1"
    metrics = json.loads((tmp_path / "m" / "1" / "report" / "metrics.json").read_text())
    assert metrics["compute"]["mode"] == "streaming"
    bad = _config(data_root, SW_RIDGE, extra="[compute]\nworkers = 4\n")
    assert main(["train", str(bad), "--quiet", "--output", str(tmp_path / "x")]) == 1
    assert "[compute] unknown key(s) ['workers']" in capsys.readouterr().err


def _write_large_fcs_set(root: Path, n_bags: int, n_cells: int, n_markers: int) -> int:
    """``n_bags`` FCS files of float32 cells; returns their size in memory as float64.

    flowio writes one template file; the others reuse its header with new DATA bytes,
    which keeps writing hundreds of megabytes fast.
    """
    import io

    import flowio

    names = [f"M{j}" for j in range(n_markers)]
    buf = io.BytesIO()
    flowio.create_fcs(buf, np.zeros(n_cells * n_markers, dtype=np.float32), names)
    template = buf.getvalue()
    begin, end = int(template[26:34]), int(template[34:42])
    assert end - begin + 1 == n_cells * n_markers * 4
    rng = np.random.default_rng(5)
    rows = ["file,label"]
    for t in range(n_bags):
        shift = rng.uniform(0.0, 2.0)
        x = rng.standard_normal((n_cells, n_markers), dtype=np.float32)
        x[: n_cells // 2, 0] += np.float32(shift)
        data = x.astype("<f4").tobytes()
        (root / f"p{t:03d}.fcs").write_bytes(template[:begin] + data + template[end + 1 :])
        rows.append(f"p{t:03d}.fcs,{shift:.6f}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return n_bags * n_cells * n_markers * 8


LARGE_CONFIG = """
[model]
name = "large"
[data]
files = "data/*.fcs"
labels = "data/labels.csv"
n_jobs = 2
[preprocessing]
scale = "standard"
[estimator]
class = "DistributionRidge"
random_state = 0
[estimator.representation]
class = "SlicedWasserstein"
n_directions = 10
n_levels = 10
[cv]
n_splits = 3
"""

# The child caps its writable memory (RLIMIT_DATA), trains, and reports its peak RSS.
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so a child started with
# vfork would report the (large) test process's own peak.
_CAPPED_TRAIN = """
import json, resource, sys
cap = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
from bagserve.cli import main
code = main(sys.argv[2:])
with open("/proc/self/status") as fh:
    peak = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
print(json.dumps({"code": code, "peak": peak}))
sys.exit(code)
"""


@pytest.mark.slow
def test_streaming_trains_a_data_set_larger_than_its_memory(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "data").mkdir()
    in_memory_bytes = _write_large_fcs_set(tmp_path / "data", 100, 100_000, 10)
    (tmp_path / "train.toml").write_text(LARGE_CONFIG)
    cap = 500 * 2**20
    assert in_memory_bytes > 1.5 * cap  # 800 MB of cells as float64, against 500 MiB

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        args = ["train", str(tmp_path / "train.toml"), "--quiet", *flags]
        return subprocess.run(
            [sys.executable, "-c", _CAPPED_TRAIN, str(cap), *args],
            capture_output=True,
            text=True,
            timeout=600,
            env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PATH": ""},
        )

    streamed = run("--streaming", "--output", str(tmp_path / "models"))
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    report = json.loads(streamed.stdout.strip().splitlines()[-1])
    assert report["code"] == 0
    # The stated bound (bench/README.md): the interpreter and libraries (~170 MiB) plus a
    # few bags per thread; far below the 800 MB the cells take in memory.
    assert report["peak"] < 400 * 2**20, report["peak"] / 2**20
    metrics = json.loads((tmp_path / "models/large/1/report/metrics.json").read_text())
    assert metrics["n_cells"] == 100 * 100_000
    assert metrics["cv"]["r2"] > 0.9  # the shift is easy to read off the first marker

    # The same data set does not fit in this memory when read whole.
    whole = run("--output", str(tmp_path / "whole"))
    assert whole.returncode != 0
    assert "out of memory" in whole.stderr
    assert not (tmp_path / "whole" / "large").exists()
