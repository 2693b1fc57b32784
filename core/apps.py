from __future__ import annotations

from django.apps import AppConfig


class CoreConfig(AppConfig):
    """The kernel: instance identity, server processes and presence, API tokens, the JSON
    edge, errors, realtime helpers (docs/architecture.md). Imports no other Dispatch app."""

    name = "core"
    verbose_name = "Dispatch core"

    def ready(self) -> None:
        from core import checks  # noqa: F401  (registers the deployment checks)
