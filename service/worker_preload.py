"""What every worker needs, imported once by the process the workers are forked from.

With multiprocessing's ``forkserver`` start method (:mod:`.worker_server`),
this module is imported by the fork server when the service starts, in parallel with
the web framework's imports in the main process. Each worker is then a fork of that
server: it starts in milliseconds with numpy, scipy, the estimators, the codecs and the
validation loaded (their pages shared with the other workers), where a spawned worker
spends seconds importing them again. Nothing here is imported by the service itself.
"""

from __future__ import annotations

import os

# Before numpy loads: one BLAS thread per worker (the pool, not BLAS, uses the cores),
# and no BLAS threads in the fork server, which a forked child would not have anyway.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import threadpoolctl  # noqa: F401
from bagserve.core import estimators, runtime  # noqa: F401

from . import codecs, registry, tensors, validation, worker  # noqa: F401
