"""Peers: linked Dispatch instances (spec/peers.md)."""
