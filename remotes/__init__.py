"""Remotes: the /ws session consumer, the remote registry and remote calls."""
