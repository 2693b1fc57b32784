"""Remotes: the registry of functions users serve over the ``/ws`` session protocol, remote
calls, and the Django-free remote client (``remotes.client``; docs/ws-protocol.md)."""
