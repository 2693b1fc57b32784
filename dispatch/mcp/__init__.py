"""The MCP endpoint at ``/mcp`` (docs/mcp.md).

``tools`` builds the caller's tool catalogue per request, ``server`` is the SDK's
low-level ``Server`` with its ``tools/list``, ``tools/call`` and ``subscriptions/listen``
handlers, ``app`` the ASGI application (bearer auth, the SDK's stateless streamable-HTTP
session manager for POSTs, ``events`` for the ``GET /mcp`` event stream). ``relay`` brings
each user's tool-change doorbell into the process, ``streams`` keeps the rows, the limit
and the end of every open event stream, ``sessions`` signs and verifies ``Mcp-Session-Id``.
"""
