from __future__ import annotations

from django.apps import AppConfig


class PeersConfig(AppConfig):
    """Linked instances (spec/peers.md)."""

    name = "peers"

    def ready(self) -> None:
        """Offer the agents app what it needs of linked instances (``agents.hooks``): agents
        sit below peers and never import them."""
        from agents.hooks import linked_register
        from peers.remote_launch import PeerLinks

        linked_register(PeerLinks())
