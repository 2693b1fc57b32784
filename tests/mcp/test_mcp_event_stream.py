"""``GET /mcp``, the event stream of MCP 2025-11-25 (docs/mcp.md#tool-list-changes), read
with raw httpx against a real ``manage.py serve``: its shape (``retry``, no ids, one
``list_changed`` on every connect), the push of a remote connecting, its refusals (406, 401,
the 65th stream 429), its end on revocation, deactivation and SIGTERM; and across two
processes on PostgreSQL + Redis.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.infra import Instance, Server, instance
from tests.live_clients import LiveSession
from tests.mcp.test_mcp_endpoint import mcp_client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LIST_CHANGED = {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}
STREAM_HEADERS = {"Accept": "text/event-stream"}
WEATHER_FUNCTIONS = [
    {
        "name": "get_forecast",
        "description": "forecast",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]

_SETUP = """
import json
from django.contrib.auth import get_user_model
from core.services import api_token_create
User = get_user_model()
tokens = {}
for name in ("bob", "carol", "dave", "erin", "frank"):
    user = User.objects.create_user(name)  # no password: hashing one costs a second
    tokens[name] = api_token_create(user=user).raw
    tokens[name + "_2"] = api_token_create(user=user, name="second").raw
print(json.dumps(tokens))
"""


@dataclass
class Event:
    """One server-sent event: its fields (``retry``, ``event``, ``data``, ``id``) or a comment."""

    fields: dict[str, str] = field(default_factory=dict)
    comment: str | None = None
    at: float = 0.0

    @property
    def message(self) -> Any:
        return json.loads(self.fields["data"]) if "data" in self.fields else None


class EventStream:
    """A raw ``GET /mcp`` stream being read: events in ``queue`` as they come, ``ended`` when it ends."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.seen: list[Event] = []
        self.ended_at: float | None = None
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        current = Event()
        try:
            async for line in self.response.aiter_lines():
                if line == "":
                    if current.fields or current.comment is not None:
                        current.at = time.monotonic()
                        self.seen.append(current)
                        self.events.put_nowait(current)
                    current = Event()
                elif line.startswith(":"):
                    current.comment = line[1:].strip()
                else:
                    name, _, value = line.partition(":")
                    current.fields[name] = value.removeprefix(" ")
        except httpx.HTTPError:
            pass
        finally:
            self.ended_at = time.monotonic()

    async def next_message(self, timeout: float = 10) -> Event:
        """The next event carrying data (comments and ``retry`` skipped)."""
        async with asyncio.timeout(timeout):
            while True:
                event = await self.events.get()
                if "data" in event.fields:
                    return event

    async def ended(self, timeout: float) -> float:
        """Wait until the stream ends; returns ``time.monotonic()`` of its end."""
        async with asyncio.timeout(timeout):
            await asyncio.shield(self.reader)
        assert self.ended_at is not None
        return self.ended_at


@asynccontextmanager
async def opened(server: Server, token: str) -> AsyncIterator[EventStream]:
    """An open ``GET /mcp`` stream of ``token`` on ``server`` (asserting 200)."""
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(10, read=None)) as http,
        http.stream("GET", f"{server.url}/mcp", headers={**STREAM_HEADERS, **bearer(token)}) as response,
    ):
        assert response.status_code == 200, (await response.aread()).decode()
        stream = EventStream(response)
        try:
            yield stream
        finally:
            stream.reader.cancel()


async def open_status(server: Server, token: str) -> tuple[int, str]:
    """The status (and body, unless 200) of a ``GET /mcp`` stream, closed at once."""
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(10, read=None)) as http,
        http.stream("GET", f"{server.url}/mcp", headers={**STREAM_HEADERS, **bearer(token)}) as response,
    ):
        return response.status_code, "" if response.status_code == 200 else (await response.aread()).decode()


