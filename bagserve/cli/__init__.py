"""The ``bagserve`` command: train, evaluate, validate, predict, list models, build the demo.

One module per command group, each defining its own arguments (its ``register``) and
running them: :mod:`~bagserve.cli.train` (train, evaluate, demo),
:mod:`~bagserve.cli.validate`, :mod:`~bagserve.cli.predict`, :mod:`~bagserve.cli.batch`,
:mod:`~bagserve.cli.models`, :mod:`~bagserve.cli.serve` (serve, openapi),
:mod:`~bagserve.cli.audit`, :mod:`~bagserve.cli.signing`; what predict and batch share:
:mod:`~bagserve.cli.local` (a saved model on this machine) and
:mod:`~bagserve.cli.remote` (a running service). :mod:`~bagserve.cli.main` puts them
together.

Exit codes fit scripts: 0 on success, 1 with one ``error: ...`` line on stderr for any
data, configuration or model problem, 2 for a wrong command line, 130 on Ctrl-C.
"""

from __future__ import annotations

from .main import main

__all__ = ["main"]
