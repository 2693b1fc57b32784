"""Behind a proxy (docs/operating.md#behind-a-proxy): ``DISPATCH_BEHIND_PROXY`` and
unbuffered event streams.

- the setting: off, ``serve`` ignores ``X-Forwarded-For`` (every client behind a proxy is
  the proxy) and Django ignores ``X-Forwarded-Proto``; on, the password throttle counts the
  forwarded address (a real ``serve`` over a real socket) and a websocket upgrade forwarded
  as HTTPS passes the origin check;
- every server-sent-event route, driven through the real ASGI application, answers
  ``X-Accel-Buffering: no`` exactly once, and ``dispatch.sse`` is the one place that says
  it (a new event-stream producer must be listed here).

Through a real nginx: tests/integration/test_cluster_proxy.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.test import override_settings

from core.authentication import websocket_origin_allowed
from core.tools import Tool
from dispatch.management.commands.serve import proxy_header_options
from dispatch.sse import unbuffered_event_streams
from tests.infra import Instance, Server, instance

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGES = ["core", "agents", "remotes", "machines", "peers", "dispatch"]


# --- the setting ----------------------------------------------------------------------------------


def test_serve_reads_the_forwarded_address_and_scheme_only_when_behind_a_proxy() -> None:
    assert proxy_header_options(False) == {
        "proxy_forwarded_address_header": None,
        "proxy_forwarded_port_header": None,
        "proxy_forwarded_proto_header": None,
    }
    assert proxy_header_options(True) == {
        "proxy_forwarded_address_header": "X-Forwarded-For",
        "proxy_forwarded_port_header": None,
        "proxy_forwarded_proto_header": "X-Forwarded-Proto",
    }


@pytest.fixture(scope="module")
def proxied() -> Iterator[Instance]:
    with instance() as inst:
        yield inst


def _settings_of(inst: Instance, **env: str) -> dict[str, Any]:
    code = (
        "import json; from django.conf import settings; "
        "print(json.dumps([settings.BEHIND_PROXY, settings.SECURE_PROXY_SSL_HEADER]))"
    )
    done = Instance(env={**inst.env, **env}).manage("shell", "-c", code)
    behind, header = json.loads(done.stdout.strip().splitlines()[-1])
    return {"behind": behind, "header": header}


@pytest.mark.integration
def test_the_setting_turns_on_djangos_forwarded_https_header(proxied: Instance) -> None:
    assert _settings_of(proxied) == {"behind": False, "header": None}
    assert _settings_of(proxied, DISPATCH_BEHIND_PROXY="1") == {
        "behind": True,
        "header": ["HTTP_X_FORWARDED_PROTO", "https"],
    }
    refused = Instance(env={**proxied.env, "DISPATCH_BEHIND_PROXY": "maybe"}).manage("check", check=False)
    assert refused.returncode != 0 and "DISPATCH_BEHIND_PROXY must be a boolean" in refused.stderr


def _token_attempt(server: Server, username: str, password: str, forwarded_for: str | None) -> int:
    headers = {"X-Forwarded-For": forwarded_for} if forwarded_for else {}
    answer = httpx.post(
        f"{server.url}/api/v1/auth/token",
        json={"username": username, "password": password, "name": "t"},
        headers=headers,
        timeout=10,
    )
    return answer.status_code


def _lock_out(server: Server, forwarded_for: str) -> None:
    """Five bad passwords from ``forwarded_for``, each for another unknown user (so only the
    per-address count reaches the limit, never a per-username one)."""
    for _ in range(5):
        assert _token_attempt(server, f"nobody-{uuid.uuid4().hex[:8]}", "wrong", forwarded_for) == 401


@pytest.mark.integration
def test_behind_a_proxy_the_throttle_counts_each_forwarded_address_apart(proxied: Instance) -> None:
    server = proxied.serve(DISPATCH_BEHIND_PROXY="1")
    try:
        _lock_out(server, "10.1.1.1")
        assert _token_attempt(server, "admin", proxied.admin_password, "10.1.1.1") == 429
        assert _token_attempt(server, "admin", proxied.admin_password, "10.2.2.2") == 201
        # The proxy forwards "client, proxy…": daphne takes the first entry.
        assert _token_attempt(server, "admin", proxied.admin_password, "10.1.1.1, 10.2.2.2") == 429
        assert _token_attempt(server, "admin", proxied.admin_password, None) == 201  # the TCP peer, 127.0.0.1
    finally:
        server.stop()


@pytest.mark.integration
def test_without_the_setting_a_forwarded_address_is_ignored(proxied: Instance) -> None:
    server = proxied.serve()
    try:
        _lock_out(server, "10.3.3.3")
        # Every attempt came from 127.0.0.1, whatever the header said.
        assert _token_attempt(server, "admin", proxied.admin_password, "10.4.4.4") == 429
        assert _token_attempt(server, "admin", proxied.admin_password, None) == 429
    finally:
        server.stop()


def _upgrade_scope(*, origin: str, host: str, proto: str | None) -> dict[str, Any]:
    headers = [(b"host", host.encode()), (b"origin", origin.encode())]
    if proto is not None:
        headers.append((b"x-forwarded-proto", proto.encode()))
    # daphne puts no scheme in a websocket scope (ASGI's default: ws), even behind a proxy.
    return {"type": "websocket", "headers": headers, "server": ("127.0.0.1", 8000), "client": ("10.0.0.5", 0)}


@override_settings(ALLOWED_HOSTS=["dispatch.test"], CSRF_TRUSTED_ORIGINS=[])
def test_a_websocket_forwarded_as_https_passes_the_origin_check_only_behind_a_proxy() -> None:
    scope = _upgrade_scope(origin="https://dispatch.test:8443", host="dispatch.test:8443", proto="https")
    assert not websocket_origin_allowed(scope)  # off: the upgrade looks like plain http
    with override_settings(SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https")):
        assert websocket_origin_allowed(scope)
        # The scheme still has to match: a page on http is not the https site's origin.
        plain = _upgrade_scope(origin="http://dispatch.test:8443", host="dispatch.test:8443", proto="https")
        assert not websocket_origin_allowed(plain)
        other_port = _upgrade_scope(origin="https://dispatch.test:9443", host="dispatch.test:8443", proto="https")
        assert not websocket_origin_allowed(other_port)


# --- X-Accel-Buffering: no ------------------------------------------------------------------------


async def _run(app: Any, scope: dict[str, Any], body: bytes = b"") -> dict[str, Any]:
    """Drive ``app`` with one request until its ``http.response.start``; then the client
    goes away. Returns that message (status and headers)."""
    gone = asyncio.Event()
    started: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and not started.done():
            started.set_result(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        async with asyncio.timeout(10):
            await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
            if not started.done():
                task.result()  # raises what the app raised
                raise AssertionError("the application ended without a response")
    finally:
        gone.set()
        try:
            async with asyncio.timeout(5):
                await asyncio.gather(task, return_exceptions=True)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return started.result()


def _http_scope(method: str, path: str, headers: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000")] + [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


def _values(message: dict[str, Any], name: bytes) -> list[bytes]:
    return [value for key, value in message["headers"] if key.lower() == name]


async def test_the_wrapper_adds_the_header_to_event_streams_only() -> None:
    def answering(headers: list[tuple[bytes, bytes]]) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        return app

    scope = _http_scope("GET", "/x", {})
    for content_type in (b"text/event-stream", b"Text/Event-Stream; charset=utf-8"):
        started = await _run(unbuffered_event_streams(answering([(b"Content-Type", content_type)])), scope)
        assert _values(started, b"x-accel-buffering") == [b"no"]
    # One that says it already (the MCP SDK's) is not given a second one.
    said = [(b"content-type", b"text/event-stream"), (b"X-Accel-Buffering", b"no")]
    assert _values(await _run(unbuffered_event_streams(answering(said)), scope), b"x-accel-buffering") == [b"no"]
    for other in ([(b"content-type", b"application/json")], [(b"content-type", b"text/event-streams")], []):
        assert _values(await _run(unbuffered_event_streams(answering(other)), scope), b"x-accel-buffering") == []


def test_the_application_wraps_every_http_route() -> None:
    from dispatch import asgi

    http = asgi.application.application_mapping["http"]
    assert http.__qualname__ == unbuffered_event_streams(http).__qualname__  # the wrapper is outermost


@pytest.fixture
def owner_id(owner: Any) -> int:
    return int(owner.pk)


async def _hold() -> None:
    await asyncio.Event().wait()


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The services behind the machine and peer streams replaced (their own tests cover
    them): each stream starts, then holds until the client goes."""
    from dispatch.mcp import server as mcp_server
    from machines import api as machines_api
    from machines.services import live
    from peers import stream as peers_stream

    async def operation_stream(**kwargs: Any) -> AsyncIterator[Any]:
        yield live.Started(request_id=kwargs.get("request_id") or str(uuid.uuid4()), machine_id="m1", name="box")
        await _hold()

    async def copy(**kwargs: Any) -> dict[str, Any]:
        await kwargs["on_progress"](0, 10)
        await _hold()
        return {}

    async def peer_authenticate(request: Any) -> Any:
        return object()

    async def peer_events_open(peer: Any) -> AsyncIterator[str]:
        async def frames() -> AsyncIterator[str]:
            yield "event: snapshot\ndata: {}\n\n"
            await _hold()

        return frames()

    async def run(arguments: dict[str, Any]) -> Any:
        return {"ok": True}

    async def tools_for(**kwargs: Any) -> dict[str, Tool]:
        return {"quick": Tool(name="quick", description="answers", parameters={"type": "object"}, handler=run)}

    monkeypatch.setattr(live, "operation_stream", operation_stream)
    monkeypatch.setattr(machines_api, "copy_between_machines", copy)
    monkeypatch.setattr(peers_stream, "peer_authenticate", peer_authenticate)
    monkeypatch.setattr(peers_stream, "peer_events_open", peer_events_open)
    monkeypatch.setattr(mcp_server, "tools_for", tools_for)


