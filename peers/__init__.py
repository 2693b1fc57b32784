"""Peers: linked Dispatch instances (to come)."""
