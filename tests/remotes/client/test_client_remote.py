"""The Remote serving loop against a fake ``/ws`` (docs/ws-protocol.md#the-python-client)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import pydantic
import pytest

from remotes.client import AuthenticationError, Remote, RemoteCallError

if TYPE_CHECKING:
    from conftest import FakeDispatch

Start = Callable[[Remote], "asyncio.Task[NoReturn]"]


class Point(pydantic.BaseModel):
    x: int
    y: int


def weather_remote(dispatch: FakeDispatch, token: str | None = None) -> Remote:
    remote = Remote("weather-service", url=dispatch.url, token=token or dispatch.token)

    @remote.function
    def get_forecast(city: str) -> dict[str, str]:
        """Retrieve weather forecast for a location.

        Args:
            city: The city.
        """
        return {"city": city, "forecast": "sunny"}

    return remote


@pytest.mark.asyncio
async def test_it_registers_its_functions_and_answers_a_call(dispatch: FakeDispatch, start_serving: Start) -> None:
    start_serving(weather_remote(dispatch))

    registration = await dispatch.wait_registered()
    result = await dispatch.call("weather-service", "get_forecast", {"city": "Rome"})

    assert registration["remotename"] == "weather-service"
    [tool] = registration["tools"]
    assert tool["name"] == "get_forecast"
    assert tool["description"] == "Retrieve weather forecast for a location."
    assert tool["parameters"]["properties"]["city"]["description"] == "The city."
    assert result == {
        "action": "remote-call-result",
        "requestId": "weather-service#0",
        "result": {"city": "Rome", "forecast": "sunny"},
    }


def test_the_decorator_returns_the_function_unchanged() -> None:
    remote = Remote("r", url="ws://127.0.0.1:9/ws", token="t")

    def double(n: int) -> int:
        return 2 * n

    assert remote.function(double) is double
    assert [spec["name"] for spec in remote.specs] == ["double"]
    with pytest.raises(ValueError, match="already has a function named 'double'"):
        remote.function(double)


@pytest.mark.asyncio
async def test_it_runs_sync_functions_in_a_thread(dispatch: FakeDispatch, start_serving: Start) -> None:
    signal = threading.Event()

    def wait_for_signal() -> bool:
        return signal.wait(timeout=3)  # on the event loop, this would block `send`

    def send() -> str:
        signal.set()
        return threading.current_thread().name

    remote = Remote(
        "threads",
        url=dispatch.url,
        token=dispatch.token,
        functions=[wait_for_signal, send],
    )
    start_serving(remote)
    await dispatch.wait_registered()

    waited, sent = await asyncio.gather(
        dispatch.call("threads", "wait_for_signal", {}),
        dispatch.call("threads", "send", {}),
    )

    assert waited["result"] is True
    assert sent["result"] != threading.main_thread().name


@pytest.mark.asyncio
async def test_it_answers_fifty_concurrent_calls(dispatch: FakeDispatch, start_serving: Start) -> None:
    everyone_started = asyncio.Barrier(50)  # only passes if all 50 calls run at once
    remote = Remote("busy", url=dispatch.url, token=dispatch.token)

    @remote.function
    async def echo(n: int) -> int:
        async with asyncio.timeout(3):
            await everyone_started.wait()
        return n

    start_serving(remote)
    await dispatch.wait_registered()

    results = await asyncio.gather(*(dispatch.call("busy", "echo", {"n": n}) for n in range(50)))

    assert [result["result"] for result in results] == list(range(50))
    assert len({result["requestId"] for result in results}) == 50


@pytest.mark.asyncio
async def test_failures_become_error_results(dispatch: FakeDispatch, start_serving: Start) -> None:
    remote = Remote("failing", url=dispatch.url, token=dispatch.token)

    @remote.function
    def lookup(city: str) -> str:
        raise ValueError(f"no such city: {city}")

    @remote.function
    def huge() -> str:
        return "x" * (2 * 1024 * 1024)

    start_serving(remote)
    await dispatch.wait_registered()

    raised = await dispatch.call("failing", "lookup", {"city": "Atlantis"})
    unknown = await dispatch.call("failing", "nope", {})
    invalid = await dispatch.call("failing", "lookup", {"town": "Rome"})
    too_large = await dispatch.call("failing", "huge", {})

    assert raised["error"] == "ValueError: no such city: Atlantis"
    assert "result" not in raised
    assert unknown["error"] == "LookupError: remote 'failing' has no function 'nope'"
    assert invalid["error"].startswith("ValidationError: ")
    assert too_large["error"].startswith("MessageTooLarge: ")
    assert "failing" in dispatch.serving  # the connection survived every failure


@pytest.mark.asyncio
async def test_args_are_validated_into_the_annotated_types(dispatch: FakeDispatch, start_serving: Start) -> None:
    remote = Remote("geometry", url=dispatch.url, token=dispatch.token)

    @remote.function
    def norm(point: Point, scale: int = 1) -> int:
        return scale * (abs(point.x) + abs(point.y))

    start_serving(remote)
    await dispatch.wait_registered()

    result = await dispatch.call("geometry", "norm", {"point": {"x": 3, "y": -4}, "scale": 2})

    assert result["result"] == 14


@pytest.mark.asyncio
async def test_it_retries_while_the_server_still_holds_the_name(dispatch: FakeDispatch, start_serving: Start) -> None:
    dispatch.still_connected = 2

    start_serving(weather_remote(dispatch))
    await dispatch.wait_registered()

    assert dispatch.still_connected == 0
    assert dispatch.attempts == 1  # retried on the same connection


@pytest.mark.asyncio
async def test_it_gives_up_when_the_name_stays_taken(dispatch: FakeDispatch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("remotes.client.remote.REGISTER_RETRY_WINDOW", 0.1)
    dispatch.still_connected = 1000

    with pytest.raises(RemoteCallError, match="remote 'weather-service' is already connected"):
        await asyncio.wait_for(weather_remote(dispatch).serve(), 5)


@pytest.mark.asyncio
async def test_a_refused_spec_stops_serving(dispatch: FakeDispatch) -> None:
    dispatch.connect_error = "tools[0].name: invalid function name"

    with pytest.raises(RemoteCallError, match="invalid function name"):
        await asyncio.wait_for(weather_remote(dispatch).serve(), 5)
    assert dispatch.attempts == 1


@pytest.mark.asyncio
async def test_it_reconnects_and_registers_again_after_a_drop(dispatch: FakeDispatch, start_serving: Start) -> None:
    start_serving(weather_remote(dispatch))
    await dispatch.wait_registered()

    dispatch.serving["weather-service"].transport.abort()  # the network goes away
    await dispatch.wait_registered(count=2)
    result = await dispatch.call("weather-service", "get_forecast", {"city": "Oslo"})

    assert dispatch.attempts == 2
    assert result["result"] == {"city": "Oslo", "forecast": "sunny"}


@pytest.mark.asyncio
async def test_it_keeps_trying_while_the_server_is_down(dispatch: FakeDispatch, start_serving: Start) -> None:
    good_url = dispatch.url
    remote = weather_remote(dispatch)
    remote.url = "ws://127.0.0.1:9/ws"  # nothing listens there
    start_serving(remote)
    await asyncio.sleep(0.2)

    remote.url = good_url  # the server "comes back"

    await dispatch.wait_registered()


@pytest.mark.asyncio
@pytest.mark.parametrize("close_code", [4401, 4408])
async def test_a_refused_token_stops_reconnecting(dispatch: FakeDispatch, close_code: int) -> None:
    dispatch.refusal_close_code = close_code

    with pytest.raises(AuthenticationError, match=f"close code {close_code}"):
        await asyncio.wait_for(weather_remote(dispatch, token="wrong").serve(), 5)
    assert dispatch.attempts == 1


class SilentConnection:
    """A connection that takes every frame and never answers or closes (until ``close``)."""

    close_code = None
    close_exc = None

    def __init__(self) -> None:
        self._closed = asyncio.Event()

    async def send(self, frame: str) -> None:
        pass

    async def close(self) -> None:
        self._closed.set()

    def __aiter__(self) -> SilentConnection:
        return self

    async def __anext__(self) -> str:
        await self._closed.wait()
        raise StopAsyncIteration


@pytest.mark.asyncio
async def test_a_cancel_that_comes_with_a_reply_is_not_swallowed() -> None:
    # On Python 3.11, asyncio.wait_for returns the result when its future completes as
    # the task is cancelled, and the cancel is lost: a cancelled Remote.serve() went on
    # serving for ever (CI: a test teardown hung for 180 s).
    from remotes.client.session import Session

    session = Session(SilentConnection())  # type: ignore[arg-type]
    try:
        request = asyncio.create_task(session.request("remote-list", timeout=5))
        for _ in range(10):  # the request is sent and waits on its reply
            await asyncio.sleep(0)
        [(nonce, reply)] = list(session._pending.items())
        reply.set_result({"remotes": [], "nonce": nonce})  # the reply arrives ...
        request.cancel()  # ... in the same turn of the loop as the cancel
        with pytest.raises(asyncio.CancelledError):
            await request
    finally:
        await session.close()
