from __future__ import annotations

from django.apps import AppConfig


class PeersConfig(AppConfig):
    """Linked instances (spec/peers.md)."""

    name = "peers"

    def ready(self) -> None:
        from core.revocation import live_credentials_register
        from peers.hooks import live_peers

        # A linked instance's event stream (/api/v1/peers/events) ends with its link.
        live_credentials_register("p", "peer_id", live_peers)
