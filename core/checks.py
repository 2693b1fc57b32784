"""System checks for deployments (``manage.py check --deploy``; docs/deployment.md#many-processes)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Tags, Warning, register


@register(Tags.security, deploy=True)
def check_shared_state(app_configs: Any, **kwargs: Any) -> list[Warning]:
    """Warn about settings that break a deployment of several processes or hosts."""
    warnings: list[Warning] = []
    is_sqlite = settings.DATABASES["default"]["ENGINE"].endswith("sqlite3")
    if not is_sqlite and settings.SECRET_KEY_FROM_LOCAL_FILE:
        warnings.append(
            Warning(
                "SECRET_KEY comes from a file created on this host, but the database is shared.",
                hint="Set SECRET_KEY (or SECRET_KEY_FILE) to the same value on every host.",
                id="dispatch.W001",
            )
        )
    if not settings.REDIS_URL:
        warnings.append(
            Warning(
                "The channel layer is in memory: only one server process can serve this instance.",
                hint="Set REDIS_URL (and DATABASE_URL to PostgreSQL) to run several processes.",
                id="dispatch.W002",
            )
        )
    if not settings.PUBLIC_URL.startswith("https://"):
        warnings.append(
            Warning(
                "DISPATCH_PUBLIC_URL is not https: tokens and cookies cross the network in clear.",
                hint="Serve Dispatch behind TLS and set DISPATCH_PUBLIC_URL=https://…",
                id="dispatch.W003",
            )
        )
    return warnings
