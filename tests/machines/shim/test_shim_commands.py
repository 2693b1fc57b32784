"""EXECUTE_COMMAND (docs/shim-protocol.md#operations): argv and shell, cwd inside a root, the safe
environment, timeouts that kill the whole process group, the output cap."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from machines.shim import ErrorCode, Limits, Operations, ShimError

Refusal = Callable[[Operations, str, dict[str, Any]], Awaitable[ShimError]]


async def test_it_runs_argv_without_a_shell(ops: Operations) -> None:
    response_type, payload = await ops.perform("EXECUTE_COMMAND", {"argv": ["echo", "$HOME", "a b"]})
    assert response_type == "COMMAND_RESULT"
    assert payload["stdout"] == "$HOME a b\n"
    assert payload["stderr"] == ""
    assert payload["exit_code"] == 0
    assert payload["timed_out"] is False
    assert payload["output_truncated"] is False
    assert isinstance(payload["duration_seconds"], float)


async def test_it_runs_a_command_string_through_the_shell(ops: Operations) -> None:
    command = "printf 'one\\ntwo\\n' | wc -l; echo err >&2; exit 3"
    _, payload = await ops.perform("EXECUTE_COMMAND", {"command": command})
    assert payload["stdout"].strip() == "2"
    assert payload["stderr"] == "err\n"
    assert payload["exit_code"] == 3


async def test_it_runs_in_the_first_root_by_default_and_in_cwd_when_given(ops: Operations, root: Path) -> None:
    (root / "sub").mkdir()
    _, default = await ops.perform("EXECUTE_COMMAND", {"argv": ["pwd", "-P"]})
    assert default["stdout"] == f"{root}\n"
    _, inside = await ops.perform("EXECUTE_COMMAND", {"argv": ["pwd", "-P"], "cwd": "sub"})
    assert inside["stdout"] == f"{root / 'sub'}\n"


async def test_it_refuses_a_cwd_outside_the_roots(ops: Operations, outside: Path, refusal: Refusal) -> None:
    error = await refusal(ops, "EXECUTE_COMMAND", {"argv": ["pwd"], "cwd": str(outside)})
    assert error.code == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    missing = await refusal(ops, "EXECUTE_COMMAND", {"argv": ["pwd"], "cwd": "missing"})
    assert missing.code == ErrorCode.PATH_NOT_FOUND


async def test_it_starts_from_a_minimal_environment_with_the_requested_env_on_top(
    ops: Operations, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPATCH_SHIM_TOKEN", "must-not-leak")
    monkeypatch.setenv("TERM", "xterm-256color")
    _, payload = await ops.perform("EXECUTE_COMMAND", {"argv": ["env"], "env": {"GREETING": "hi", "LANG": "C"}})
    variables = dict(line.split("=", 1) for line in payload["stdout"].splitlines())
    assert set(variables) <= {"PATH", "HOME", "LANG", "USER", "SHELL", "TERM", "GREETING", "PWD", "SHLVL", "_"}
    assert variables["GREETING"] == "hi"
    assert variables["LANG"] == "C"
    assert variables["TERM"] == "dumb"
    assert "must-not-leak" not in payload["stdout"]


async def test_it_kills_the_whole_process_group_on_timeout(ops: Operations, root: Path, processes: Any) -> None:
    # The child ignores SIGTERM and outlives its shell unless the group gets SIGKILL.
    script = "trap '' TERM; sleep 100 & echo $! > pidfile; echo started; wait"
    _, payload = await ops.perform("EXECUTE_COMMAND", {"argv": ["bash", "-c", script], "timeout_seconds": 1})
    assert payload["timed_out"] is True
    assert payload["exit_code"] == -1
    assert payload["stdout"] == "started\n"
    child = int((root / "pidfile").read_text())
    assert processes.wait_gone(child)


async def test_it_kills_background_children_that_hold_the_output_open(
    ops: Operations, root: Path, processes: Any
) -> None:
    # The shell itself exits at once; its child keeps stdout open until the timeout.
    command = "sleep 100 & echo $! > pidfile"
    _, payload = await ops.perform("EXECUTE_COMMAND", {"command": command, "timeout_seconds": 1})
    assert payload["timed_out"] is True
    assert processes.wait_gone(int((root / "pidfile").read_text()))


async def test_it_kills_the_process_group_when_the_operation_is_cancelled(
    ops: Operations, root: Path, processes: Any
) -> None:
    task = asyncio.create_task(
        ops.perform("EXECUTE_COMMAND", {"command": "sleep 100 & echo $! > pidfile; wait", "timeout_seconds": 20})
    )
    async with asyncio.timeout(10):
        while not (root / "pidfile").exists() or not (root / "pidfile").read_text().strip():
            await asyncio.sleep(0.02)
    child = int((root / "pidfile").read_text())
    assert not processes.gone(child)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert processes.wait_gone(child)


async def test_it_answers_even_when_a_process_that_left_the_group_holds_the_output(ops: Operations, root: Path) -> None:
    # setsid puts the sleep in a session of its own: the group kill cannot reach it and
    # it keeps stdout open, yet the command must still be answered.
    command = "setsid sleep 60 & echo $! > pidfile; wait"
    try:
        async with asyncio.timeout(30):
            _, payload = await ops.perform("EXECUTE_COMMAND", {"command": command, "timeout_seconds": 1})
        assert payload["timed_out"] is True and payload["exit_code"] == -1
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((root / "pidfile").read_text()), signal.SIGKILL)


@pytest.mark.parametrize("timeout", [0, -1, 21, "5", True])
async def test_it_refuses_a_timeout_outside_the_allowed_range(
    ops: Operations, timeout: object, refusal: Refusal
) -> None:
    error = await refusal(ops, "EXECUTE_COMMAND", {"argv": ["true"], "timeout_seconds": timeout})
    assert error.code == ErrorCode.INVALID_REQUEST


async def test_it_caps_the_combined_output_at_the_file_size_limit(ops: Operations) -> None:
    # 3000 bytes on stdout and 3000 on stderr against a 1024-byte limit.
    command = "head -c 3000 /dev/zero | tr '\\0' o; head -c 3000 /dev/zero | tr '\\0' e >&2"
    _, payload = await ops.perform("EXECUTE_COMMAND", {"command": command})
    assert len(payload["stdout"]) + len(payload["stderr"]) == 1024
    assert set(payload["stdout"]) <= {"o"} and set(payload["stderr"]) <= {"e"}
    assert payload["output_truncated"] is True
    assert payload["exit_code"] == 0 and payload["timed_out"] is False


async def test_it_uses_the_default_timeout_when_none_is_given(make_operations: Callable[..., Operations]) -> None:
    quick = make_operations(
        limits=Limits(
            max_file_size_bytes=1024, command_timeout_seconds=0.5, max_command_timeout_seconds=20, max_concurrent=2
        )
    )
    _, payload = await quick.perform("EXECUTE_COMMAND", {"argv": ["sleep", "30"]})
    assert payload["timed_out"] is True and payload["exit_code"] == -1


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"argv": ["echo"], "command": "echo"},
        {"argv": []},
        {"argv": "echo hi"},
        {"argv": ["echo", 3]},
        {"argv": ["echo", "a\x00b"]},
        {"command": "  "},
        {"argv": ["env"], "env": {"A=B": "x"}},
        {"argv": ["env"], "env": {"A": 1}},
        {"argv": ["env"], "env": ["A"]},
    ],
)
async def test_it_refuses_command_payloads_that_do_not_fit(ops: Operations, payload: dict, refusal: Refusal) -> None:
    assert (await refusal(ops, "EXECUTE_COMMAND", payload)).code == ErrorCode.INVALID_REQUEST


async def test_it_reports_a_missing_program(ops: Operations, refusal: Refusal) -> None:
    error = await refusal(ops, "EXECUTE_COMMAND", {"argv": ["no-such-program-anywhere"]})
    assert error.code == ErrorCode.PATH_NOT_FOUND


async def test_it_reports_a_program_the_os_refuses_to_run(ops: Operations, root: Path, refusal: Refusal) -> None:
    script = root / "script.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o644)  # not executable, even for root
    error = await refusal(ops, "EXECUTE_COMMAND", {"argv": [str(script)]})
    assert error.code == ErrorCode.PERMISSION_DENIED


async def test_it_reports_a_signal_death_as_a_negative_exit_code(ops: Operations) -> None:
    _, payload = await ops.perform("EXECUTE_COMMAND", {"command": "kill -9 $$"})
    assert payload["exit_code"] == -9 and payload["timed_out"] is False
