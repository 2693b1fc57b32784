"""Dispatch as an OAuth 2.1 authorization server for MCP clients (docs/mcp.md#oauth).

django-oauth-toolkit does the protocol (authorization code + PKCE, tokens, refresh
rotation, revocation, RFC 8414/9728 metadata, DCR, CIMD); this app binds it to Dispatch:
which resource tokens are for (``validators``), what scopes let a token do (``scopes``),
who may register (``registration``), how ``/mcp/oauth`` authenticates (``resource``), and
the consent and connected-applications pages.
"""
