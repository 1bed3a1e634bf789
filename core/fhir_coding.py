"""How a model's output is coded for clinical systems: the ``[fhir]`` table.

A laboratory information system files a result under a code it knows (a LOINC code, or
one of the lab's own code system), with a unit it can convert (UCUM). The training
configuration says which, once per model::

    [fhir]
    system = "http://loinc.org"          # the code system of the observation's code
    code = "26464-8"
    display = "Leukocytes [#/volume] in Blood"
    unit = "10*3/uL"                     # UCUM code of the value (regressors)
    unit_display = "10^3/µL"             # optional; the code is shown otherwise
    category = "laboratory"              # observation-category code (the default)
    reference_range = [4.0, 11.0]        # optional: the clinical normal range, [low, high]

    [fhir.classes]                       # optional: a coding for each class label
    Pos = { system = "http://snomed.info/sct", code = "10828004", display = "Positive" }

Stored in the artifact's manifest (``metadata["fhir"]``), it is how the service answers
``Accept: application/fhir+json`` (:mod:`bagserve.service.fhir`). Without a ``[fhir]``
table the model's output is coded in bagserve's own code system (``urn:bagserve:model``,
the model's name as code), which a receiving system can map.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = ["DEFAULT_SYSTEM", "UCUM", "Coding", "OutputCoding"]

#: The code system of a model's output when its configuration names none.
DEFAULT_SYSTEM = "urn:bagserve:model"
#: Unified Code for Units of Measure, FHIR's system for quantities.
UCUM = "http://unitsofmeasure.org"
#: FHIR R4 ``uri``: no whitespace; an absolute URI (scheme first) for a code system.
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:\S+$")
#: FHIR R4 ``code``: no leading/trailing whitespace, single spaces only.
_CODE = re.compile(r"^[^\s]+( [^\s]+)*$")
#: observation-category codes (http://terminology.hl7.org/CodeSystem/observation-category).
CATEGORIES = {
    "social-history": "Social History",
    "vital-signs": "Vital Signs",
    "imaging": "Imaging",
    "laboratory": "Laboratory",
    "procedure": "Procedure",
    "survey": "Survey",
    "exam": "Exam",
    "therapy": "Therapy",
    "activity": "Activity",
}


@dataclass(frozen=True)
class Coding:
    """One code in one code system (FHIR ``Coding``)."""

    system: str
    code: str
    display: str | None = None

    @classmethod
    def from_config(cls, spec: Any, where: str) -> Coding:
        """A coding from a ``{system, code, display}`` table; ``where`` names it in errors."""
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where} must be a table with system and code, got {spec!r}")
        unknown = set(spec) - {"system", "code", "display"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
        for key in ("system", "code"):
            if key not in spec:
                raise ConfigError(f"{where}: missing {key}")
        system, code, display = spec["system"], spec["code"], spec.get("display")
        if not isinstance(system, str) or not _URI.match(system):
            raise ConfigError(
                f"{where} system must be an absolute URI such as 'http://loinc.org', got {system!r}"
            )
        if not isinstance(code, str) or not _CODE.match(code):
            raise ConfigError(
                f"{where} code must be a non-empty string without leading, trailing or "
                f"double spaces, got {code!r}"
            )
        if display is not None and (not isinstance(display, str) or not display.strip()):
            raise ConfigError(f"{where} display must be a non-empty string, got {display!r}")
        return cls(system, code, display)

    def to_json(self) -> dict[str, str]:
        """As FHIR JSON (and as stored in the manifest)."""
        out = {"system": self.system, "code": self.code}
        if self.display:
            out["display"] = self.display
        return out


@dataclass(frozen=True)
class OutputCoding:
    """How one model's output is coded: its code, unit, category, class codings and
    clinical reference range (see the module docstring for the ``[fhir]`` table).

    Attributes
    ----------
    code : Coding
        The observation's code.
    unit, unit_display : str or None
        UCUM code of a numeric value and how to show it.
    category : str
        An observation-category code.
    classes : dict of str to Coding
        Codings of class labels (by the label's text); labels not listed are coded in
        bagserve's system.
    reference_range : tuple of (float or None, float or None), or None
        The clinical normal range ``(low, high)`` of a numeric value (either end may be
        open); a value outside it is flagged high or low.
    configured : bool
        Whether a ``[fhir]`` table gave the code (else it is bagserve's default).
    """

    code: Coding
    unit: str | None = None
    unit_display: str | None = None
    category: str = "laboratory"
    classes: dict[str, Coding] = field(default_factory=dict)
    reference_range: tuple[float | None, float | None] | None = None
    configured: bool = True

    @classmethod
    def default(cls, name: str, description: str | None = None) -> OutputCoding:
        """bagserve's own coding of model ``name``'s output."""
        return cls(Coding(DEFAULT_SYSTEM, name, description or name), configured=False)

    @classmethod
    def from_config(
        cls,
        spec: Mapping[str, Any],
        *,
        classes: Iterable[Any] | None = None,
    ) -> OutputCoding:
        """Check and read a configuration's ``[fhir]`` table.

        Parameters
        ----------
        spec : mapping
            The table.
        classes : iterable, optional
            The model's class labels, when known: every key of ``[fhir.classes]`` must
            be one of them (a misspelt label would otherwise be coded in bagserve's
            system without a word).

        Raises
        ------
        ConfigError
            Naming the key and what was expected.
        """
        known = {
            "system",
            "code",
            "display",
            "unit",
            "unit_display",
            "category",
            "classes",
            "reference_range",
        }
        unknown = set(spec) - known
        if unknown:
            raise ConfigError(f"[fhir] unknown key(s) {sorted(unknown)}; expected {sorted(known)}")
        code = Coding.from_config(
            {k: spec[k] for k in ("system", "code", "display") if k in spec}, "[fhir]"
        )
        unit, unit_display = spec.get("unit"), spec.get("unit_display")
        for key, value in (("unit", unit), ("unit_display", unit_display)):
            if value is not None and (not isinstance(value, str) or not _CODE.match(value)):
                raise ConfigError(
                    f"[fhir] {key} must be a UCUM unit such as 'mg/dL', got {value!r}"
                )
        category = spec.get("category", "laboratory")
        if category not in CATEGORIES:
            raise ConfigError(
                f"[fhir] category must be one of {sorted(CATEGORIES)}, got {category!r}"
            )
        table = spec.get("classes", {})
        if not isinstance(table, Mapping):
            raise ConfigError("[fhir] classes must be a table: class label -> {system, code}")
        codings = {
            str(label): Coding.from_config(c, f"[fhir.classes] {label!r}")
            for label, c in table.items()
        }
        if classes is not None:
            names = {str(c) for c in classes}
            stray = sorted(set(codings) - names)
            if stray:
                raise ConfigError(
                    f"[fhir.classes] {stray} are not classes of the model; its classes "
                    f"are {sorted(names)}"
                )
        return cls(
            code,
            unit,
            unit_display,
            category,
            codings,
            _reference_range(spec.get("reference_range")),
        )

    def class_coding(self, model: str, label: Any) -> Coding:
        """The coding of class ``label`` (bagserve's system when not configured)."""
        text = str(label)
        return self.classes.get(text) or Coding(f"{DEFAULT_SYSTEM}:{model}:class", text, text)

    def to_json(self) -> dict[str, Any]:
        """As stored in the manifest (``metadata["fhir"]``)."""
        out: dict[str, Any] = {**self.code.to_json(), "category": self.category}
        if self.unit is not None:
            out["unit"] = self.unit
        if self.unit_display is not None:
            out["unit_display"] = self.unit_display
        if self.classes:
            out["classes"] = {k: v.to_json() for k, v in self.classes.items()}
        if self.reference_range is not None:
            out["reference_range"] = list(self.reference_range)
        return out

    @classmethod
    def from_json(cls, spec: Mapping[str, Any] | None, name: str, description: str | None = None):
        """From the manifest; bagserve's default coding when the model has none."""
        if not spec:
            return cls.default(name, description)
        return cls.from_config(spec)


def _reference_range(value: Any) -> tuple[float | None, float | None] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(
            f'[fhir] reference_range must be [low, high] (either may be "" for an open '
            f"end), got {value!r}"
        )
    ends: list[float | None] = []
    for v in value:
        if v in ("", None):
            ends.append(None)
        elif isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            ends.append(float(v))
        else:
            raise ConfigError(f"[fhir] reference_range ends must be numbers, got {v!r}")
    low, high = ends
    if low is None and high is None:
        raise ConfigError("[fhir] reference_range needs at least one end")
    if low is not None and high is not None and low > high:
        raise ConfigError(f"[fhir] reference_range low {low} is above high {high}")
    return low, high
