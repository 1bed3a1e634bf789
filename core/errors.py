"""The exceptions the core raises on purpose, under one root: :class:`CoreError`.

A caller that wants "anything the core refused" catches :class:`CoreError`; one that
wants a particular problem catches its class. Every class here is also a
:class:`ValueError`, as each was before the root existed, so callers that catch
``ValueError`` keep working.

Each class stays importable from the module that raises it (``bagserve.core.io``,
``bagserve.core.artifacts``, ``bagserve.core.bags``, ``bagserve.core.training``); they
live here so that the hierarchy reads in one place and no module has to import another
just for its exception.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ArtifactError",
    "BagValidationError",
    "ConfigError",
    "CoreError",
    "DataError",
    "SizeLimitError",
]

# At most this many problems are listed in one error message; the count of the
# rest is still reported.
_MAX_LISTED_PROBLEMS = 20


class CoreError(Exception):
    """Root of every error the core raises on purpose.

    Bugs and failures of the machine (``TypeError``, ``MemoryError``, ``OSError`` from a
    full disk, ...) are not wrapped: a :class:`CoreError` always means that the input,
    a file or a configuration was refused, and its message says why.
    """


class DataError(CoreError, ValueError):
    """A file could not be read as a bag of cells, or does not fit the model's panel."""


class SizeLimitError(DataError):
    """Reading would exceed a size limit the caller set (decoded bytes, cells, columns).

    Raised before the memory is allocated, from what a header or a compressed stream
    says; the message names the limit. A service answers it with 413 rather than 422:
    the data may be valid, only too large for this server.
    """


class ArtifactError(CoreError, ValueError):
    """A model artifact is missing, tampered with, truncated, or of a newer format."""


class ConfigError(CoreError, ValueError):
    """The training configuration is invalid (names the table and key)."""


class BagValidationError(CoreError, ValueError):
    """Raised when bags are malformed; lists every problem found, not only the first.

    Parameters
    ----------
    problems : sequence of str
        One sentence per problem, each naming the bag (by position) it concerns.

    Attributes
    ----------
    problems : list of str
        The problems, all of them (the message lists the first twenty).
    """

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        shown = self.problems[:_MAX_LISTED_PROBLEMS]
        extra = len(self.problems) - len(shown)
        text = "; ".join(shown)
        if extra:
            text += f"; and {extra} more problem(s)"
        super().__init__(text)

    def __reduce__(self) -> tuple[type[BagValidationError], tuple[list[str]]]:
        # Rebuilt from its problems, not its message: the error crosses process
        # boundaries (Dask workers, streamed training) with every problem intact.
        return (type(self), (self.problems,))
