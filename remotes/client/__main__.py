"""``python -m remotes.client``: see :mod:`remotes.client.cli`."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
