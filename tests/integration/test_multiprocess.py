"""Two ``manage.py serve`` processes sharing PostgreSQL and Redis
(docs/deployment.md#what-runs-where): a remote served by one process is listed, called and
disconnected from the other; a process that stops or crashes leaves no ghost remote, and its
callers fail within seconds.

The instance runs with ``DISPATCH_PROCESS_TTL=3``, heartbeats, reaping and liveness checks
every 0.5 s, and a remote-call timeout of 10 s (``tests.infra.base_env``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from examples.weather_service import get_forecast
from remotes.client import Remote
from tests.infra import Instance, Server, eventually, instance, wait_until
from tests.live_clients import LiveSession

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(60),
]

DISCONNECTED = "remote 'weather-service' disconnected"


@dataclass
class Pair:
    """Servers ``a`` and ``b`` of one instance, and an API token of ``admin``."""

    instance: Instance
    a: Server
    b: Server
    token: str


@contextlib.contextmanager
def two_servers() -> Iterator[Pair]:
    with instance(postgres=True, redis=True) as inst:
        a, b = inst.serve(wait=False), inst.serve(wait=False)  # both start at once
        yield Pair(instance=inst, a=a.wait_healthy(), b=b.wait_healthy(), token=inst.admin_token)


@pytest.fixture(scope="module")
def shared_pair() -> Iterator[Pair]:
    with two_servers() as pair:
        yield pair


@pytest.fixture
def pair(shared_pair: Pair) -> Iterator[Pair]:
    """Two live servers shared by the tests that stop neither; each test leaves no remote behind."""
    yield shared_pair
    for server in (shared_pair.a, shared_pair.b):
        assert server.running, server.log()
    wait_until(
        lambda: shared_pair.b.remote_names(shared_pair.token) == [],
        timeout=5,
        what="the remotes of closed sessions to disconnect",
    )


@pytest.fixture
def fresh_pair() -> Iterator[Pair]:
    """Two servers of a new instance, for a test that stops or kills one of them."""
    with two_servers() as pair:
        yield pair


def connect_body(tools: list[dict[str, Any]], remotename: str = "weather-service") -> dict[str, Any]:
    return {"remotename": remotename, "tools": tools}


def call_body(city: str, remotename: str = "weather-service") -> dict[str, Any]:
    return {"remotename": remotename, "function": "get_forecast", "args": {"city": city}}


async def remote_list(session: LiveSession) -> list[str]:
    """The remote names in a ``remote-list`` reply on ``session``."""
    reply = await session.request("remote-list")
    return sorted({entry["remotename"] for entry in reply["remotes"]})


async def no_remotes(session: LiveSession) -> bool:
    return await remote_list(session) == []


async def test_a_remote_served_on_one_process_is_listed_and_called_from_the_other(
    pair: Pair, weather_tools: list[dict[str, Any]]
) -> None:
    async with (
        LiveSession.open(pair.a.ws_url, pair.token) as serving,
        LiveSession.open(pair.b.ws_url, pair.token) as caller,
    ):
        assert (await serving.request("remote-connect", connect_body(weather_tools)))["message"] == "remote connected"

        listed = await caller.request("remote-list")
        assert listed["remotes"] == [{"remotename": "weather-service", **weather_tools[0]}]

        nonce = await caller.send_request("remote-call", call_body("Rome"))
        call = await serving.next_event()  # the downstream event crossed Redis to A's socket
        assert call["requestId"].startswith("weather-service#")
        assert call == {
            "action": "remote-call",
            "requestId": call["requestId"],
            "remotename": "weather-service",
            "function": "get_forecast",
            "args": {"city": "Rome"},
        }
        await serving.send(
            {"action": "remote-call-result", "requestId": call["requestId"], "result": get_forecast("Rome")}
        )
        assert await caller.reply(nonce) == {"result": get_forecast("Rome"), "nonce": nonce}


async def test_a_remote_disconnect_from_the_other_process_fails_a_pending_call_at_once(
    pair: Pair, weather_tools: list[dict[str, Any]]
) -> None:
    name = "forecast-to-disconnect"  # its own name: the shared servers have served others
    async with contextlib.AsyncExitStack() as sessions:
        serving = await sessions.enter_async_context(LiveSession.open(pair.a.ws_url, pair.token))
        caller = await sessions.enter_async_context(LiveSession.open(pair.b.ws_url, pair.token))
        other = await sessions.enter_async_context(LiveSession.open(pair.b.ws_url, pair.token))
        await serving.request("remote-connect", connect_body(weather_tools, name))
        nonce = await caller.send_request("remote-call", call_body("Rome", name))
        pending = await serving.next_event()  # never answered

        assert await other.request("remote-disconnect", {"remotename": name}) == {
            "message": "remote disconnected",
            "remotename": name,
            "nonce": 1,
        }
        # At once: well inside the 10 s call timeout.
        assert await caller.reply(nonce, timeout=3) == {"error": f"remote '{name}' disconnected", "nonce": nonce}
        assert await remote_list(serving) == []
        assert (await caller.request("remote-call", call_body("Rome", name)))["error"] == (
            f"no connected remote named '{name}'"
        )

        # The serving session stays open; a late result for the failed call is ignored.
        await serving.send({"action": "remote-call-result", "requestId": pending["requestId"], "result": 1})
        assert (await serving.request("ping"))["pong"] is True
        assert caller.reply_counts[nonce] == 1


async def test_a_call_right_after_the_remote_reconnects_reaches_its_new_session(
    pair: Pair, weather_tools: list[dict[str, Any]]
) -> None:
    """A client reconnecting after a network drop registers again at once; a caller
    in another process must reach the new session, not the closed one it just called."""
    name = "forecast-reconnecting"
    async with LiveSession.open(pair.b.ws_url, pair.token) as caller:
        async with LiveSession.open(pair.a.ws_url, pair.token) as first:
            await first.request("remote-connect", connect_body(weather_tools, name))
            nonce = await caller.send_request("remote-call", call_body("Rome", name))
            call = await first.next_event()
            await first.send({"action": "remote-call-result", "requestId": call["requestId"], "result": "first"})
            assert await caller.reply(nonce) == {"result": "first", "nonce": nonce}

        async with LiveSession.open(pair.a.ws_url, pair.token) as second:

            async def registered() -> bool:  # retried while the closed session's row remains
                reply = await second.request("remote-connect", connect_body(weather_tools, name))
                return reply.get("message") == "remote connected"

            await eventually(registered, timeout=5, what="the remote to register again")
            nonce = await caller.send_request("remote-call", call_body("Oslo", name))
            delivered = asyncio.ensure_future(second.next_event(timeout=5))
            answered = asyncio.ensure_future(caller.reply(nonce, timeout=5))
            await asyncio.wait({delivered, answered}, return_when=asyncio.FIRST_COMPLETED)
            assert delivered.done(), f"the call never reached the new session; the caller got {await answered}"
            answered.cancel()
            call = delivered.result()
            assert call["args"] == {"city": "Oslo"}
            await second.send({"action": "remote-call-result", "requestId": call["requestId"], "result": "second"})
            assert await caller.reply(nonce) == {"result": "second", "nonce": nonce}


async def test_a_sigkilled_process_fails_the_other_process_s_pending_call_within_seconds(
    fresh_pair: Pair, weather_tools: list[dict[str, Any]]
) -> None:
    pair = fresh_pair
    async with (
        LiveSession.open(pair.a.ws_url, pair.token) as serving,
        LiveSession.open(pair.b.ws_url, pair.token) as caller,
    ):
        await serving.request("remote-connect", connect_body(weather_tools))
        nonce = await caller.send_request("remote-call", call_body("Rome"))
        await serving.next_event()  # pending on A

        await asyncio.to_thread(pair.a.kill)
        killed = time.monotonic()
        # TTL 3 s + liveness checks every 0.5 s: not the 10 s call timeout.
        reply = await caller.reply(nonce, timeout=5)
        failed_after = time.monotonic() - killed
        assert reply == {"error": DISCONNECTED, "nonce": nonce}
        assert failed_after < 5

        # B's reaper removes the dead process's remote; the caller's session is unharmed.
        await eventually(
            lambda: no_remotes(caller),
            timeout=8,
            interval=0.2,
            what="the killed process's remote to be reaped",
            details=pair.b.log,
        )
        assert (await caller.request("ping"))["pong"] is True
    assert pair.b.running


async def test_a_sigterm_removes_the_process_s_remotes_at_once(
    fresh_pair: Pair, weather_tools: list[dict[str, Any]]
) -> None:
    pair = fresh_pair
    async with (
        LiveSession.open(pair.a.ws_url, pair.token) as serving,
        LiveSession.open(pair.b.ws_url, pair.token) as caller,
    ):
        await serving.request("remote-connect", connect_body(weather_tools))
        assert await remote_list(caller) == ["weather-service"]
        nonce = await caller.send_request("remote-call", call_body("Rome"))
        await serving.next_event()  # pending on A

        exit_code = await asyncio.to_thread(pair.a.stop)
        assert exit_code == 0, pair.a.log()
        code = await serving.closed(timeout=1)
        assert code in (1001, 1012), f"closed with {code}; A's log:\n{pair.a.log()[-4000:]}"
        assert await caller.reply(nonce, timeout=1) == {"error": DISCONNECTED, "nonce": nonce}
        # A clean shutdown deletes its rows: no wait for the 3 s TTL and the reaper.
        await eventually(lambda: no_remotes(caller), timeout=1, what="A's remote to disappear", details=pair.a.log)


async def test_a_process_reaped_while_frozen_closes_its_sockets_when_it_wakes(
    fresh_pair: Pair, weather_tools: list[dict[str, Any]]
) -> None:
    """Presence (docs/deployment.md#what-runs-where): a reaped process's sockets are closed so
    that its clients reconnect and register again."""
    pair = fresh_pair
    async with (
        LiveSession.open(pair.a.ws_url, pair.token) as serving,
        LiveSession.open(pair.b.ws_url, pair.token) as caller,
    ):
        await serving.request("remote-connect", connect_body(weather_tools))
        nonce = await caller.send_request("remote-call", call_body("Rome"))
        await serving.next_event()  # pending on A

        pair.a.proc.send_signal(signal.SIGSTOP)
        try:
            assert await caller.reply(nonce, timeout=5) == {"error": DISCONNECTED, "nonce": nonce}
            await eventually(
                lambda: no_remotes(caller), timeout=8, interval=0.2, what="the frozen process to be reaped"
            )
        finally:
            pair.a.proc.send_signal(signal.SIGCONT)
        # Its next heartbeat finds its row gone: every socket it holds is closed.
        assert await serving.closed(timeout=5) == 1012

    async with LiveSession.open(pair.a.ws_url, pair.token) as serving:  # A serves on, registered again
        reply = await serving.request("remote-connect", connect_body(weather_tools))
        assert reply["message"] == "remote connected"
        async with LiveSession.open(pair.b.ws_url, pair.token) as caller:
            nonce = await caller.send_request("remote-call", call_body("Oslo"))
            call = await serving.next_event()
            await serving.send({"action": "remote-call-result", "requestId": call["requestId"], "result": "ok"})
            assert await caller.reply(nonce) == {"result": "ok", "nonce": nonce}


class Relay:
    """A TCP relay standing in for a load balancer: each new connection goes to ``target``."""

    def __init__(self, target: Server) -> None:
        self.target = target
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Relay]:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            server.close()
            for writer in self._writers:  # connections still relayed
                writer.close()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target.port)
        except OSError:
            client_writer.close()
            return
        self._writers |= {client_writer, server_writer}
        try:
            await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer))
        finally:
            self._writers -= {client_writer, server_writer}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def test_the_client_library_re_registers_on_the_other_process_after_a_crash(fresh_pair: Pair) -> None:
    pair = fresh_pair
    async with Relay(pair.a).running() as relay, LiveSession.open(pair.b.ws_url, pair.token) as caller:
        remote = Remote("weather-service", url=relay.ws_url, token=pair.token, functions=[get_forecast])
        serving = asyncio.create_task(remote.serve())
        try:

            async def forecast() -> Any:
                assert not serving.done(), serving
                reply = await caller.request("remote-call", call_body("Rome"))
                if "error" in reply:  # not registered yet, or still registered on the dead A
                    assert reply["error"] in ("no connected remote named 'weather-service'", DISCONNECTED), reply
                return reply.get("result")

            assert await eventually(forecast, timeout=10, interval=0.2, what="the remote on A") == get_forecast("Rome")

            relay.target = pair.b  # the balancer sends new connections to B from now on
            await asyncio.to_thread(pair.a.kill)
            # The client reconnects through the relay, retries while A's rows await the
            # reaper, and registers on B.
            answer = await eventually(
                forecast, timeout=20, interval=0.2, what="the remote to re-register on B", details=pair.b.log
            )
            assert answer == get_forecast("Rome")
        finally:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving


async def test_hundreds_of_calls_across_processes_through_tiny_redis_pools_all_complete() -> None:
    # redis-py 8's plain pool raised "Too many connections" past its cap and the call was
    # lost; Dispatch's pool waits for a free connection (core/channel_layer.py). Both
    # processes get 3 connections for 240 calls in flight across Redis.
    with instance(postgres=True, redis=True) as inst:
        a = inst.serve(wait=False, DISPATCH_REDIS_MAX_CONNECTIONS=3)
        b = inst.serve(wait=False, DISPATCH_REDIS_MAX_CONNECTIONS=3)
        a, b = a.wait_healthy(), b.wait_healthy()
        remote = Remote("weather-service", url=a.ws_url, token=inst.admin_token, functions=[get_forecast])
        serving = asyncio.create_task(remote.serve())
        try:
            async with contextlib.AsyncExitStack() as stack:
                callers = [
                    await stack.enter_async_context(LiveSession.open(b.ws_url, inst.admin_token)) for _ in range(4)
                ]

                async def registered() -> bool:
                    return await remote_list(callers[0]) == ["weather-service"]

                await eventually(registered, timeout=10, interval=0.2, what="the remote on A")
                cities = [f"City{n}" for n in range(60)]
                sent = [
                    (caller, city, await caller.send_request("remote-call", call_body(city)))
                    for caller in callers
                    for city in cities
                ]
                replies = await asyncio.gather(*(caller.reply(nonce, timeout=30) for caller, _, nonce in sent))
                assert [reply.get("result") for reply in replies] == [get_forecast(city) for _, city, _ in sent]
                assert all(count == 1 for caller in callers for count in caller.reply_counts.values())
            for server in (a, b):
                assert server.running, server.log()
                assert "Too many connections" not in server.log()
        finally:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