async def revoke(server: Server, token: str, *, using: str) -> None:
    """Revoke ``token`` with ``DELETE /api/v1/auth/tokens/{id}``, as its user (with ``using``)."""
    async with httpx.AsyncClient(base_url=server.url, headers=bearer(using), timeout=10) as http:
        listed = (await http.get("/api/v1/auth/tokens")).json()["tokens"]
        [token_id] = [entry["id"] for entry in listed if token.startswith(entry["prefix"])]
        assert (await http.delete(f"/api/v1/auth/tokens/{token_id}")).status_code in (200, 204)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Live:
    instance: Instance
    server: Server
    tokens: dict[str, str]


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with instance() as inst:
        tokens = json.loads(inst.manage("shell", "-c", _SETUP).stdout.strip().splitlines()[-1])
        yield Live(instance=inst, server=inst.serve(), tokens=tokens)


async def connect_remote(session: LiveSession, name: str) -> None:
    reply = await session.request("remote-connect", {"remotename": name, "functions": WEATHER_FUNCTIONS})
    assert "error" not in reply, reply


async def test_it_opens_with_retry_and_one_list_changed_and_pushes_one_more_when_a_remote_connects(
    live: Live,
) -> None:
    async with opened(live.server, live.tokens["bob"]) as stream:
        headers = stream.response.headers
        assert headers["content-type"].startswith("text/event-stream")
        assert headers["cache-control"] == "no-cache"
        assert headers["x-accel-buffering"] == "no"
        first = await stream.events.get()
        assert first.fields == {"retry": "1000"}
        on_connect = await stream.next_message()
        assert on_connect.message == LIST_CHANGED and on_connect.fields.get("event", "message") == "message"
        await asyncio.sleep(0.5)
        assert stream.events.empty()  # exactly one on connect

        async with LiveSession.open(live.server.ws_url, live.tokens["bob"]) as remote:
            connected_at = time.monotonic()
            await connect_remote(remote, "pushed")
            pushed = await stream.next_message(timeout=5)
            delay = pushed.at - connected_at
            print(f"list_changed {delay * 1000:.0f} ms after the remote-connect was sent")
            assert pushed.message == LIST_CHANGED and delay < 5
            await asyncio.sleep(0.5)
            assert [event.message for event in stream.seen if "data" in event.fields] == [LIST_CHANGED] * 2
        assert all("id" not in event.fields for event in stream.seen)  # nothing to resume

    # A reconnect is told again, whatever it missed.
    async with opened(live.server, live.tokens["bob"]) as again:
        assert (await again.next_message()).message == LIST_CHANGED


async def test_it_refuses_a_stream_without_the_accept_header_or_a_valid_token(live: Live) -> None:
    url = f"{live.server.url}/mcp"
    async with httpx.AsyncClient(timeout=10) as http:
        plain = await http.get(url, headers={"Accept": "application/json", **bearer(live.tokens["bob"])})
        assert plain.status_code == 406
        assert "text/event-stream" in plain.json()["error"]["message"]
        nobody = await http.get(url, headers=STREAM_HEADERS)
        assert nobody.status_code == 401 and nobody.headers["www-authenticate"] == "Bearer"
        assert nobody.json()["error"]["code"] == "NOT_AUTHENTICATED"
        forged = await http.get(url, headers={**STREAM_HEADERS, **bearer("x" * 43)})
        assert forged.status_code == 401 and forged.json()["error"]["code"] == "AUTHENTICATION_FAILED"
        assert forged.headers["www-authenticate"] == 'Bearer error="invalid_token"'  # RFC 6750 §3.1


async def test_the_65th_open_stream_of_a_user_is_refused_429_and_a_closed_one_frees_its_slot(live: Live) -> None:
    token = live.tokens["carol"]
    async with AsyncExitStack() as streams:
        opened_streams = await asyncio.gather(
            *(streams.enter_async_context(opened(live.server, token)) for _ in range(64))
        )
        async with httpx.AsyncClient(timeout=10) as http:
            refused = await http.get(f"{live.server.url}/mcp", headers={**STREAM_HEADERS, **bearer(token)})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "RATE_LIMITED"
            assert "64" in refused.json()["error"]["message"]
        # Another user is not limited by carol's streams.
        async with opened(live.server, live.tokens["bob"]) as bobs:
            assert (await bobs.next_message()).message == LIST_CHANGED
        assert len(opened_streams) == 64
    # All 64 closed: their rows are gone, so 64 more open.
    async with AsyncExitStack() as streams:
        await asyncio.gather(*(streams.enter_async_context(opened(live.server, token)) for _ in range(64)))


