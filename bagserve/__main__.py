"""``python -m bagserve``: the same as the ``bagserve`` command."""

import sys

from .cli import main

sys.exit(main())
