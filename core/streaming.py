"""Training that streams bags from their files, on local threads or a Dask cluster.

In-memory training (:func:`core.training.train`) reads every cell first. Here no
process ever holds more than the few bags it is working on: each task reads one
file where it runs, reduces it, and returns a summary that is a few kilobytes.

1. **Moments.** One task per file returns the bag's cell count, the sha256 of the
   file, and the moments of its transformed cells. The client combines them into the
   standard scaling of every cross-validation fold and of the final model
   (:meth:`core.io.Preprocessing.fit_moments`).
2. **Features.** One task per file reads it once more and returns the bag's explicit
   features for every fold's scaling and every representation in the search, as a
   ``(n_fits, n_features)`` block per representation.
3. **Search.** The client holds only the ``(bags × features)`` matrices. One task per
   candidate and fold fits a ridge model on them
   (:meth:`core.DistributionRidge.fit_embedded`) and returns its out-of-fold
   predictions; each worker receives the matrices once. The client fits the final model.
4. **Regions.** One task per file reads it a third time and explains the bag with the
   model of each fold that holds it out (the final parameters on the fold's features),
   returning its cell counts and summed contributions on a grid of each marker
   (:mod:`core.training.regions`, ``d × 1024`` numbers per output): the report's
   "where the model looks" without any cell leaving its task.

Every step computes a bag's numbers exactly as the in-memory path does (moments bag by
bag, features bag by bag), so for the same seed both give the same model, bit for bit.
The representation must be fitted before any cell is seen, which holds for those whose
fit draws only random quantities (:meth:`~core.representations.base.BagRepresentation
.data_dependence`): sliced Wasserstein, and random Fourier mean embeddings with a fixed
bandwidth.

Grid edges are checked and widened as in memory (see "Grid edges" in
:mod:`core.training`): a widened ``[search]`` value or a widened grid of the ridge's own
``gamma``/``alpha`` is one more candidate of step 3, on the same features; a widened
value that changes the representation (e.g. its number of directions) needs its
features, so step 2 runs once more, for the new representations only.

The executor is a local thread pool (:class:`LocalExecutor`; memory bounded by the
number of threads times the largest bag) or a ``dask.distributed`` cluster
(:class:`DaskExecutor`), whose workers must see the data files at the same paths and
have bagserve installed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import joblib
import numpy as np
from numpy.typing import NDArray
from sklearn.base import BaseEstimator

from .bags import Bags
from .estimators._ridge_calibration import for_point_predictions
from .hashing import points_sha256
from .io import BagMoments, Panel, Preprocessing, read_file
from .representations.base import BagRepresentation, FeatureEmbedding

__all__ = [
    "BagSummary",
    "DaskExecutor",
    "Executor",
    "FoldTask",
    "LocalExecutor",
    "StreamedFeatures",
    "bag_features",
    "bag_regions",
    "bag_summary",
    "cross_validate",
    "fitted_representations",
    "fold_predictions",
    "points_sha256",
    "scalings",
    "stream_features",
    "stream_regions",
    "stream_summaries",
]


@dataclass(frozen=True)
class BagSummary:
    """What the client keeps of one bag after the first pass.

    Attributes
    ----------
    n_cells : int
    sha256 : str
        Of the file's bytes.
    moments : BagMoments or None
        For the standard scaling (``None`` without it).
    points_sha256 : str or None
        Of the bag's cells in panel order as C-ordered float64 bytes: with ``sha256``,
        the fingerprint the manifest records of each training bag, so that evaluation
        recognises the bag in another file (:func:`core.training.bag_fingerprints`).
    low, high : ndarray of shape (d,) or None
        The smallest and largest transformed value of each marker (the grid of the
        report's regions, :mod:`core.training.regions`).
    """

    n_cells: int
    sha256: str
    moments: BagMoments | None
    points_sha256: str | None = None
    low: NDArray[np.float64] | None = None
    high: NDArray[np.float64] | None = None


def _read_bag(
    path: str, panel: Panel, preprocessing: Preprocessing
) -> tuple[NDArray[np.float64], str]:
    """One file's cells, compensated, in panel order, and the sha256 of its bytes."""
    sample, digest = read_file(path)
    return panel.select(preprocessing.compensate(sample)), digest


def bag_summary(path: str, panel: Panel, preprocessing: Preprocessing) -> BagSummary:
    """First pass over one file: cell count, sha256 and moments for the scaling."""
    points, digest = _read_bag(path, panel, preprocessing)
    t = preprocessing.transform_points(points, panel.markers)
    moments = preprocessing.transformed_moments(t) if preprocessing.scale == "standard" else None
    return BagSummary(
        int(points.shape[0]),
        digest,
        moments,
        points_sha256(points),
        t.min(axis=0) if t.shape[0] else None,
        t.max(axis=0) if t.shape[0] else None,
    )


def bag_features(
    path: str,
    panel: Panel,
    preprocessings: Sequence[Preprocessing],
    representations: Sequence[BagRepresentation],
) -> list[tuple[NDArray[np.float64], str]]:
    """Second pass over one file: its features under every scaling and representation.

    Returns, per representation, the ``(len(preprocessings), n_features)`` block and
    the geometry of the features (``"euclidean"`` or ``"l1"``).
    """
    points, _ = _read_bag(path, panel, preprocessings[0])
    markers = list(panel.markers)
    # Subsampling and the transform do not depend on the fold: done once, and the raw
    # cells are dropped before the per-fold copies are made.
    bag = preprocessings[0].subsample(Bags(points, np.array([0, points.shape[0]]), validate=False))
    transformed = preprocessings[0].transform_points(bag.points, markers)
    bag = Bags(transformed, bag.offsets, bag.weights, validate=False)
    del points
    blocks: list[NDArray[np.float64]] = []
    geometries: list[str] = []
    for f, pre in enumerate(preprocessings):
        scaled = Bags(pre.scale_points(transformed), bag.offsets, bag.weights, validate=False)
        for r, rep in enumerate(representations):
            emb = rep.embed(scaled)
            assert isinstance(emb, FeatureEmbedding)
            if f == 0:
                blocks.append(np.empty((len(preprocessings), emb.features.shape[1])))
                geometries.append(emb.geometry)
            blocks[r][f] = emb.features[0]
    return list(zip(blocks, geometries, strict=True))


def bag_regions(
    item: tuple[str, list[int]],
    panel: Panel,
    preprocessings: Sequence[Preprocessing],
    models: Mapping[int, BaseEstimator],
    grid: Any,
) -> Any:
    """Third pass over one file (``item``: its path and the folds that hold it out):
    the explanations of those folds' models, summed on the report's grid
    (:func:`core.training.regions.explanation_sums`): ``d × 1024 × (outputs + 1)``
    numbers per bag."""
    from .training.regions import explanation_sums

    path, folds_of_sample = item
    points, _ = _read_bag(path, panel, preprocessings[0])
    markers = list(panel.markers)
    bag = preprocessings[0].subsample(Bags(points, np.array([0, points.shape[0]]), validate=False))
    x = preprocessings[0].transform_points(bag.points, markers)
    return explanation_sums(models, folds_of_sample, preprocessings, grid, x, markers, bag.weights)


# ------------------------------------------------------------------- executors
class Executor(ABC):
    """Runs ``fn(item, **kwargs)`` for every item (a file, a fold) and yields
    ``(index, result)`` as tasks finish; ``kwargs`` are shared by all tasks."""

    @abstractmethod
    def map(
        self, fn: Callable[..., Any], items: Sequence[Any], **kwargs: Any
    ) -> Iterator[tuple[int, Any]]: ...

    def close(self) -> None:  # noqa: B027 - most executors hold nothing
        """Release what the executor holds (a cluster connection)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalExecutor(Executor):
    """A pool of ``n_jobs`` threads: at most ``n_jobs`` bags are in memory at once.

    Threads suffice because reading, sorting and matrix products release the GIL.
    """

    def __init__(self, n_jobs: int = 1):
        if int(n_jobs) < 1:
            raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")
        self.n_jobs = int(n_jobs)

    def map(
        self, fn: Callable[..., Any], items: Sequence[Any], **kwargs: Any
    ) -> Iterator[tuple[int, Any]]:
        if self.n_jobs == 1:
            for i, item in enumerate(items):
                yield i, fn(item, **kwargs)
            return
        with ThreadPoolExecutor(self.n_jobs) as pool:
            futures = {pool.submit(fn, item, **kwargs): i for i, item in enumerate(items)}
            try:
                for fut in as_completed(futures):
                    yield futures[fut], fut.result()
            finally:
                for fut in futures:
                    fut.cancel()


class DaskExecutor(Executor):
    """Tasks on a ``dask.distributed`` cluster, one per file, run where a worker is free.

    Parameters
    ----------
    address : str
        The scheduler, e.g. ``"tcp://10.0.0.5:8786"``, or a ``dask.distributed.Client``.
    timeout : float
        Seconds to wait for the scheduler.
    """

    def __init__(self, address: Any, timeout: float = 30.0):
        try:
            from dask.distributed import Client
        except ImportError as exc:
            raise ImportError(
                "training on a Dask cluster needs dask.distributed: pip install 'bagserve[dask]'"
            ) from exc
        if isinstance(address, Client):
            self.client, self._owned = address, False
        else:
            try:
                self.client = Client(address, timeout=timeout, set_as_default=False)
            except (OSError, TimeoutError) as exc:
                raise ConnectionError(
                    f"cannot reach the Dask scheduler at {address!r}: {exc}"
                ) from exc
            self._owned = True

    def map(
        self, fn: Callable[..., Any], items: Sequence[Any], **kwargs: Any
    ) -> Iterator[tuple[int, Any]]:
        from dask.distributed import as_completed as dask_completed

        # The shared arguments (panel, scalings, representations; the feature matrices
        # of the search) travel once to each worker, as one object: scattering a list
        # would make a future of each element.
        shared = self.client.scatter(_Arguments(kwargs), broadcast=True, hash=False)
        futures = self.client.map(_call, list(items), fn=fn, arguments=shared, pure=False)
        index = {f.key: i for i, f in enumerate(futures)}
        try:
            for fut in dask_completed(futures, loop=self.client.loop):
                yield index[fut.key], fut.result()
                fut.release()
        finally:
            self.client.cancel(futures)

    def close(self) -> None:
        if self._owned:
            self.client.close()


@dataclass(frozen=True)
class _Arguments:
    kwargs: dict[str, Any]


def _call(item: Any, fn: Callable[..., Any], arguments: _Arguments) -> Any:
    return fn(item, **arguments.kwargs)


# ------------------------------------------------------------------- the passes
def stream_summaries(
    executor: Executor,
    paths: Sequence[str],
    panel: Panel,
    preprocessing: Preprocessing,
    progress: bool = False,
) -> list[BagSummary]:
    """First pass: one :class:`BagSummary` per file, in file order."""
    out: list[BagSummary | None] = [None] * len(paths)
    for i, summary in _progress(
        executor.map(bag_summary, paths, panel=panel, preprocessing=preprocessing),
        len(paths),
        "moments",
        progress,
    ):
        out[i] = summary
    return out  # type: ignore[return-value]


@dataclass
class StreamedFeatures:
    """Features of every bag: ``blocks[r][f]`` is the ``(bags × features)`` matrix of
    representation ``r`` under scaling ``f``."""

    blocks: list[NDArray[np.float64]]
    geometries: list[str]

    def embedding(self, r: int, f: int, rows: NDArray[np.int64] | None = None) -> FeatureEmbedding:
        F = self.blocks[r][f]
        return FeatureEmbedding(F if rows is None else F[rows], self.geometries[r])


def stream_features(
    executor: Executor,
    paths: Sequence[str],
    panel: Panel,
    preprocessings: Sequence[Preprocessing],
    representations: Sequence[BagRepresentation],
    progress: bool = False,
) -> StreamedFeatures:
    """Second pass: the features of every bag, reduced into ``(bags × features)`` matrices.

    Memory on the client: ``len(preprocessings) · n_bags · Σ_r n_features_r`` floats.
    """
    blocks: list[NDArray[np.float64]] = []
    geometries: list[str] = []
    n_fits = len(preprocessings)
    for i, result in _progress(
        executor.map(
            bag_features,
            paths,
            panel=panel,
            preprocessings=list(preprocessings),
            representations=list(representations),
        ),
        len(paths),
        "features",
        progress,
    ):
        if not blocks:
            for block, geometry in result:
                blocks.append(np.empty((n_fits, len(paths), block.shape[1])))
                geometries.append(geometry)
        for r, (block, _) in enumerate(result):
            blocks[r][:, i] = block
    return StreamedFeatures(blocks, geometries)


def stream_regions(
    executor: Executor,
    paths: Sequence[str],
    panel: Panel,
    preprocessings: Sequence[Preprocessing],
    models: Mapping[int, BaseEstimator],
    folds: Sequence[tuple[NDArray[np.int64], NDArray[np.int64]]],
    summaries: Sequence[BagSummary],
    progress: bool = False,
) -> dict[str, Any] | None:
    """Third pass: where the model looks (:func:`core.training.regions.held_out_regions`),
    each bag explained by the model of the folds that hold it out (``models[f]``, fitted
    with ``preprocessings[f]``) where it is read; the client keeps per fold one count
    and one sum per marker and grid bin. None when the model has no explanation."""
    from .training.regions import MarkerGrid, RegionSums

    d = len(panel.markers)
    lows = [s.low for s in summaries if s.low is not None]
    highs = [s.high for s in summaries if s.high is not None]
    if not lows:
        return None
    grid = MarkerGrid(np.min(lows, axis=0), np.max(highs, axis=0))
    sums = RegionSums(folds, d)
    items = [(p, sums.held_out_in(t)) for t, p in enumerate(paths)]
    for t, got in _progress(
        executor.map(
            bag_regions,
            items,
            panel=panel,
            preprocessings=list(preprocessings),
            models=dict(models),
            grid=grid,
        ),
        len(paths),
        "regions",
        progress,
    ):
        if got is None:
            return None
        sums.add(t, *got)
    return sums.table(list(panel.markers))


def fitted_representations(
    estimators: Sequence[BaseEstimator], dim: int
) -> tuple[list[BagRepresentation], list[int]]:
    """The distinct data-free representations of ``estimators``, fitted for ``dim``
    markers, and the index of each estimator's representation among them.

    Raises
    ------
    ValueError
        An estimator cannot be trained from streamed features, naming why.
    """
    reps: list[BagRepresentation] = []
    keys: list[str] = []
    which: list[int] = []
    for est in estimators:
        if not hasattr(est, "fit_embedded"):
            raise ValueError(
                f"{type(est).__name__} does not train from streamed features; streaming "
                "and Dask training support DistributionRidge and DistributionRidgeClassifier"
            )
        rep = est.unfitted_representation()
        reason = rep.data_dependence()
        if reason is not None:
            raise ValueError(
                f"{type(rep).__name__} cannot featurise bags where they are read: {reason}"
            )
        rep.fit_to_dimension(dim)
        key = joblib.hash(rep)
        if key not in keys:
            keys.append(key)
            reps.append(rep)
        which.append(keys.index(key))
    return reps, which


def _progress(
    items: Iterator[tuple[int, Any]], total: int, desc: str, show: bool
) -> Iterator[tuple[int, Any]]:
    if not show:
        return items
    from tqdm.auto import tqdm

    return iter(tqdm(items, total=total, desc=desc, unit="bag"))


def scalings(
    base: Mapping[str, Any],
    summaries: Sequence[BagSummary],
    train_sets: Sequence[NDArray[np.int64]],
) -> list[Preprocessing]:
    """One fitted :class:`Preprocessing` per training set, from the bags' moments."""
    out = []
    for rows in train_sets:
        pre = Preprocessing(**base)
        if pre.scale == "standard":
            pre.fit_moments([summaries[i].moments for i in rows])  # type: ignore[misc]
        out.append(pre)
    return out


@dataclass(frozen=True)
class FoldTask:
    """One fit of the search: a candidate estimator on one fold's training bags."""

    estimator: BaseEstimator
    representation: BagRepresentation
    block: int
    scaling: int
    train: NDArray[np.int64]
    val: NDArray[np.int64]
    y_train: NDArray[Any]
    #: The subjects of the training bags (their fit leaves whole subjects out), if any.
    groups_train: NDArray[Any] | None = None


def fold_predictions(task: FoldTask, features: StreamedFeatures) -> NDArray[Any]:
    """Predictions for the fold's validation bags by a model fitted on its training bags."""
    model = for_point_predictions(task.estimator).fit_embedded(
        task.representation,
        features.embedding(task.block, task.scaling, task.train),
        task.y_train,
        task.groups_train,
    )
    return model.predict_embedded(features.embedding(task.block, task.scaling, task.val))


def cross_validate(
    executor: Executor,
    estimators: Sequence[BaseEstimator],
    blocks: Sequence[int],
    representations: Sequence[BagRepresentation],
    features: StreamedFeatures,
    y: NDArray[Any],
    folds: Sequence[tuple[NDArray[np.int64], NDArray[np.int64]]],
    progress: bool = False,
    groups: NDArray[Any] | None = None,
) -> list[NDArray[Any]]:
    """Out-of-fold predictions of every estimator, its folds fitted in parallel by the
    executor; fold ``f`` uses the features under scaling ``f``. ``groups`` (one per bag)
    go to each fold's fit where its training side holds two groups or more."""

    def fold_groups(train: NDArray[np.int64]) -> NDArray[Any] | None:
        if groups is None or np.unique(groups[train]).size < 2:
            return None
        return groups[train]

    tasks = [
        FoldTask(est, representations[r], r, f, train, val, y[train], fold_groups(train))
        for est, r in zip(estimators, blocks, strict=True)
        for f, (train, val) in enumerate(folds)
    ]
    kind = object if y.dtype.kind in "OUS" else np.float64
    preds = [np.empty(y.shape, dtype=kind) for _ in estimators]
    for i, pred in _progress(
        executor.map(fold_predictions, tasks, features=features), len(tasks), "search", progress
    ):
        preds[i // len(folds)][folds[i % len(folds)][1]] = pred
    return preds
