"""The official TypeScript MCP SDK client (``@modelcontextprotocol/sdk``, pinned in
tests/clients/package.json) against a real ``manage.py serve``
(docs/mcp.md#tool-list-changes): it speaks protocol 2025-11-25, opens ``GET /mcp`` after its
``notifications/initialized`` POST got 202, and must hear
``notifications/tools/list_changed`` there when a remote connects — what Claude Code, Cursor
and the MCP Inspector are built on.

``make test`` installs the client with ``npm ci`` (once, a stamp file). Without ``node``
the test is skipped locally with the install command, and fails under ``CI=true``.
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from examples.weather_service import get_forecast
from tests.backends import unavailable
from tests.infra import PYTHON, REPO, instance

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

CLIENTS = REPO / "tests" / "clients"
SCRIPT = CLIENTS / "mcp_client.mjs"
INSTALL = "apt-get install nodejs npm && make tests/clients/node_modules/.installed"
REMOTE_TOOL = "remote__weather-service__get_forecast"
ONLY_SHELL = json.dumps({"shell": {"argv": ["bash", "--norc", "-i"], "kind": "shell"}})


def node_or_skip() -> str:
    """The ``node`` binary, with the SDK installed; else skip (fail on CI) saying how to get them."""
    node = shutil.which("node")
    if node is None:
        unavailable(f"node is not installed; install it and the test clients with: {INSTALL}")
    if not (CLIENTS / "node_modules" / "@modelcontextprotocol" / "sdk" / "package.json").exists():
        unavailable(f"the test clients are not installed: {INSTALL}")
    return node


class NodeClient:
    """``node <script>`` (``mcp_client.mjs`` by default) as a subprocess; its JSON lines arrive
    as printed (``until``); ``stdin``: keep its standard input open for commands."""

    script = SCRIPT

    def __init__(self, node: str, *args: str, stdin: bool = False) -> None:
        self.proc = subprocess.Popen(
            [node, str(self.script), *args],
            cwd=CLIENTS,
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip():
                self.lines.put(json.loads(line))

    def until(self, step: str, timeout: float = 20) -> dict[str, Any]:
        """The first line of ``step``; fails on a ``failed`` line or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"node printed no {step!r} within {timeout:g}s; saw {self.seen}") from None
            self.seen.append(line)
            assert line["step"] != "failed", f"{line['message']}\nstderr: {self.stderr()}"
            if line["step"] == step:
                return line

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


def test_the_typescript_sdk_client_lists_calls_and_hears_a_remote_connect(tmp_path: Path) -> None:
    node = node_or_skip()
    # No model endpoint and no LLM CLI (whatever this computer has installed): no default type.
    with instance(DISPATCH_AGENT_TYPES=ONLY_SHELL) as inst:
        server = inst.serve()
        shim = inst.shim("ts-box", tmp_path)
        client = NodeClient(node, f"{server.url}/mcp", inst.admin_token, REMOTE_TOOL, json.dumps({"city": "Oslo"}))
        try:
            initialized = client.until("initialized")
            assert initialized["protocolVersion"] == "2025-11-25"
            assert initialized["capabilities"]["tools"] == {"listChanged": True}
            client.until("stream_open")  # the GET stream's list_changed on connect

            tools = client.until("tools")["names"]
            assert "list_machines" in tools and REMOTE_TOOL not in tools
            # The launch tool as a client lists it: expert unavailable and why, no default type
            # (never the shell), and a launch without a type refused with the types that work.
            launch = client.until("launch_tool")
            assert "Types available now: shell." in launch["description"]
            assert "expert (no model endpoint configured (set DISPATCH_LLM_BASE_URL))" in launch["description"]
            assert "No default type here: give type" in launch["description"]
            type_schema = launch["inputSchema"]["properties"]["type"]
            assert type_schema["enum"] == ["expert", "shell"]
            assert type_schema["description"].startswith("Required for a launch here")
            untyped = client.until("launch_without_type")
            assert untyped["isError"] is True
            assert untyped["text"].startswith("INVALID_REQUEST: type is required")
            assert untyped["text"].endswith("available types: shell")
            machines = client.until("machine_tool")
            assert machines["isError"] is False
            [machine] = json.loads(machines["text"])
            assert machine["machine_id"] == shim.machine_id, machine

            client.until("waiting_for_remote")
            spawned_at = time.monotonic()
            inst.spawn(
                [
                    PYTHON,
                    "-m",
                    "remotes.client",
                    "serve",
                    "examples/weather_service.py:remote",
                    "--url",
                    server.ws_url,
                    "--token",
                    inst.admin_token,
                ],
                name="weather-service",
            )
            client.until("list_changed", timeout=20)
            # Includes starting the remote client's Python process (the push itself: test_mcp_event_stream).
            print(f"TypeScript client heard list_changed {time.monotonic() - spawned_at:.2f}s after the remote started")
            assert REMOTE_TOOL in client.until("tools_after")["names"]
            called = client.until("remote_tool")
            assert called["isError"] is False, called
            assert json.loads(called["text"]) == get_forecast("Oslo")
            client.until("done")
            assert client.proc.wait(10) == 0, client.stderr()
            assert not [line for line in client.seen if line["step"] == "transport_error"], client.seen
        finally:
            client.stop()
