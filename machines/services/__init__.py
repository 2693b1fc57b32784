"""Every write of the machines app, split by concern (docs/architecture.md#the-layers).

- ``device``: RFC 8628 device login and machine tokens (docs/shim-protocol.md#getting-a-token);
"""
