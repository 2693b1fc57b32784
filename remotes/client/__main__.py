"""``python -m remotes.client`` (in a clone of the server; installed: ``dispatch-remote``):
see :mod:`.cli`."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main(prog=f"python -m {__package__}"))
