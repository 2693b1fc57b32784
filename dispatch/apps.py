from __future__ import annotations

from django.apps import AppConfig


class DispatchConfig(AppConfig):
    """The project package as an app: its commands (``serve``, ``dispatch_worker``), the
    edges over several apps (``/mcp``, ``/ws``) and the MCP stream rows (docs/architecture.md)."""

    name = "dispatch"
    verbose_name = "Dispatch"

    def ready(self) -> None:
        from dispatch import schema  # noqa: F401  (registers the OpenAPI auth scheme)