SSE_ACCEPT = "application/json, text/event-stream"
TOOL_CALL = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "quick", "arguments": {}}}
COPY = {"source_machine": "a", "source_path": "/x", "destination_machine": "b", "destination_path": "/y"}

# Every server-sent-event route: (method, path, extra headers, JSON body, the module that
# answers it). A new one belongs here (test_every_event_stream_producer_is_listed).
SSE_ROUTES: list[tuple[str, str, dict[str, str], Any, str]] = [
    ("GET", "/api/v1/events", {}, None, "agents/stream.py"),
    ("GET", "/api/v1/peers/events", {}, None, "peers/stream.py"),
    ("GET", "/mcp", {"accept": "text/event-stream"}, None, "dispatch/mcp/events.py"),
    (
        "POST",
        "/api/v1/sessions/s1/ops",
        {},
        {"op": "EXECUTE_COMMAND", "payload": {"argv": ["true"]}, "stream": True},
        "machines/api.py",
    ),
    ("POST", "/api/v1/sessions/s1/copy", {}, {**COPY, "stream": True}, "machines/api.py"),
    ("POST", "/mcp", {"accept": SSE_ACCEPT, "mcp-protocol-version": "2025-11-25"}, TOOL_CALL, "dispatch/mcp/app.py"),
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("method", "path", "headers", "body", "module"), SSE_ROUTES, ids=lambda v: str(v)[:30])
async def test_every_event_stream_route_answers_unbuffered(
    method: str, path: str, headers: dict[str, str], body: Any, module: str, owner_token: str, fakes: None
) -> None:
    from dispatch import asgi
    from dispatch.mcp import app as mcp_app

    headers = {"authorization": f"Bearer {owner_token}", **headers}
    raw = b""
    if body is not None:
        raw = json.dumps(body).encode()
        headers = {"content-type": "application/json", "content-length": str(len(raw)), **headers}
    try:
        started = await _run(asgi.application, _http_scope(method, path, headers), raw)
    finally:
        await mcp_app.shutdown()
    assert started["status"] == 200, started
    [content_type] = _values(started, b"content-type")
    assert content_type.startswith(b"text/event-stream"), content_type
    assert _values(started, b"x-accel-buffering") == [b"no"]


def _server_sources() -> Iterator[tuple[str, str]]:
    for package in SERVER_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "/migrations/" in relative or relative.startswith(("machines/shim/", "remotes/client/")):
                continue
            yield relative, path.read_text()


def test_every_event_stream_producer_is_listed() -> None:
    """A module building a streamed or ``text/event-stream`` response answers a route in
    ``SSE_ROUTES`` (so the test above checks it); ``X-Accel-Buffering`` is said only by
    ``dispatch.sse``."""
    producing = re.compile(r"StreamingHttpResponse\(|b\"text/event-stream|json_response=False")
    producers = {relative for relative, text in _server_sources() if producing.search(text)} - {"dispatch/sse.py"}
    assert producers <= {module for *_, module in SSE_ROUTES}, producers
    saying = {relative for relative, text in _server_sources() if "x-accel-buffering" in text.lower()}
    assert saying == {"dispatch/sse.py"}
