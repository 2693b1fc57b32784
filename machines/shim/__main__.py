"""``python -m machines.shim``: see :mod:`machines.shim.cli`."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
