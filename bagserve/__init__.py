"""bagserve: learning on bags of points, and serving the models over HTTP.

Two layers, one distribution:

* :mod:`bagserve.core` trains, evaluates and saves models (``from bagserve.core import
  Bags, DistributionRidge, save, load``); it imports nothing from the service.
* :mod:`bagserve.service` serves saved models over HTTP (FastAPI + a worker pool).

The ``bagserve`` command (:mod:`bagserve.cli`) sits above both.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
