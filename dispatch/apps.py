from __future__ import annotations

from django.apps import AppConfig


class DispatchConfig(AppConfig):
    """The core app: instance identity, server processes, API tokens."""

    name = "dispatch"
    verbose_name = "Dispatch"

    def ready(self) -> None:
        from dispatch import checks, schema  # noqa: F401  (registers checks and the OpenAPI auth scheme)
