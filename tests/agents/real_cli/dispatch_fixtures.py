"""Fixtures for the real CLIs launched BY DISPATCH: a real ``manage.py serve`` (its CLI
supervisor, its hooks endpoint) on a free port whose ``DISPATCH_AGENT_TYPES`` runs the
pinned ``claude``/``codex`` of tests/clients against ``tests.agents.fake_model``, on a
private tmux server (``DISPATCH_TMUX_SOCKET``) killed afterwards.

``dispatch_serve(types)`` starts it and returns a ``Dispatch`` (the server, an admin API
token, the tmux socket). The CLIs' homes are the test's own (the type's ``env`` ``HOME``,
``CODEX_HOME``), so what Dispatch writes there is seen by the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backends import free_port
from tests.infra import PYTHON, REPO, Instance, Process, Server, ShimProcess, instance, wait_until


@dataclass
class Dispatch:
    """A served Dispatch instance with the real CLIs as agent types."""

    inst: Instance
    server: Server
    token: str
    socket: str

    def launch(self, **body: Any) -> httpx.Response:
        """``POST /api/v1/agents`` as admin (a person's API token)."""
        return httpx.post(
            f"{self.server.url}/api/v1/agents",
            json=body,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30,
        )

    def agent(self, agent_id: str) -> dict[str, Any]:
        return dict(self.server.get(f"/api/v1/agents/{agent_id}", self.token).json())

    def pane(self, agent_id: str) -> str:
        """The agent's pane, for failure messages."""
        done = subprocess.run(
            ["tmux", "-L", self.socket, "capture-pane", "-p", "-t", f"dispatch_{agent_id}"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
        return done.stdout or done.stderr

    def wait_running(self, agent_id: str, timeout: float = 20) -> dict[str, Any]:
        """The agent once it left ``creating``; fails showing its pane when it is ``error``."""
        deadline = time.monotonic() + timeout
        agent = self.agent(agent_id)
        while agent["status"] == "creating" and time.monotonic() < deadline:
            time.sleep(0.2)
            agent = self.agent(agent_id)
        if agent["status"] == "error":
            pytest.fail(f"the agent failed: {agent['last_error']}\npane:\n{self.pane(agent_id)}")
        return agent


def _serve(inst: Instance) -> Server:
    """``manage.py serve`` on a free port that is also its ``DISPATCH_PUBLIC_URL`` (the URL
    the CLIs' hooks and MCP client are given)."""
    port = free_port()
    env = {**inst.env, "DISPATCH_PUBLIC_URL": f"http://127.0.0.1:{port}"}
    started = Process.spawn(env, [PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port)], name=f"serve-{port}")
    server = Server(proc=started.proc, log_path=started.log_path, port=port)
    inst.servers.append(server)
    return server.wait_healthy()


@pytest.fixture
def dispatch_serve() -> Iterator[Callable[[dict[str, Any]], Dispatch]]:
    """``start(agent_types)``: a migrated instance serving with ``DISPATCH_AGENT_TYPES`` =
    ``agent_types`` on a private tmux server; stopped (and its tmux server killed) after
    the test."""
    stack = ExitStack()
    sockets: list[str] = []

    def start(agent_types: dict[str, Any]) -> Dispatch:
        socket = f"dispatch-realcli-{uuid.uuid4().hex[:12]}"
        sockets.append(socket)
        inst = stack.enter_context(
            instance(
                DISPATCH_AGENT_TYPES=json.dumps(agent_types),
                DISPATCH_TMUX_SOCKET=socket,
                DISPATCH_CLI_SUPERVISE_INTERVAL="0.5",
            )
        )
        return Dispatch(inst=inst, server=_serve(inst), token=inst.admin_token, socket=socket)

    yield start
    for socket in sockets:  # before the servers stop: the CLIs' SessionEnd hooks have nobody to reach
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)
        (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / socket).unlink(missing_ok=True)
    stack.close()


# --- the real peers the CLIs reach through Dispatch's MCP (added for the lifecycle tests) ---

WEATHER_REMOTE = "weather-service"


def serve_weather_remote(dispatch: Dispatch) -> Process:
    """The example remote ``weather-service`` (examples/weather_service.py, one function
    ``get_forecast``) served by a real ``python -m remotes.client serve`` as admin on
    ``dispatch``'s server; returned once ``GET /api/v1/remotes`` lists it (stopped with the
    instance)."""
    args = ["serve", "examples/weather_service.py:remote", "--url", dispatch.server.ws_url, "--token", dispatch.token]
    process = dispatch.inst.spawn([PYTHON, "-m", "remotes.client", *args], name=WEATHER_REMOTE)

    def registered() -> bool:
        assert process.running, f"the remote's client exited:\n{process.log()}"
        return WEATHER_REMOTE in dispatch.server.remote_names(dispatch.token)

    wait_until(registered, timeout=15, interval=0.2, what="the weather-service remote to register", details=process.log)
    return process


def attach_shim(dispatch: Dispatch, agent_id: str, root: Path) -> ShimProcess:
    """A real ``machines.shim`` (admin's token, ``--root root``) attached to the agent's
    machine session (its id: an agent's MCP tools act there), once connected."""
    return dispatch.inst.shim("local-pc", root, "--session", agent_id)


def session_gone(dispatch: Dispatch, agent_id: str) -> bool:
    """Whether the agent's tmux session no longer exists (the private server may be gone too)."""
    done = subprocess.run(
        ["tmux", "-L", dispatch.socket, "has-session", "-t", f"dispatch_{agent_id}"],
        capture_output=True,
        check=False,
        timeout=10,
    )
    return done.returncode != 0
