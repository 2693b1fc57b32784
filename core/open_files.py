"""A process's open-file limit: each websocket, HTTP client, database and Redis connection
is one descriptor. No Django: the benchmarks' client processes use it too."""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)

# Descriptors a process asks for at start. 5,000 shims + 5,000 sessions (bench B6) need ~10,100.
OPEN_FILES_WANTED = 65536


def raise_open_file_limit(wanted: int = OPEN_FILES_WANTED) -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to ``min(wanted, hard limit)`` (never
    lower it), as nginx's ``worker_rlimit_nofile`` does: a login shell's soft limit is
    often 1,024, which would cap a process near 1,000 connections while the hard limit
    allows far more. Children inherit the new limit. Returns ``(before, after)`` soft
    limits; an OS that refuses leaves the limit as it was (logged)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %s to %s: %s", soft, target, exc)
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]
