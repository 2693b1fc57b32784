from __future__ import annotations

from django.apps import AppConfig


class PeersConfig(AppConfig):
    """Linked instances (spec/peers.md)."""

    name = "peers"
