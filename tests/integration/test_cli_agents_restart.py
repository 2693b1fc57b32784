"""CLI agents across real ``manage.py serve`` processes (docs/agents.md).

Agents keep running when Dispatch restarts and the new process's supervisor picks them
up; a second instance on the same computer (its own database, the same tmux server)
never touches the first one's sessions. Every server runs on a private tmux socket
(``DISPATCH_TMUX_SOCKET``) killed afterwards; the tests talk to the servers over REST and
read the panes through tmux.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.tmux import TmuxRunner
from tests.infra import Server, instance, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

FAST = {"DISPATCH_CLI_SUPERVISE_INTERVAL": "0.5"}  # lease of 1.5 s


@pytest.fixture
def tmux_socket() -> Iterator[str]:
    name = f"dispatch-it-{uuid.uuid4().hex[:12]}"
    yield name
    subprocess.run(["tmux", "-L", name, "kill-server"], capture_output=True, check=False)
    (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / name).unlink(missing_ok=True)


def call(server: Server, token: str, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(
        method, f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10
    )


def status(server: Server, token: str, agent_id: str) -> str:
    response = call(server, token, "GET", f"/api/v1/agents/{agent_id}")
    response.raise_for_status()
    return str(response.json()["status"])


def launch_shell(server: Server, token: str, cwd: Path, prompt: str) -> str:
    response = call(
        server, token, "POST", "/api/v1/agents", {"type": "shell", "name": "sh", "cwd": str(cwd), "prompt": prompt}
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def test_a_restarted_server_picks_its_running_agent_up_again(tmux_socket: str, tmp_path: Path) -> None:
    runner = TmuxRunner(socket_name=tmux_socket)
    with instance(DISPATCH_TMUX_SOCKET=tmux_socket, **FAST) as inst:
        token = inst.admin_token
        first = inst.serve()
        agent_id = launch_shell(first, token, tmp_path, "echo before-$((6*7))")
        name = f"dispatch_{agent_id}"
        wait_until(lambda: "before-42" in runner.capture(name), timeout=15, what="the prompt run by the supervisor")
        pid = runner.pane_state(name).pid

        assert first.stop() == 0  # SIGTERM: a clean shutdown
        assert runner.exists(name) and runner.pane_state(name).pid == pid  # the agent outlived it

        second = inst.serve()
        # The new server's supervisor takes the lease and reconciles: nothing is reset or killed.
        runner.paste(name, "echo pasted-$((5*5))")
        wait_until(lambda: "pasted-25" in runner.capture(name), timeout=10, what="the shell still answering")
        assert status(second, token, agent_id) == "running"
        assert runner.pane_state(name).pid == pid

        runner.paste(name, "exit 0")
        wait_until(
            lambda: status(second, token, agent_id) == "stopped",
            timeout=20,
            what="the new server marking the agent stopped",
            details=second.log,
        )
        # The pass that marks it stopped kills the session next: just after, not before.
        wait_until(lambda: not runner.exists(name), timeout=10, what="the ended agent's session killed")


def test_a_second_instance_on_this_computer_never_touches_the_first_ones_sessions(
    tmux_socket: str, tmp_path: Path
) -> None:
    runner = TmuxRunner(socket_name=tmux_socket)
    with (
        instance(DISPATCH_TMUX_SOCKET=tmux_socket, **FAST) as one,
        instance(DISPATCH_TMUX_SOCKET=tmux_socket, **FAST) as two,
    ):
        server_one, server_two = one.serve(), two.serve()
        ours = launch_shell(server_one, one.admin_token, tmp_path, "echo one-$((1+1))")
        wait_until(lambda: "one-2" in runner.capture(f"dispatch_{ours}"), timeout=15, what="instance one's agent")
        theirs = launch_shell(server_two, two.admin_token, tmp_path, "echo two-$((2+2))")
        # Instance two's supervisor is active: it delivered its own agent's prompt...
        wait_until(lambda: "two-4" in runner.capture(f"dispatch_{theirs}"), timeout=15, what="instance two's agent")
        pid = runner.pane_state(f"dispatch_{ours}").pid
        # ...and through several of its passes (0.5 s each), instance one's session stays.
        runner.paste(f"dispatch_{theirs}", "exit 0")
        wait_until(
            lambda: status(server_two, two.admin_token, theirs) == "stopped",
            timeout=20,
            what="instance two reconciling its own agent",
            details=server_two.log,
        )
        wait_until(lambda: not runner.exists(f"dispatch_{theirs}"), timeout=10, what="instance two's session killed")
        assert runner.exists(f"dispatch_{ours}") and runner.pane_state(f"dispatch_{ours}").pid == pid
        assert status(server_one, one.admin_token, ours) == "running"


def test_the_doorbell_wakes_the_supervisor_long_before_its_next_poll(tmux_socket: str, tmp_path: Path) -> None:
    """With a 60 s poll, a prompt is still pasted at once: the launch rings the host's doorbell."""
    runner = TmuxRunner(socket_name=tmux_socket)
    with instance(DISPATCH_TMUX_SOCKET=tmux_socket, DISPATCH_CLI_SUPERVISE_INTERVAL="60") as inst:
        server = inst.serve()
        agent_id = launch_shell(server, inst.admin_token, tmp_path, "echo rang-$((3*3))")
        wait_until(
            lambda: "rang-9" in runner.capture(f"dispatch_{agent_id}"),
            timeout=15,
            what="the prompt pasted after the doorbell",
            details=server.log,
        )
