from __future__ import annotations

from django.apps import AppConfig


class RemotesConfig(AppConfig):
    """The ``/ws`` session protocol and remotes (spec/sessions-and-remotes.md)."""

    name = "remotes"
