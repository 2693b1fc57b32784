"""Settings for the test suite: the real settings with short timeouts and a private data dir.

Every value can still be overridden from the environment (CI's second pass sets
DATABASE_URL and REDIS_URL).
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("DISPATCH_DATA_DIR", tempfile.mkdtemp(prefix="dispatch-tests-"))
# An empty folder: no client wheels unless a test puts some there (settings.DIST_DIR).
os.environ.setdefault("DISPATCH_DIST_DIR", tempfile.mkdtemp(prefix="dispatch-tests-dist-"))
os.environ.setdefault("DISPATCH_REMOTE_CALL_TIMEOUT", "5")
os.environ.setdefault("DISPATCH_REMOTE_LIVENESS_INTERVAL", "0.5")
os.environ.setdefault("DISPATCH_PROCESS_TTL", "4")
os.environ.setdefault("DISPATCH_HEARTBEAT_INTERVAL", "0.5")
os.environ.setdefault("DISPATCH_REAP_INTERVAL", "0.5")
os.environ.setdefault("DISPATCH_WS_AUTH_TIMEOUT", "10")
# Tests never touch the user's own tmux server (tests/conftest.py kills this one at the end).
os.environ.setdefault("DISPATCH_TMUX_SOCKET", f"dispatch-tests-{os.getpid()}")
# The Web Push tests run a push service of their own on 127.0.0.1 (tests/attention/conftest.py).
os.environ.setdefault("DISPATCH_NOTIFY_PUSH_LOOPBACK_HTTP", "true")

from dispatch.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast test users

_db = DATABASES["default"]  # noqa: F405
if _db["ENGINE"] != "django.db.backends.sqlite3" and "pool" not in _db.get("OPTIONS", {}):
    # Connections held by the consumers' worker thread would otherwise keep the test
    # database busy when pytest-django drops it at the end of the run. (PostgreSQL uses
    # the pool, already with CONN_MAX_AGE=0; Django closes the pool before the drop.)
    _db["CONN_MAX_AGE"] = 0
