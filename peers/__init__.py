"""Peers: linked Dispatch instances (docs/peers.md)."""
