"""The remote client when another session disconnects its remote (``remote-disconnected``),
when a function returns a value JSON cannot carry, and the two auth-refusal shapes
(docs/ws-protocol.md#authentication)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import pytest

from remotes.client import AuthenticationError, Remote, RemoteDisconnected
from tests.remotes.client.conftest import serve_weather_example

if TYPE_CHECKING:
    from conftest import FakeDispatch

Start = Callable[[Remote], "asyncio.Task[NoReturn]"]


def adder(dispatch: FakeDispatch) -> Remote:
    remote = Remote("math", url=dispatch.url, token=dispatch.token)

    @remote.function
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    @remote.function
    def not_a_number() -> float:
        """NaN, which JSON cannot carry."""
        return math.nan

    return remote


@pytest.mark.asyncio
async def test_serve_ends_with_remote_disconnected_and_does_not_register_again(
    dispatch: FakeDispatch, caplog: pytest.LogCaptureFixture
) -> None:
    remote = adder(dispatch)
    serving = asyncio.create_task(remote.serve())
    await dispatch.wait_registered()

    with caplog.at_level(logging.WARNING, logger="remotes.client"):
        await dispatch.disconnect("math", "disconnected by another session of the user")
        with pytest.raises(RemoteDisconnected, match=r"'math'.*disconnected by another session of the user"):
            await asyncio.wait_for(serving, 5)

    assert len(dispatch.registrations) == 1  # never registered again
    assert dispatch.attempts == 1  # nor reconnected
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'math'" in r.getMessage() and "another session of the user" in r.getMessage() for r in warnings)


@pytest.mark.asyncio
async def test_an_event_for_another_name_is_ignored(dispatch: FakeDispatch, start_serving: Start) -> None:
    start_serving(adder(dispatch))
    await dispatch.wait_registered()
    await dispatch.serving["math"].send('{"action": "remote-disconnected", "remotename": "other", "reason": "x"}')

    assert (await dispatch.call("math", "add", {"a": 1, "b": 2}))["result"] == 3


@pytest.mark.asyncio
async def test_the_cli_exits_1_with_the_message_when_its_remote_is_disconnected(dispatch: FakeDispatch) -> None:
    process = await serve_weather_example(dispatch)
    try:
        await dispatch.wait_registered()
        await dispatch.disconnect("weather-service", "removed on the Remotes page")
        code = await asyncio.wait_for(process.wait(), 10)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stderr is not None
    stderr = (await process.stderr.read()).decode()

    assert code == 1
    assert "error: remote 'weather-service' was disconnected by another session: removed on the Remotes page" in stderr


@pytest.mark.asyncio
async def test_a_function_returning_nan_is_that_functions_error(dispatch: FakeDispatch, start_serving: Start) -> None:
    start_serving(adder(dispatch))
    await dispatch.wait_registered()

    result = await dispatch.call("math", "not_a_number", {})

    assert "result" not in result
    assert result["error"].startswith("ValueError: 'not_a_number' returned a value JSON cannot carry")
    assert (await dispatch.call("math", "add", {"a": 1, "b": 2}))["result"] == 3  # still serving


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "frame",
    [{"error": "authentication failed"}, {"action": "auth", "error": "authentication failed"}],
    ids=["spec-1.1-no-action", "older-server-action-auth"],
)
async def test_both_auth_refusal_shapes_stop_with_the_servers_reason(dispatch: FakeDispatch, frame: dict) -> None:
    dispatch.refusal_frame = frame
    remote = Remote("math", url=dispatch.url, token="wrong")

    with pytest.raises(AuthenticationError, match="authentication failed \\(close code 4401\\)"):
        await asyncio.wait_for(remote.serve(), 5)
