"""``python -m machines.shim`` (in a clone of the server; installed: ``dispatch-shim``):
see :mod:`.cli`."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main(prog=f"python -m {__package__}"))
