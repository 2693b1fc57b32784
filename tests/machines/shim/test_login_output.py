"""``dispatch-shim login`` shows its code at once whatever its stdout is
(docs/shim-protocol.md#getting-a-token): piped, logged or over ssh without ``-t``, the
user must read the URL and the code while the login still waits for them, not after it is
approved.

A real ``manage.py serve`` and a real ``python -m machines.shim login`` whose stdout is a
pipe, in an environment without ``PYTHONUNBUFFERED`` (the one a user's shell has): the code
is read from the pipe, then approved in the web UI, then the login finishes.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.infra import PYTHON, REPO, Instance, Server, instance
from tests.integration.test_machines_real import approve_device

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

USER_CODE = re.compile(r"enter the code ([A-Z]{4}-[A-Z]{4})")
# How long to wait for the code on the pipe: the login's first request, never its approval.
CODE_SHOWN_WITHIN = 30.0


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[Instance, Server]]:
    with instance() as inst:
        yield inst, inst.serve()


def lines_of(pipe: IO[str]) -> queue.Queue[str | None]:
    """The lines of ``pipe`` as they arrive (``None`` at its end), read in a thread."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in pipe:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def read_until_code(lines: queue.Queue[str | None]) -> tuple[str, str]:
    """``(user code, everything read so far)``; fails if the pipe ends or stays silent."""
    seen = ""
    while True:
        try:
            line = lines.get(timeout=CODE_SHOWN_WITHIN)
        except queue.Empty:
            pytest.fail(f"the login showed no code on its pipe within {CODE_SHOWN_WITHIN:g}s; read so far: {seen!r}")
        if line is None:
            pytest.fail(f"the login's stdout ended before a code: {seen!r}")
        seen += line
        found = USER_CODE.search(seen)
        if found:
            return found.group(1), seen


def test_login_with_stdout_piped_shows_the_url_and_code_before_it_is_approved(
    site: tuple[Instance, Server], tmp_path: Path
) -> None:
    inst, server = site
    username, password = f"pipe{uuid.uuid4().hex[:6]}", "piped-login-pw-31"
    inst.create_user(username, password)
    env = {key: value for key, value in inst.env.items() if key != "PYTHONUNBUFFERED"}
    state_dir = tmp_path / "state"
    login = subprocess.Popen(
        [PYTHON, "-m", "machines.shim", "login", "--server", server.url, "--state-dir", str(state_dir)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert login.stdout is not None and not os.isatty(login.stdout.fileno())
        lines = lines_of(login.stdout)
        code, shown = read_until_code(lines)
        assert login.poll() is None, "the login must still be waiting for approval"
        assert "/machines/activate" in shown  # DISPATCH_PUBLIC_URL names the host

        approve_device(server, username, password, code)

        assert login.wait(30) == 0, login.stderr.read() if login.stderr else ""
        rest = ""
        while (line := lines.get(timeout=10)) is not None:
            rest += line
        assert f"Logged in to {server.url}" in rest
        assert (state_dir / "state.json").exists()
    finally:
        if login.poll() is None:
            login.kill()
            login.wait(10)
