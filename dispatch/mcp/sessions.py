"""Signed MCP session ids: the ``Mcp-Session-Id`` header (docs/mcp.md#sessions).

MCP's Streamable HTTP transport (protocol 2025-03-26 and later) lets a server give each
client a session on ``initialize``; the client then sends it with every request, and
request ids are unique only within it. Dispatch keeps nothing per session: the id is
``<nonce>:<signature>``, the signature being Django's HMAC (``django.core.signing``, so
``SECRET_KEY`` and ``SECRET_KEY_FALLBACKS``) over the nonce, salted with the digest of the
bearer token that initialized it. Any ``serve`` process can verify it, no sticky routing
is needed, and it is valid only with that token, for as long as that token is (an
expired or revoked token is refused before its session is looked at).

``session_tag`` is the short, stable form the session takes inside a tool call's
``call_key`` (``dispatch.mcp.server.call_key``), so that progress, cancellation and the
in-flight rows of one client are not another's, even when both reuse a request id.
"""

from __future__ import annotations

import hashlib
import re
import secrets

from django.core import signing

from core.services import token_digest

SESSION_HEADER = "mcp-session-id"
# MCP "Session Management": visible ASCII only; ours are about 66 characters.
_SHAPE = re.compile(r"[\x21-\x7e]{1,200}")
_SALT = "dispatch.mcp.session"


def _signer(raw_token: str) -> signing.Signer:
    return signing.Signer(salt=f"{_SALT}:{token_digest(raw_token)}")


def session_issue(raw_token: str) -> str:
    """A new session id for the credential ``raw_token``: ``<22-character nonce>:<signature>``,
    visible ASCII (MCP 2025-11-25 "Session Management")."""
    return _signer(raw_token).sign(secrets.token_urlsafe(16))


def session_valid(session_id: str, raw_token: str) -> bool:
    """Whether ``session_id`` (an ``Mcp-Session-Id`` header value) was issued by this
    instance for ``raw_token``. ``False`` for a tampered or malformed id, one signed with a
    key no longer in ``SECRET_KEY``/``SECRET_KEY_FALLBACKS``, or one of another token."""
    if not _SHAPE.fullmatch(session_id):
        return False
    try:
        _signer(raw_token).unsign(session_id)
    except signing.BadSignature:
        return False
    return True


def session_tag(session_id: str) -> str:
    """16 hex digits naming ``session_id`` in a ``call_key`` (a hash: the id itself is a
    bearer secret of sorts and the keys are stored in ``OperationInFlight`` rows)."""
    return hashlib.sha256(session_id.encode("ascii", "replace")).hexdigest()[:16]
