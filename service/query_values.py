"""The one check of the identifiers a report's query names: FHIR's and HL7's.

``?subject=``, ``?specimen=`` and ``?effective=`` (FHIR, :func:`.fhir.references`) and
``?patient=`` and ``?order=`` (HL7, :func:`.hl7.hl7_references`) end up in messages
that clinical systems file: each is matched whole against its pattern before any work,
and refused with 422 naming the parameter, what it must be and what it got.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import Problem

__all__ = ["checked"]


def checked(name: str, value: Any, pattern: re.Pattern[str], must_be: str) -> str:
    """``value`` of query parameter ``name`` if it is a string matching ``pattern``.

    Raises
    ------
    Problem
        422: "``name`` must be ``must_be``, got ``value``".
    """
    if not isinstance(value, str) or not pattern.match(value):
        raise Problem(422, f"{name} must be {must_be}, got {value!r}")
    return value
