"""An MLServer runtime that predicts with a bagserve artifact, for ``bench_mlserver.py``.

MLServer loads it from its own venv (where bagserve is installed without its service
dependencies) as ``mlserver_runtime.BagRuntime``. It runs the very computation a
bagserve worker runs for a ``/v2`` request, :meth:`ModelRuntime.predict` of the same
artifact with one BLAS thread, on the same Open Inference Protocol body, and answers the
outputs bagserve answers for a regressor (``prediction``, ``status``, ``out_of_range``,
``domain_score``): the two servers differ only in what they do around the model.
"""

from __future__ import annotations

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec, StringCodec
from mlserver.types import InferenceRequest, InferenceResponse


class BagRuntime(MLModel):
    """One bag (``points``, ``[n, d]``) in, the model's prediction and domain report out."""

    async def load(self) -> bool:
        """Open the artifact named by the model settings' ``parameters.uri``."""
        from bagserve.core.runtime import ModelRuntime
        from threadpoolctl import threadpool_limits

        # As bagserve's workers: the processes, not BLAS, use the cores.
        threadpool_limits(1)
        self._runtime = ModelRuntime.open(self.settings.parameters.uri, mmap=True)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        """Predict the bag of the request's first input."""
        from bagserve.core.bags import Bags

        points = np.ascontiguousarray(NumpyCodec.decode_input(payload.inputs[0]), np.float64)
        bags = Bags(points, np.array([0, len(points)], dtype=np.int64), validate=False)
        result = self._runtime.predict(bags)
        outputs = [
            NumpyCodec.encode_output("prediction", np.asarray(result.estimate, np.float64)),
            StringCodec.encode_output("status", [result.status_of(0)]),
        ]
        if result.domain is not None:
            outputs += [
                NumpyCodec.encode_output("out_of_range", result.domain.out_of_range),
                NumpyCodec.encode_output("domain_score", result.domain.score),
            ]
        return InferenceResponse(
            model_name=self.name, model_version=self.version, id=payload.id, outputs=outputs
        )
