"""The MCP endpoint at ``/mcp`` (spec/agents.md §6, sessions-and-remotes.md §2.6).

``tools`` builds the caller's tool catalogue per request, ``server`` is the SDK's
low-level ``Server`` with its ``tools/list`` and ``tools/call`` handlers, ``app`` the
ASGI application (bearer auth, the SDK's stateless streamable-HTTP session manager).
"""
