"""``python -m remotes.client`` against a fake ``/ws`` (docs/ws-protocol.md#the-python-client)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import pytest

from remotes.client import Remote
from remotes.client.cli import main
from tests.remotes.client.conftest import ROOT, serve_weather_example

if TYPE_CHECKING:
    from conftest import FakeDispatch

Start = Callable[[Remote], "asyncio.Task[NoReturn]"]


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISPATCH_URL", raising=False)
    monkeypatch.delenv("DISPATCH_TOKEN", raising=False)


async def serve_adder(dispatch: FakeDispatch, start_serving: Start) -> None:
    remote = Remote("math", url=dispatch.url, token=dispatch.token)

    @remote.function
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    start_serving(remote)
    await dispatch.wait_registered()


async def run_cli(*argv: str) -> int:
    """Run the CLI in a thread: it has its own event loop, and the fake needs this one."""
    return await asyncio.to_thread(main, list(argv))


@pytest.mark.asyncio
async def test_call_prints_the_result_as_json(
    dispatch: FakeDispatch, start_serving: Start, capsys: pytest.CaptureFixture[str]
) -> None:
    await serve_adder(dispatch, start_serving)

    code = await run_cli(
        "call",
        "math",
        "add",
        '{"a": 2, "b": 3}',
        "--url",
        dispatch.url,
        "--token",
        dispatch.token,
    )

    assert code == 0
    assert json.loads(capsys.readouterr().out) == 5
    assert dispatch.calls == [{"remotename": "math", "function": "add", "args": {"a": 2, "b": 3}}]


@pytest.mark.asyncio
async def test_call_takes_url_and_token_from_the_environment_and_passes_the_timeout(
    dispatch: FakeDispatch,
    start_serving: Start,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await serve_adder(dispatch, start_serving)
    monkeypatch.setenv("DISPATCH_URL", dispatch.url)
    monkeypatch.setenv("DISPATCH_TOKEN", dispatch.token)

    code = await run_cli("call", "math", "add", '{"a": 1, "b": 1}', "--timeout", "2.5")

    assert code == 0
    assert json.loads(capsys.readouterr().out) == 2
    assert dispatch.calls[0]["timeout"] == 2.5


@pytest.mark.asyncio
async def test_a_failed_call_prints_the_error_and_exits_1(
    dispatch: FakeDispatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await run_cli("call", "nowhere", "f", "{}", "--url", dispatch.url, "--token", dispatch.token)

    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    assert captured.err == "error: no connected remote named 'nowhere'\n"


@pytest.mark.asyncio
async def test_a_refused_token_exits_1(dispatch: FakeDispatch, capsys: pytest.CaptureFixture[str]) -> None:
    code = await run_cli("list", "--url", dispatch.url, "--token", "wrong")

    assert code == 1
    assert "authentication failed" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_list_prints_the_connected_functions(
    dispatch: FakeDispatch, start_serving: Start, capsys: pytest.CaptureFixture[str]
) -> None:
    await serve_adder(dispatch, start_serving)

    code = await run_cli("list", "--url", dispatch.url, "--token", dispatch.token)

    [entry] = json.loads(capsys.readouterr().out)
    assert code == 0
    assert entry["remotename"] == "math"
    assert entry["name"] == "add"
    assert entry["description"] == "Add two numbers."
    assert entry["parameters"]["required"] == ["a", "b"]


def test_no_token_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 2
    assert "DISPATCH_TOKEN" in capsys.readouterr().err


def test_serve_refuses_a_target_that_is_not_a_remote(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # serve puts the file's folder first
    target = f"{ROOT / 'examples' / 'weather_service.py'}:get_forecast"

    assert main(["serve", target, "--token", "t"]) == 2
    assert "'get_forecast' is not a Remote" in capsys.readouterr().err


def test_call_refuses_args_that_are_not_a_json_object() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["call", "math", "add", "[1, 2]", "--token", "t"])
    assert exit_info.value.code == 2


@pytest.mark.asyncio
async def test_serve_runs_the_example_weather_service(dispatch: FakeDispatch) -> None:
    process = await serve_weather_example(dispatch)
    try:
        assert process.stderr is not None
        banner = (await asyncio.wait_for(process.stderr.readline(), 10)).decode()
        registration = await dispatch.wait_registered()
        rome = await dispatch.call("weather-service", "get_forecast", {"city": "Rome"})
        again = await dispatch.call("weather-service", "get_forecast", {"city": "Rome"})
    finally:
        process.terminate()
        await process.wait()

    assert banner == f"serving 'weather-service' (1 function) on {dispatch.url}\n"
    assert registration["tools"][0]["description"] == "Retrieve weather forecast for a location."
    assert rome["result"]["city"] == "Rome"
    assert isinstance(rome["result"]["temperature_c"], int)
    assert again["result"] == rome["result"]
