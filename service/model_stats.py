"""Per-model inference statistics in the form of Triton's statistics extension.

Prometheus (``/metrics``) has the service's histograms; Triton's clients instead ask
``GET /v2/models/{name}/stats`` for per-version counts and cumulative nanoseconds of
the stages of an inference. This module keeps those numbers, updated by the
prediction use-case after every attempt.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelStats"]

#: Triton's stage names, from the service's stage timings (seconds).
_STAGES = {
    "queue": ("queue",),
    "compute_input": ("parse", "validate", "transfer"),
    "compute_infer": ("compute",),
    "compute_output": ("encode",),
}


@dataclass
class _Counts:
    success: list[int] = field(default_factory=lambda: [0, 0])
    fail: list[int] = field(default_factory=lambda: [0, 0])
    stages: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in _STAGES})
    last_inference_ms: int = 0
    bags: int = 0


class ModelStats:
    """Counts and cumulative times per model version (``name/version``)."""

    def __init__(self) -> None:
        self._counts: dict[str, _Counts] = {}

    def observe(self, key: str, ok: bool, timings: Mapping[str, float], bags: int = 0) -> None:
        """One inference attempt on ``key``, with its stage timings in seconds."""
        c = self._counts.setdefault(key, _Counts())
        total_ns = int(1e9 * sum(timings.values()))
        target = c.success if ok else c.fail
        target[0] += 1
        target[1] += total_ns
        if ok:
            c.bags += bags
            for stage, sources in _STAGES.items():
                seconds = sum(timings.get(s, 0.0) for s in sources)
                c.stages[stage][0] += 1
                c.stages[stage][1] += int(1e9 * seconds)
        c.last_inference_ms = int(time.time() * 1000)

    def triton(self, keys: list[str]) -> dict[str, Any]:
        """Triton's ``model_stats`` document for model versions ``keys``."""
        out = []
        for key in keys:
            name, _, version = key.partition("/")
            c = self._counts.get(key, _Counts())

            def pair(counts: list[int]) -> dict[str, int]:
                return {"count": counts[0], "ns": counts[1]}

            out.append(
                {
                    "name": name,
                    "version": version,
                    "last_inference": c.last_inference_ms,
                    "inference_count": c.bags,
                    "execution_count": c.success[0],
                    "inference_stats": {
                        "success": pair(c.success),
                        "fail": pair(c.fail),
                        **{stage: pair(v) for stage, v in c.stages.items()},
                    },
                    "batch_stats": [],
                }
            )
        return {"model_stats": out}
