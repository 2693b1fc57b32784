"""Signed ``Mcp-Session-Id`` values and the call keys they scope (docs/mcp.md#sessions):
no server, no database — what any process can check on its own."""

from __future__ import annotations

from django.test import override_settings

from dispatch.mcp.server import call_key
from dispatch.mcp.sessions import session_issue, session_valid


def test_a_session_id_is_valid_with_the_token_it_was_issued_for_only() -> None:
    session = session_issue("token-a")
    assert session_valid(session, "token-a")
    assert not session_valid(session, "token-b")
    assert not session_valid(session + "x", "token-a")
    assert not session_valid("", "token-a")
    assert not session_valid("é" + session, "token-a")  # outside visible ASCII
    assert not session_valid(session + "a" * 200, "token-a")
    assert session_issue("token-a") != session


def test_a_session_signed_with_a_retired_secret_key_is_refused_and_a_fallback_key_still_verifies() -> None:
    with override_settings(SECRET_KEY="k" * 50):
        session = session_issue("token-a")
    with override_settings(SECRET_KEY="n" * 50, SECRET_KEY_FALLBACKS=["k" * 50]):
        assert session_valid(session, "token-a")
    with override_settings(SECRET_KEY="n" * 50, SECRET_KEY_FALLBACKS=[]):
        assert not session_valid(session, "token-a")


def test_two_sessions_of_one_token_reusing_a_request_id_are_two_calls() -> None:
    one, two = session_issue("token-a"), session_issue("token-a")
    assert call_key("token-a", 1, one) != call_key("token-a", 1, two)
    assert call_key("token-a", 1, one) == call_key("token-a", 1, one)
    assert call_key("token-a", 1, one) != call_key("token-a", 1)  # no session: today's key
    assert call_key("token-a", 1) != call_key("token-a", "1")
    assert len(call_key("token-a", "x" * 200, one)) < 300  # OperationInFlight.call_key holds 300
