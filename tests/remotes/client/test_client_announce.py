"""What serving says: one line when the remote is registered, one per reconnect,
from ``Remote.serve(announce=…)``, ``Remote.run()`` in a plain script, and ``--server``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING

import pytest

from remotes.client import Remote
from remotes.client.cli import main
from remotes.client.session import websocket_url
from tests.remotes.client.conftest import ROOT

if TYPE_CHECKING:
    from conftest import FakeDispatch


def two_function_remote(url: str, token: str) -> Remote:
    remote = Remote("weather-service", url=url, token=token)

    @remote.function
    def get_forecast(city: str) -> str:
        """Forecast for a city."""
        return f"sunny in {city}"

    @remote.function
    def get_temperature(city: str) -> int:
        """Temperature in a city, in °C."""
        return len(city)

    return remote


async def test_serving_announces_the_registration_and_each_reconnect(dispatch: FakeDispatch) -> None:
    lines: list[str] = []
    remote = two_function_remote(dispatch.url, dispatch.token)
    serving = asyncio.create_task(remote.serve(announce=lines.append))
    try:
        await dispatch.wait_registered()
        assert lines == [f"serving 'weather-service' (2 functions) on {dispatch.url}"]

        dispatch.serving["weather-service"].transport.abort()  # the network goes away
        await dispatch.wait_registered(count=2)
        async with asyncio.timeout(5):  # the fake records the registration before it replies
            while not lines[-1].startswith("reconnected: "):
                await asyncio.sleep(0.01)
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving

    # The fake may not have dropped the name yet when the client comes back: its retries
    # are told too (test_each_retry_while_the_server_still_holds_the_name_is_announced).
    assert [line for line in lines if "still registered; retrying" not in line] == [
        f"serving 'weather-service' (2 functions) on {dispatch.url}",
        f"reconnected: serving 'weather-service' (2 functions) on {dispatch.url}",
    ]


async def test_nothing_but_the_retries_is_announced_before_the_remote_is_registered(dispatch: FakeDispatch) -> None:
    lines: list[str] = []
    dispatch.still_connected = 1_000  # every remote-connect is refused "already connected"
    remote = two_function_remote(dispatch.url, dispatch.token)
    serving = asyncio.create_task(remote.serve(announce=lines.append))
    await asyncio.sleep(0.3)
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving

    assert dispatch.attempts == 1
    retry = "remote 'weather-service' is still registered; retrying in "
    assert lines and all(line.startswith(retry) for line in lines)


async def test_a_plain_script_calling_run_says_that_it_serves(dispatch: FakeDispatch) -> None:
    """``python examples/weather_service.py``: Remote.run() prints the line itself."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "weather_service.py"),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DISPATCH_URL": dispatch.url, "DISPATCH_TOKEN": dispatch.token},
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stderr.readline(), 20)).decode()
        rome = await dispatch.call("weather-service", "get_forecast", {"city": "Rome"})
    finally:
        process.terminate()
        await process.wait()

    assert line == f"serving 'weather-service' (1 function) on {dispatch.url}\n"
    assert rome["result"]["city"] == "Rome"


@pytest.mark.parametrize(
    ("server", "url"),
    [
        ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/ws"),
        ("https://dispatch.example/", "wss://dispatch.example/ws"),
        ("https://example.org/dispatch", "wss://example.org/dispatch/ws"),
        ("ws://127.0.0.1:8000/ws", "ws://127.0.0.1:8000/ws"),
    ],
)
def test_the_session_url_is_derived_from_the_server_base_url(server: str, url: str) -> None:
    assert websocket_url(server) == url


@pytest.mark.parametrize("server", ["127.0.0.1:8000", "ftp://host/", "http://"])
def test_a_server_that_is_not_a_base_url_is_refused(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--server", server, "--token", "t"]) == 2
    assert "expected the server's base URL" in capsys.readouterr().err


async def test_call_reaches_the_remote_through_the_server_base_url(
    dispatch: FakeDispatch, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = two_function_remote(dispatch.url, dispatch.token)
    serving = asyncio.create_task(remote.serve())
    try:
        await dispatch.wait_registered()
        server = dispatch.url.removesuffix("/ws").replace("ws://", "http://")
        argv = ["call", "weather-service", "get_temperature", '{"city": "Oslo"}', "--server", server]
        code = await asyncio.to_thread(main, [*argv, "--token", dispatch.token])
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving

    assert code == 0
    assert json.loads(capsys.readouterr().out) == 4


def test_server_and_url_exclude_each_other() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["list", "--server", "http://h:1", "--url", "ws://h:1/ws", "--token", "t"])
    assert exit_info.value.code == 2
