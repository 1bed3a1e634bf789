"""Parameter constraints declared once per estimator, checked in one place.

Each estimator lists what its hyperparameters may be in a class attribute
``_parameter_constraints`` (scikit-learn's convention): name -> constraint. ``fit``
calls :func:`validate_params`, which raises the first violation as a ``ValueError``
naming the parameter, what it must be and what it got. Checks that depend on the
data or on another parameter (a kernel without a gamma, random features of a
representation without explicit features) stay where that is known.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Constraint", "IntegerAtLeast", "OneOf", "validate_params"]


class Constraint(Protocol):
    """What a parameter may be."""

    def problem(self, name: str, value: Any) -> str | None:
        """Why ``value`` is not allowed for ``name``, or None."""


@dataclass(frozen=True)
class OneOf:
    """One of a few values; ``words`` is how the message lists them."""

    options: tuple[Any, ...]
    words: str

    def problem(self, name: str, value: Any) -> str | None:
        return None if value in self.options else f"{name} must be {self.words}, got {value!r}"


@dataclass(frozen=True)
class IntegerAtLeast:
    """An integer (an integral float will do) of at least ``low``; ``None`` too when
    ``optional``."""

    low: int
    optional: bool = False

    def problem(self, name: str, value: Any) -> str | None:
        if value is None and self.optional:
            return None
        if int(value) != value or value < self.low:
            return f"{name} must be an integer >= {self.low}, got {value!r}"
        return None


def validate_params(estimator: Any) -> None:
    """Check ``estimator``'s parameters against its ``_parameter_constraints``.

    Raises
    ------
    ValueError
        The first parameter that breaks its constraint, in the order declared.
    """
    constraints: Mapping[str, Constraint] = type(estimator)._parameter_constraints
    for name, constraint in constraints.items():
        problem = constraint.problem(name, getattr(estimator, name))
        if problem is not None:
            raise ValueError(problem)
