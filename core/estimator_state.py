"""A fitted estimator as JSON and named arrays, and back: the state an artifact stores.

:class:`StateEncoder` walks an estimator's parameters and fitted state (nested
estimators, dataclasses, numpy arrays, plain values) into a JSON tree whose arrays are
named references; :class:`StateDecoder` rebuilds the estimator from the tree and the
arrays, every class checked against :func:`registry` (only the core's classes load
without pickle). Arrays are aligned as the model computes with them
(:func:`canonical_alignment`), so that a model predicts bit for bit alike as fitted and
as loaded. :mod:`.artifacts` writes and verifies the files.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .bags import Bags
from .errors import ArtifactError

# scikit-learn is imported where a model is encoded or decoded: reading and verifying a
# manifest needs neither it nor scipy.
if TYPE_CHECKING:
    from sklearn.base import BaseEstimator

__all__ = [
    "ALIGNMENT",
    "StateDecoder",
    "StateEncoder",
    "aligned",
    "canonical_alignment",
    "estimator_class",
    "registry",
]


def registry() -> dict[str, type]:
    from . import estimators, representations

    classes = [
        representations.SlicedWasserstein,
        representations.MeanEmbedding,
        representations.DensityFeatures,
        representations.HistogramEmbedding,
        estimators.ConditionalMeanEmbedding,
        estimators.DistributionRidge,
        estimators.DistributionRidgeClassifier,
        estimators.MarginalTransferClassifier,
        estimators.MarginalTransferRegressor,
    ]
    return {cls.__name__: cls for cls in classes}


def estimator_class(name: str) -> type:
    """The core class a manifest names (only the core's classes load without pickle).

    Raises
    ------
    ArtifactError
        ``name`` is not one of the core's estimators or representations.
    """
    cls = registry().get(name)
    if cls is None:
        raise ArtifactError(
            f"unknown estimator class {name!r}: only the core's estimators load without pickle"
        )
    return cls


# ----------------------------------------------------------------------- alignment
#: Every array a model computes with sits at a multiple of this many bytes: BLAS and
#: numpy's vector loops round differently at different alignments (the last bit of a
#: sum moves), so a model only predicts bit for bit alike as fitted, loaded into
#: private memory, and loaded into shared memory (where each NPY file starts at a
#: multiple of 64, and the format puts its data at one) if all three agree on it.
ALIGNMENT = 64


def aligned(a: np.ndarray) -> np.ndarray:
    """``a`` itself if it starts at a multiple of :data:`ALIGNMENT` bytes, else a copy
    that does (same values, dtype, shape and writeability, C order)."""
    if a.ctypes.data % ALIGNMENT == 0 and a.flags.c_contiguous:
        return a
    buf = np.empty(a.nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-buf.ctypes.data) % ALIGNMENT
    out = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    out.flags.writeable = a.flags.writeable
    return out


def canonical_alignment(obj: Any) -> Any:
    """Move every array of a fitted model (its estimators, representations, embeddings
    and bags) to :func:`aligned` memory, in place, dropping what was cached from the
    old copies; returns ``obj`` (or its aligned copy, for an array)."""
    from sklearn.base import BaseEstimator

    from .representations.base import FeatureEmbedding
    from .representations.mean import SetKernelEmbedding

    if isinstance(obj, np.ndarray):
        return aligned(obj)
    if isinstance(obj, list):
        obj[:] = [canonical_alignment(v) for v in obj]
    elif isinstance(obj, tuple):
        return tuple(canonical_alignment(v) for v in obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = canonical_alignment(v)
    elif isinstance(obj, Bags):
        obj._points = aligned(obj._points)
        obj._offsets = aligned(obj._offsets)
        if obj._weights is not None:
            obj._weights = aligned(obj._weights)
    elif isinstance(obj, FeatureEmbedding):
        obj.features = aligned(obj.features)
        obj._sqnorms = None
    elif isinstance(obj, SetKernelEmbedding):
        canonical_alignment(obj.bags)
        if obj._self is not None:
            obj._self = aligned(obj._self)
    elif isinstance(obj, BaseEstimator):
        for k, v in list(vars(obj).items()):
            if k == "_last_distances":
                setattr(obj, k, None)  # distances computed with the old copies
            elif not k.startswith("__"):
                setattr(obj, k, canonical_alignment(v))
    return obj


# ----------------------------------------------------------------------- encoding
class StateEncoder:
    """Turns fitted objects into JSON plus named arrays (and back)."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def _array(self, value: np.ndarray, hint: str) -> dict[str, str]:
        if value.dtype == object:
            raise ArtifactError(f"cannot store object array {hint!r} without pickle")
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", hint).strip("_") or "array"
        name = base
        i = 1
        while name in self.arrays:
            i += 1
            name = f"{base}.{i}"
        self.arrays[name] = np.ascontiguousarray(value)
        return {"__array__": name}

    def encode(self, value: Any, hint: str) -> Any:
        from sklearn.base import BaseEstimator

        from .kernels import DistanceKernel
        from .representations.base import FeatureEmbedding
        from .representations.mean import SetKernelEmbedding

        classes = registry()
        if isinstance(value, np.ndarray):
            return self._array(value, hint)
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{hint}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{hint}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise ArtifactError(f"{hint}: dictionary keys must be strings")
            return {"__dict__": {k: self.encode(v, f"{hint}.{k}") for k, v in value.items()}}
        if isinstance(value, np.random.Generator | np.random.RandomState):
            # A generator's state is not a parameter worth keeping: the fitted draws are.
            return {"__random_state__": type(value).__name__}
        if isinstance(value, BaseEstimator) and type(value).__name__ in classes:
            return self.estimator(value, hint)
        if isinstance(value, Bags):
            return {
                "__bags__": {
                    "points": self._array(value.points, f"{hint}.points"),
                    "offsets": self._array(value.offsets, f"{hint}.offsets"),
                    "weights": None
                    if value.weights is None
                    else self._array(value.weights, f"{hint}.weights"),
                }
            }
        if isinstance(value, FeatureEmbedding):
            return {
                "__feature_embedding__": {
                    "features": self._array(value.features, f"{hint}.features"),
                    "geometry": value.geometry,
                }
            }
        if isinstance(value, SetKernelEmbedding):
            return {
                "__set_kernel_embedding__": {
                    "bags": self.encode(value.bags, f"{hint}.bags"),
                    "kernel": value.kernel,
                    "bandwidth": value.bandwidth,
                    "n_jobs": value.n_jobs,
                    # Cached self terms come from the training Gram's diagonal; keeping
                    # them keeps predictions bit for bit.
                    "self_inner": self._array(value.self_inner(), f"{hint}.self_inner"),
                }
            }
        if isinstance(value, DistanceKernel):
            return {"__distance_kernel__": {"name": value.name, "params": dict(value.params)}}
        raise ArtifactError(
            f"{hint}: cannot store a {type(value).__name__} without pickle "
            "(use save(..., pickle=True, trusted=True) for objects outside the core)"
        )

    def estimator(self, est: BaseEstimator, hint: str) -> dict[str, Any]:
        params = {
            k: self.encode(v, f"{hint}.param.{k}") for k, v in est.get_params(deep=False).items()
        }
        state = {
            k: self.encode(v, f"{hint}.{k}")
            for k, v in sorted(vars(est).items())
            if k.endswith("_") and not k.startswith("_")
        }
        return {"__estimator__": type(est).__name__, "params": params, "state": state}


class StateDecoder:
    def __init__(self, load_array: Callable[[str], np.ndarray]) -> None:
        self.load_array = load_array

    def decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) != 1:
            raise ArtifactError("malformed manifest: unexpected object")
        ((tag, body),) = value.items()
        if tag == "__array__":
            return self.load_array(body)
        if tag == "__float__":
            return float(body)
        if tag == "__tuple__":
            return tuple(self.decode(v) for v in body)
        if tag == "__dict__":
            return {k: self.decode(v) for k, v in body.items()}
        if tag == "__random_state__":
            return None
        if tag == "__estimator__":
            raise ArtifactError("malformed manifest: estimator without parameters")
        if tag == "__bags__":
            w = None if body["weights"] is None else self.decode(body["weights"])
            return Bags.from_stored(self.decode(body["points"]), self.decode(body["offsets"]), w)
        if tag == "__feature_embedding__":
            from .representations.base import FeatureEmbedding

            return FeatureEmbedding(self.decode(body["features"]), body["geometry"])
        if tag == "__set_kernel_embedding__":
            from .representations.mean import SetKernelEmbedding

            emb = SetKernelEmbedding(
                self.decode(body["bags"]), body["kernel"], body["bandwidth"], body["n_jobs"]
            )
            emb._self = np.asarray(self.decode(body["self_inner"]))
            return emb
        if tag == "__distance_kernel__":
            from .kernels import DistanceKernel

            return DistanceKernel(body["name"], dict(body["params"]))
        raise ArtifactError(f"malformed manifest: unknown tag {tag!r}")

    def estimator(self, spec: dict[str, Any]) -> BaseEstimator:
        from .estimators.transfer import artifact_class

        name = str(spec.get("__estimator__"))
        cls = artifact_class(name, spec["params"]) or estimator_class(name)
        params = {k: self._value(v) for k, v in spec["params"].items()}
        est = cls(**params)
        for k, v in spec["state"].items():
            setattr(est, k, self._value(v))
        return est

    def _value(self, v: Any) -> Any:
        if isinstance(v, dict) and "__estimator__" in v:
            return self.estimator(v)
        return self.decode(v)
