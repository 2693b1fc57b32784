"""``python -m machines.shim run`` as a real process against a fake platform
(docs/shim-protocol.md#the-shim-program)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from machines.shim.cli import main

REPO = Path(__file__).resolve().parents[3]


@asynccontextmanager
async def shim_process(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[asyncio.subprocess.Process]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "machines.shim",
        *args,
        cwd=REPO,
        env={**os.environ, "DISPATCH_SHIM_BACKOFF_SCALE": "0.01", **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def finished(process: asyncio.subprocess.Process) -> tuple[int, str]:
    async with asyncio.timeout(20):
        _, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stderr.decode()


async def test_run_serves_the_platform_and_stops_when_taken_over(platform: Any, tmp_path: Path) -> None:
    root, state_dir = tmp_path / "work", tmp_path / "state"
    root.mkdir()
    async with shim_process(
        "run", "--server", platform.url, "--token", platform.token,
        "--state-dir", str(state_dir), "--root", str(root), "--name", "x",
    ) as process:  # fmt: skip
        side = await platform.next_side(within=20)
        hello = side.hello["payload"]
        assert hello["display_name"] == "x"
        assert hello["allowed_roots"] == [str(root.resolve())]
        assert hello["sessions"] == ["*"]
        state = json.loads((state_dir / "state.json").read_text())
        assert hello["machine_id"] == state["machine_id"]
        assert state["token"] is None  # --token is not stored
        assert stat.S_IMODE((state_dir / "state.json").stat().st_mode) == 0o600

        written = await side.request(
            "FILE_WRITE", {"path": "out.txt", "content": "from the platform", "encoding": "utf-8"}
        )
        assert written["type"] == "ACK"
        ran = await side.request("EXECUTE_COMMAND", {"command": "cat out.txt; echo; echo $TERM"})
        assert ran["payload"]["stdout"] == "from the platform\ndumb\n"
        assert (await side.request("PING", {}))["type"] == "PONG"

        await side.send("SESSION_REVOKED", {"reason": "reconnected"}, session_id=None)
        await side.connection.close(4427)
        code, stderr = await finished(process)
    assert code == 1
    assert "not reconnecting" in stderr and "4427" in stderr
    assert platform.attempts == 1
    records = [json.loads(line) for line in (state_dir / "audit.jsonl").read_text().splitlines()]
    assert [record["op"] for record in records] == ["FILE_WRITE", "EXECUTE_COMMAND"]
    assert platform.token not in (state_dir / "audit.jsonl").read_text() + stderr


async def test_run_reconnects_after_a_normal_close_and_exits_cleanly_on_sigterm(platform: Any, tmp_path: Path) -> None:
    state_dir, configured_root = tmp_path / "state", tmp_path / "configured"
    configured_root.mkdir()
    state_dir.mkdir()
    (state_dir / "config.toml").write_text(
        f"allowed_roots = [{str(configured_root)!r}]\ncapabilities = ['shell', 'files']\n"
    )
    async with shim_process(
        "run", "--server", platform.url, "--state-dir", str(state_dir), "--session", "agt_one", "--no-shell",
        env={"DISPATCH_SHIM_TOKEN": platform.token},
    ) as process:  # fmt: skip
        first = await platform.next_side(within=20)
        assert first.hello["payload"]["sessions"] == ["agt_one"]
        assert first.hello["payload"]["allowed_roots"] == [str(configured_root.resolve())]
        assert first.hello["payload"]["capabilities"] == ["files"]  # the flag overrides the file
        await first.connection.close(1000)
        second = await platform.next_side(within=20)
        assert second.hello["payload"]["machine_id"] == first.hello["payload"]["machine_id"]
        process.send_signal(signal.SIGTERM)
        code, stderr = await finished(process)
        await second.connection.wait_closed()
    assert code == 0, stderr
    assert second.connection.close_code == 1000
    assert platform.attempts == 2


async def test_run_exits_with_a_clear_message_when_the_token_is_refused(platform: Any, tmp_path: Path) -> None:
    platform.upgrade_status = 401
    async with shim_process(
        "run", "--server", platform.url, "--token", "bad", "--state-dir", str(tmp_path / "s"), "--root", str(tmp_path)
    ) as process:
        code, stderr = await finished(process)
    assert code == 1
    assert "refused the token (HTTP 401" in stderr
    assert platform.attempts == 1


def test_run_refuses_to_start_without_a_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISPATCH_SHIM_TOKEN", raising=False)
    code = main(["run", "--server", "http://127.0.0.1:9", "--state-dir", str(tmp_path), "--root", str(tmp_path)])
    assert code == 2
    assert "no token" in capsys.readouterr().err


def test_run_refuses_a_root_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--server", "http://h:1", "--token", "t", "--state-dir", str(tmp_path),
                 "--root", str(tmp_path / "missing")])  # fmt: skip
    assert code == 2
    assert "not an existing directory" in capsys.readouterr().err


def test_run_refuses_a_malformed_session_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--server", "http://h:1", "--token", "t", "--state-dir", str(tmp_path),
                 "--root", str(tmp_path), "--session", "-bad id"])  # fmt: skip
    assert code == 2
    assert "not a session id" in capsys.readouterr().err


def test_run_refuses_a_configured_root_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.toml").write_text("allowed_roots = ['/nonexistent-root']\n")
    code = main(["run", "--server", "http://h:1", "--token", "t", "--state-dir", str(tmp_path)])
    assert code == 2
    assert "/nonexistent-root" in capsys.readouterr().err


def test_status_never_shows_the_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "state.json").write_text(json.dumps({"machine_id": "m-1", "server": "http://h", "token": "tok-xyz"}))
    assert main(["status", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "m-1" in out and "http://h" in out and "token:      stored" in out
    assert "tok-xyz" not in out
    assert main(["logout", "--state-dir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "state.json").read_text())["token"] is None
    assert main(["status", "--state-dir", str(tmp_path)]) == 0
    assert "token:      not stored" in capsys.readouterr().out


def test_run_refuses_an_overlong_display_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--server", "http://h:1", "--token", "t", "--state-dir", str(tmp_path),
                 "--root", str(tmp_path), "--name", "x" * 256])  # fmt: skip
    assert code == 2
    assert "--name" in capsys.readouterr().err


def test_the_shim_imports_nothing_from_django_or_the_rest_of_the_project() -> None:
    probe = (
        "import sys, machines.shim.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('django', 'channels', 'rest_framework', 'pydantic', 'dispatch', 'remotes') "
        "or (m.startswith('machines.') and not m.startswith('machines.shim'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
