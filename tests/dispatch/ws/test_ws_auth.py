"""The four ways to authenticate a ``/ws`` session, and every refusal (docs/ws-protocol.md#authentication)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.conf import settings as django_settings
from django.test import Client
from django.utils import timezone

from core.models import ApiToken
from core.services import api_token_revoke
from remotes.models import WsSession

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "correct horse battery"
AUTH_FAILED = {"error": "authentication failed"}
TOO_MANY = {"error": "too many failed attempts; try again later"}
NOT_AUTHENTICATED = {"error": "not authenticated"}


async def assert_usable(ws) -> None:
    """The session is authenticated: an action gets its reply."""
    reply = await ws.request("ping")
    assert reply == {"pong": True, "nonce": f"n{ws._nonce}"}


# --- header token ----------------------------------------------------------------------


async def test_a_header_token_authenticates_at_once_without_an_auth_frame(ws_connect, owner, owner_token, count_rows):
    async with ws_connect(token=owner_token) as ws:
        await ws.send({"action": "ping", "nonce": 1})
        # The very first frame is the ping's reply: no auth frame was sent.
        assert await ws.recv() == {"pong": True, "nonce": 1}
        assert await count_rows(WsSession, user=owner, auth_method="header") == 1
    assert await count_rows(WsSession) == 0


async def test_it_refuses_a_bad_header_token(ws_connect, owner_token, count_rows):
    async with ws_connect(token=owner_token + "x") as ws:
        assert await ws.recv() == AUTH_FAILED
        assert await ws.closed_with() == 4401
    assert await count_rows(WsSession) == 0


async def test_a_frame_right_behind_a_refused_header_token_is_not_answered(ws_connect, owner_token):
    # The socket is closed once refused: answering a frame that was already on its way
    # meant sending on a closed socket (an ERROR traceback in the server log per frame,
    # which anyone could cause without a credential).
    async with ws_connect(token=owner_token + "x") as ws:
        await ws.send({"token": owner_token})
        assert await ws.recv() == AUTH_FAILED
        assert await ws.closed_with() == 4401
        assert await ws.nothing_received()


async def test_it_refuses_a_revoked_header_token(ws_connect, owner, token_for):
    raw = await database_sync_to_async(token_for)(owner)
    token = await database_sync_to_async(ApiToken.objects.get)(user=owner)
    await database_sync_to_async(api_token_revoke)(user=owner, token_id=token.pk)
    async with ws_connect(token=raw) as ws:
        assert await ws.recv() == AUTH_FAILED
        assert await ws.closed_with() == 4401


async def test_it_refuses_an_expired_header_token(ws_connect, owner, token_for):
    raw = await database_sync_to_async(token_for)(owner, expires_at=timezone.now() + timedelta(hours=1))
    await database_sync_to_async(ApiToken.objects.filter(user=owner).update)(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    async with ws_connect(token=raw) as ws:
        assert await ws.recv() == AUTH_FAILED
        assert await ws.closed_with() == 4401


# --- first-frame token -----------------------------------------------------------------


async def test_a_first_frame_token_authenticates_with_an_auth_reply_without_nonce(
    ws_connect, owner, owner_token, count_rows
):
    async with ws_connect() as ws:
        await ws.send({"token": owner_token})
        assert await ws.recv() == {"ok": True, "user": "alice"}
        await assert_usable(ws)
        assert await count_rows(WsSession, user=owner, auth_method="token") == 1


@pytest.mark.parametrize("which", ["unknown", "revoked", "expired", "not-a-string", "empty"])
async def test_it_refuses_a_first_frame_token_that_is_not_valid(ws_connect, owner, token_for, count_rows, which):
    raw = await database_sync_to_async(token_for)(owner, expires_at=timezone.now() + timedelta(hours=1))
    token = await database_sync_to_async(ApiToken.objects.get)(user=owner)
    sent: object = raw
    if which == "unknown":
        sent = raw[:-2] + ("AA" if not raw.endswith("AA") else "BB")
    elif which == "revoked":
        await database_sync_to_async(api_token_revoke)(user=owner, token_id=token.pk)
    elif which == "expired":
        await database_sync_to_async(ApiToken.objects.filter(pk=token.pk).update)(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
    elif which == "not-a-string":
        sent = [raw]
    else:
        sent = ""
    async with ws_connect() as ws:
        await ws.send({"token": sent})
        assert await ws.recv() == AUTH_FAILED
        assert await ws.closed_with() == 4401
    assert await count_rows(WsSession) == 0


# --- first-frame password --------------------------------------------------------------


async def test_a_username_and_password_authenticate(ws_connect, owner, count_rows):
    async with ws_connect() as ws:
        await ws.send({"username": "alice", "password": PASSWORD})
        assert await ws.recv() == {"ok": True, "user": "alice"}
        await assert_usable(ws)
        assert await count_rows(WsSession, user=owner, auth_method="password") == 1


@pytest.mark.parametrize(
    "credentials",
    [
        {"username": "alice", "password": "wrong"},
        {"username": "nobody", "password": PASSWORD},
        {"username": "alice"},
        {"username": "alice", "password": 5},
    ],
    ids=["wrong-password", "unknown-user", "no-password", "password-not-string"],
)
async def test_it_refuses_bad_credentials_with_one_answer(ws_connect, owner, count_rows, credentials):
    async with ws_connect() as ws:
        await ws.send(credentials)
        assert await ws.recv() == AUTH_FAILED
        assert await ws.closed_with() == 4401
    assert await count_rows(WsSession) == 0


async def test_it_refuses_an_inactive_user(ws_connect, owner):
    owner.is_active = False
    await database_sync_to_async(owner.save)()
    async with ws_connect() as ws:
        await ws.send({"username": "alice", "password": PASSWORD})
        assert await ws.recv() == AUTH_FAILED
        assert await ws.closed_with() == 4401


async def test_it_throttles_passwords_after_five_failures_for_a_username(ws_connect, owner, member):
    for _ in range(5):
        async with ws_connect() as ws:
            await ws.send({"username": "alice", "password": "wrong"})
            assert await ws.recv() == AUTH_FAILED
            assert await ws.closed_with() == 4401
    async with ws_connect() as ws:
        await ws.send({"username": "alice", "password": PASSWORD})
        assert await ws.recv() == TOO_MANY
        assert await ws.closed_with() == 4401
    # The username is throttled case-insensitively, other users are not.
    async with ws_connect() as ws:
        await ws.send({"username": "ALICE", "password": PASSWORD})
        assert await ws.recv() == TOO_MANY
    async with ws_connect() as ws:
        await ws.send({"username": "bob", "password": PASSWORD})
        assert await ws.recv() == {"ok": True, "user": "bob"}


# --- frames before authentication ------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    ['{"action": "ping", "nonce": 1}', "not json", "[]", '"token"', "null", '{"tok": "x"}', " "],
    ids=["an-action", "invalid-json", "array", "string", "null", "other-object", "blank"],
)
async def test_it_closes_on_any_other_first_frame(ws_connect, owner, count_rows, frame):
    async with ws_connect() as ws:
        await ws.send(frame)
        assert await ws.recv() == NOT_AUTHENTICATED
        assert await ws.closed_with() == 4401
    assert await count_rows(WsSession) == 0


async def test_it_closes_on_a_binary_first_frame(ws_connect, owner):
    async with ws_connect() as ws:
        await ws.communicator.send_to(bytes_data=b'{"username": "alice", "password": "correct horse battery"}')
        assert await ws.recv() == NOT_AUTHENTICATED
        assert await ws.closed_with() == 4401


async def test_it_closes_a_socket_that_does_not_authenticate_in_time(ws_connect, settings):
    settings.WS_AUTH_TIMEOUT = 0.3
    async with ws_connect() as ws:
        assert await ws.recv(timeout=3) == {"error": "authentication timed out"}
        assert await ws.closed_with() == 4408


async def test_an_authenticated_socket_is_not_closed_by_the_auth_timeout(ws_connect, owner_token, settings):
    settings.WS_AUTH_TIMEOUT = 0.2
    async with ws_connect() as ws:
        await ws.send({"token": owner_token})
        assert (await ws.recv())["ok"] is True
        assert await ws.nothing_received(0.5)
        await assert_usable(ws)


async def test_a_second_auth_frame_is_just_an_unknown_frame(ws_connect, owner_token):
    async with ws_connect() as ws:
        await ws.send({"token": owner_token})
        assert (await ws.recv())["ok"] is True
        await ws.send({"token": owner_token})
        assert await ws.recv() == {"error": "missing 'action' (a non-empty string)"}
        await assert_usable(ws)


# --- session cookie --------------------------------------------------------------------


async def session_cookie(user) -> bytes:
    client = Client()
    await database_sync_to_async(client.force_login)(user)
    name = django_settings.SESSION_COOKIE_NAME
    return f"{name}={client.cookies[name].value}".encode()


async def test_a_session_cookie_with_an_allowed_origin_authenticates_without_auth_frame(ws_connect, owner, count_rows):
    cookie = await session_cookie(owner)
    async with ws_connect(headers=[(b"cookie", cookie), (b"origin", b"http://127.0.0.1:8000")]) as ws:
        await ws.send({"action": "ping", "nonce": 1})
        assert await ws.recv() == {"pong": True, "nonce": 1}
        assert await count_rows(WsSession, user=owner, auth_method="cookie") == 1


@pytest.mark.parametrize(
    "origin",
    [b"http://evil.example", b"http://127.0.0.1.evil.example", b"null", b"", None],
    ids=["foreign", "suffix-trick", "null", "empty", "absent"],
)
async def test_it_refuses_a_session_cookie_without_an_allowed_origin(ws_connect, owner, count_rows, origin):
    headers = [(b"cookie", await session_cookie(owner))]
    if origin is not None:
        headers.append((b"origin", origin))
    async with ws_connect(headers=headers) as ws:
        refusal = await ws.recv()
        assert "action" not in refusal and refusal["error"]
        assert await ws.closed_with() == 4403
    assert await count_rows(WsSession) == 0


async def test_a_header_token_wins_over_a_session_cookie(ws_connect, owner, member_token, count_rows):
    cookie = await session_cookie(owner)
    async with ws_connect(token=member_token, headers=[(b"cookie", cookie)]) as ws:
        await assert_usable(ws)
        assert await count_rows(WsSession, user__username="bob", auth_method="header") == 1
        assert await count_rows(WsSession, user__username="alice") == 0
