"""What a new user meets first with ``dispatch-remote``: the URL Dispatch hands its agents,
the README's snippet served both ways, a server that is not there, a refused token, and
help texts that say only what the user can act on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from remotes.client import Remote
from remotes.client.cli import _parser, main
from tests.remotes.client.conftest import ROOT

if TYPE_CHECKING:
    from conftest import FakeDispatch


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISPATCH_URL", raising=False)
    monkeypatch.delenv("DISPATCH_TOKEN", raising=False)


def base_url(dispatch: FakeDispatch) -> str:
    """``http://127.0.0.1:PORT``: the instance's base URL, as Dispatch sets ``DISPATCH_URL``."""
    return dispatch.url.removesuffix("/ws").replace("ws://", "http://")


def adder(url: str | None = None, token: str | None = None) -> Remote:
    remote = Remote("math", url=url, token=token)

    @remote.function
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    return remote


@contextlib.asynccontextmanager
async def serving(remote: Remote, lines: list[str] | None = None):  # type: ignore[no-untyped-def]
    task = asyncio.create_task(remote.serve(announce=None if lines is None else lines.append))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_dispatch_url_may_be_the_instance_base_url_dispatch_gives_its_agents(
    dispatch: FakeDispatch, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DISPATCH_URL", base_url(dispatch))
    monkeypatch.setenv("DISPATCH_TOKEN", dispatch.token)
    lines: list[str] = []
    async with serving(adder(), lines):  # neither url nor token: both from the environment
        await dispatch.wait_registered()
        code = await asyncio.to_thread(main, ["call", "math", "add", '{"a": 2, "b": 3}'])

    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == "5"
    assert lines == [f"serving 'math' (1 function) on {dispatch.url}"]


async def test_url_takes_the_base_url_too_and_a_ws_url_keeps_working(
    dispatch: FakeDispatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async with serving(adder(url=base_url(dispatch), token=dispatch.token)):
        await dispatch.wait_registered()
        for url in (base_url(dispatch), dispatch.url):
            code = await asyncio.to_thread(
                main, ["call", "math", "add", '{"a": 1, "b": 1}', "--url", url, "--token", dispatch.token]
            )
            assert code == 0, capsys.readouterr().err
            assert capsys.readouterr().out.strip() == "2"


def test_a_dispatch_url_that_is_no_url_is_refused_naming_its_source(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DISPATCH_URL", "127.0.0.1:8765")

    assert main(["list", "--token", "t"]) == 2
    assert capsys.readouterr().err.startswith("error: $DISPATCH_URL: expected the server's base URL")


async def test_each_retry_while_the_server_still_holds_the_name_is_announced(dispatch: FakeDispatch) -> None:
    dispatch.still_connected = 2
    lines: list[str] = []
    async with serving(adder(url=dispatch.url, token=dispatch.token), lines):
        await dispatch.wait_registered()

    assert [re.sub(r"[0-9.]+s$", "Ns", line) for line in lines] == [
        "remote 'math' is still registered; retrying in Ns",
        "remote 'math' is still registered; retrying in Ns",
        f"serving 'math' (1 function) on {dispatch.url}",
    ]


def readme_snippet() -> str:
    """The README's "write your own remote" block, importing the client of this clone."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Serve and call a remote", 1)[1].split("\n## ", 1)[0]
    [block] = [block for block in re.findall(r"```python\n(.*?)```", section, re.DOTALL) if "remote.run()" in block]
    return block.replace("from dispatch_remote import", "from remotes.client import")


async def first_stderr_line(*argv: str | Path, cwd: Path, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k not in ("DISPATCH_URL", "DISPATCH_TOKEN")}
    process = await asyncio.create_subprocess_exec(
        *map(str, argv),
        cwd=cwd,
        env={**environment, "PYTHONPATH": str(ROOT), **env},
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        return (await asyncio.wait_for(process.stderr.readline(), 20)).decode()
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        await process.wait()


async def test_the_readme_snippet_serves_by_file_and_variable_with_server_and_token_given(
    dispatch: FakeDispatch, tmp_path: Path
) -> None:
    (tmp_path / "weather.py").write_text(readme_snippet())

    line = await first_stderr_line(
        sys.executable, "-m", "remotes.client", "serve", "weather.py:remote",
        "--server", base_url(dispatch), "--token", dispatch.token,
        cwd=tmp_path,
    )  # fmt: skip

    assert line == f"serving 'weather-service' (1 function) on {dispatch.url}\n"
    assert (await dispatch.wait_registered())["remotename"] == "weather-service"


async def test_the_readme_snippet_runs_as_a_script_with_the_url_dispatch_gives_its_agents(
    dispatch: FakeDispatch, tmp_path: Path
) -> None:
    (tmp_path / "weather.py").write_text(readme_snippet())

    line = await first_stderr_line(
        sys.executable, "weather.py", cwd=tmp_path, DISPATCH_URL=base_url(dispatch), DISPATCH_TOKEN=dispatch.token
    )

    assert line == f"serving 'weather-service' (1 function) on {dispatch.url}\n"


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_call_that_cannot_connect_names_the_default_url_and_how_to_change_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    default = f"ws://127.0.0.1:{unused_port()}/ws"
    monkeypatch.setattr("remotes.client.cli.DEFAULT_URL", default)

    assert main(["list", "--token", "t"]) == 1

    error = capsys.readouterr().err
    assert error.startswith(f"error: cannot connect to {default} (the default: pass --server http(s)://host:port")
    assert "DISPATCH_URL" in error and error.count("\n") == 1


def test_a_call_to_a_named_server_that_is_not_there_names_it_without_the_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = f"http://127.0.0.1:{unused_port()}"

    assert main(["list", "--server", server, "--token", "t"]) == 1

    error = capsys.readouterr().err
    assert error.startswith(f"error: cannot connect to {server.replace('http', 'ws')}/ws: ")
    assert "default" not in error


async def test_a_refused_token_is_reported_once(
    dispatch: FakeDispatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="remotes.client"):
        code = await asyncio.to_thread(main, ["list", "--url", dispatch.url, "--token", "wrong"])

    assert code == 1
    assert capsys.readouterr().err == (
        "error: the server refused the session: authentication failed (close code 4401)\n"
    )
    assert caplog.records == []


def help_texts() -> dict[str, str]:
    """``--help`` of the command and of each subcommand."""
    parser = _parser()
    texts = {"dispatch-remote": parser.format_help()}
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for name, subparser in action.choices.items():
            texts[name] = subparser.format_help()
    return texts


def test_the_help_is_plain_text_without_references_the_user_cannot_follow() -> None:
    for name, text in help_texts().items():
        for marker in ("\N{SECTION SIGN}", "``", ":mod:", ":func:", ":data:", ":meth:", "spec" + "/"):
            assert marker not in text, f"{name} --help shows {marker!r}"


def test_serve_help_says_the_target_names_the_variable_holding_the_remote() -> None:
    text = " ".join(help_texts()["serve"].split())

    assert "FILE.py:VARIABLE" in text
    assert "the name of the variable in it that holds the Remote" in text
    assert "its Remote's name" not in text


def test_a_script_without_a_token_says_so_instead_of_a_traceback() -> None:
    with pytest.raises(SystemExit) as exit_info:
        adder(url="http://127.0.0.1:8000").run()

    assert str(exit_info.value.code).startswith("error: no API token for remote 'math': set DISPATCH_TOKEN")
