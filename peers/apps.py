from __future__ import annotations

from django.apps import AppConfig


class PeersConfig(AppConfig):
    """Linked instances (docs/peers.md)."""

    name = "peers"

    def ready(self) -> None:
        from core.revocation import live_credentials_register
        from peers.hooks import live_peers

        # A linked instance's event stream (/api/v1/peers/events) ends with its link.
        live_credentials_register("p", "peer_id", live_peers)

        # Offer agents' domain code what it needs of linked instances (agents.hooks): it
        # sits below peers and never imports them.
        from agents.hooks import linked_register
        from peers.remote_launch import PeerLinks

        linked_register(PeerLinks())