async def test_revoking_the_token_ends_its_stream_within_seconds(live: Live) -> None:
    token, other = live.tokens["dave"], live.tokens["dave_2"]
    async with opened(live.server, token) as stream, opened(live.server, other) as untouched:
        await stream.next_message()
        await revoke(live.server, token, using=other)
        revoked_at = time.monotonic()
        ended = await stream.ended(timeout=5)
        print(f"stream ended {(ended - revoked_at) * 1000:.0f} ms after the revocation")
        assert untouched.ended_at is None  # the user's other token keeps its stream


async def test_revoking_the_token_ends_its_2026_listen_stream_within_seconds(live: Live) -> None:
    token, other = live.tokens["frank"], live.tokens["frank_2"]
    async with mcp_client(f"{live.server.url}/mcp", token, "auto") as client:
        async with client.listen(tools_list_changed=True) as subscription:
            assert subscription.honored.tools_list_changed is True
            await revoke(live.server, token, using=other)
            revoked_at = time.monotonic()
            async with asyncio.timeout(5):
                async for _ in subscription:
                    pass
            print(f"listen stream ended {(time.monotonic() - revoked_at) * 1000:.0f} ms after the revocation")


async def test_deactivating_the_user_ends_their_streams_within_seconds(live: Live) -> None:
    async with opened(live.server, live.tokens["erin"]) as stream:
        await stream.next_message()
        live.instance.manage(
            "shell",
            "-c",
            "from django.contrib.auth import get_user_model; "
            "get_user_model().objects.filter(username='erin').update(is_active=False)",
        )
        deactivated_at = time.monotonic()
        ended = await stream.ended(timeout=5)
        print(f"stream ended {(ended - deactivated_at) * 1000:.0f} ms after the deactivation")


async def test_serves_sigterm_ends_its_streams_at_once(live: Live) -> None:
    doomed = live.instance.serve()
    async with opened(doomed, live.tokens["bob"]) as stream:
        await stream.next_message()
        signalled_at = time.monotonic()
        doomed.terminate()
        ended = await stream.ended(timeout=5)
        print(f"stream ended {(ended - signalled_at) * 1000:.0f} ms after SIGTERM")
        assert ended - signalled_at < 1.0
    assert doomed.stop() == 0


# --- two processes (PostgreSQL + Redis) -----------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.postgres
@pytest.mark.redis
async def test_a_stream_on_one_process_hears_a_remote_connected_on_another_and_the_limit_spans_both() -> None:
    with instance(postgres=True, redis=True) as inst:
        a, b = inst.serve(wait=False), inst.serve(wait=False)
        a, b = a.wait_healthy(), b.wait_healthy()
        token = inst.admin_token
        async with opened(a, token) as stream:
            await stream.next_message()
            async with LiveSession.open(b.ws_url, token) as remote:
                connected_at = time.monotonic()
                await connect_remote(remote, "elsewhere")
                pushed = await stream.next_message(timeout=5)
                print(f"cross-process list_changed {(pushed.at - connected_at) * 1000:.0f} ms after remote-connect")
                assert pushed.message == LIST_CHANGED

            # 1 stream on a + 63 on b is the limit; the 65th is refused on either.
            async with AsyncExitStack() as streams:
                await asyncio.gather(*(streams.enter_async_context(opened(b, token)) for _ in range(63)))
                for server in (a, b):
                    status, body = await open_status(server, token)
                    assert status == 429, body
                b.kill()  # its 63 rows must not count for ever: the reaper takes them with b
                deadline = time.monotonic() + 15
                while (answer := await open_status(a, token))[0] != 200:
                    assert answer[0] == 429 and time.monotonic() < deadline, answer
                    await asyncio.sleep(0.5)
