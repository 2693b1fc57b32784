"""The shim's guardian (``machines.shim.guardian``): the process groups of running commands
are killed once the shim is gone, however it died (a SIGKILLed shim leaves nothing
running: docs/live-operations.md#when-a-command-ends). Here the shim's death is its end of the pipe closing."""

from __future__ import annotations

import os
import subprocess
import time

from machines.shim.guardian import Guardian


def _group() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def _gone(process: subprocess.Popen[bytes], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return True
        time.sleep(0.02)
    return False


def test_the_guardian_kills_the_groups_still_running_when_the_shim_goes_away() -> None:
    guardian = Guardian()
    running, ended = _group(), _group()
    try:
        guardian.watch(running.pid)
        guardian.watch(ended.pid)
        guardian.forget(ended.pid)  # ended as far as the shim knows: not the guardian's to kill
        assert guardian._process is not None and guardian._process.stdin is not None
        guardian._process.stdin.close()  # what the kernel does when the shim dies
        assert _gone(running), "the running command's group outlived its shim"
        assert running.returncode == -9
        assert ended.poll() is None
    finally:
        for process in (running, ended):
            if process.poll() is None:
                os.killpg(process.pid, 9)
            process.wait()


def test_a_guardian_that_died_is_restarted_and_told_every_group_again() -> None:
    guardian = Guardian()
    first, second = _group(), _group()
    try:
        guardian.watch(first.pid)
        assert guardian._process is not None
        old_pid = guardian.pid
        guardian._process.kill()
        guardian._process.wait()
        guardian.watch(second.pid)
        assert guardian.pid != old_pid
        assert guardian._process.stdin is not None
        guardian._process.stdin.close()
        assert _gone(first) and _gone(second)
    finally:
        for process in (first, second):
            if process.poll() is None:
                os.killpg(process.pid, 9)
            process.wait()
