"""The ``/ws`` session edge: one consumer for remotes and agents (docs/ws-protocol.md)."""
