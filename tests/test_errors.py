"""core.errors: one root for the errors the core raises on purpose, each still a ValueError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import bagserve.core
import pytest
from bagserve.core import CoreError


def _core_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined anywhere in bagserve.core (every module imported)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(bagserve.core.__path__, "bagserve.core."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(obj, BaseException)
                and not issubclass(obj, Warning)
                and obj.__module__.startswith("bagserve.core")
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_core_error_derives_from_core_error_and_value_error():
    found = _core_exceptions()
    assert len(found) >= 5, found
    for name, cls in found.items():
        assert issubclass(cls, CoreError), name
        if cls is not CoreError:
            assert issubclass(cls, ValueError), name


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("bagserve.core.io", "DataError"),
        ("bagserve.core.artifacts", "ArtifactError"),
        ("bagserve.core.bags", "BagValidationError"),
        ("bagserve.core.training", "ConfigError"),
    ],
)
def test_errors_stay_importable_where_they_were(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert cls is getattr(importlib.import_module("bagserve.core.errors"), name)
    assert issubclass(cls, CoreError) and issubclass(cls, ValueError)


def test_the_core_raises_them(tmp_path):
    from bagserve.core import Bags, load
    from bagserve.core.io import read_sample

    with pytest.raises(CoreError, match="no manifest"):
        load(tmp_path)
    with pytest.raises(CoreError, match="no cells"):
        read_sample(b"a,b\n", format="csv")
    with pytest.raises(CoreError) as info:
        Bags.from_arrays([[[1.0, 2.0]], [[1.0]]])
    assert info.value.problems  # BagValidationError keeps its list of problems


def test_bag_validation_errors_survive_pickling_with_every_problem():
    import pickle

    from bagserve.core.errors import BagValidationError

    problems = [f"bag {i} is empty" for i in range(25)]
    back = pickle.loads(pickle.dumps(BagValidationError(problems)))
    assert isinstance(back, BagValidationError)
    assert back.problems == problems and str(back) == str(BagValidationError(problems))
