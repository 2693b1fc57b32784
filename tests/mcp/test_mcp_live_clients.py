"""Public MCP clients running a live command on a real shim through a real ``serve``
(docs/live-operations.md#mcp-progress-and-cancellation): the Python SDK's client and the
official TypeScript SDK (tests/clients/mcp_live_client.mjs) receive
``notifications/progress`` while ``local_pc_execute_command`` runs (progress = bytes of
output so far, message = the latest line), and a TypeScript ``AbortSignal`` — the SDK POSTs
``notifications/cancelled`` on its own, stateless, so it is matched by (token, request id) —
stops the command on the machine: its process ends, nothing stays in flight, the file it
would have written after sleeping never appears. One server and one shim for the module.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.infra import Instance, Server, ShimProcess, instance, wait_until
from tests.mcp.test_mcp_endpoint import mcp_client, text_of
from tests.mcp.test_mcp_typescript_client import CLIENTS, NodeClient, node_or_skip

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SCRIPT = CLIENTS / "mcp_live_client.mjs"
SLOW_LINES = "for i in 1 2 3 4; do echo step$i; sleep 0.4; done"


@dataclass
class Live:
    instance: Instance
    server: Server
    shim: ShimProcess
    root: Path
    session: str = "default"  # a user token's MCP session (docs/mcp.md#tools)

    @property
    def mcp_url(self) -> str:
        return f"{self.server.url}/mcp"

    @property
    def token(self) -> str:
        return self.instance.admin_token

    def in_flight(self) -> list[dict[str, Any]]:
        response = httpx.get(
            f"{self.server.url}/api/v1/sessions/{self.session}/ops",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )
        assert response.status_code == 200, response.text
        return list(response.json()["operations"])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("live-mcp-root")
    with instance() as inst:
        server = inst.serve()
        shim = inst.shim("mcp-box", root, "--session", "default")
        yield Live(instance=inst, server=server, shim=shim, root=root)


class LiveNodeClient(NodeClient):
    """``node mcp_live_client.mjs <url> <token> <mode> <arguments>``, read as ``NodeClient`` reads."""

    def __init__(self, node: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [node, str(SCRIPT), *args], cwd=CLIENTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, daemon=True).start()


async def test_the_python_sdk_client_hears_progress_while_a_command_runs(live: Live) -> None:
    heard: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        heard.append((progress, total, message))

    async with mcp_client(live.mcp_url, live.token) as client:
        result = await client.call_tool(
            "local_pc_execute_command", {"command": SLOW_LINES}, progress_callback=on_progress
        )
    assert not result.is_error, result
    answer = json.loads(text_of(result))
    assert answer["exit_code"] == 0 and answer["stdout"] == "step1\nstep2\nstep3\nstep4\n"
    assert len(heard) >= 3, heard  # one per line here: 0.4 s apart, throttled to 4/s
    assert [p for p, _, _ in heard] == sorted({p for p, _, _ in heard})  # strictly growing
    assert heard[0][2] == "step1" and heard[-1] == (24.0, None, "step4")
    assert {total for _, total, _ in heard} == {None}


def test_the_typescript_sdk_client_hears_progress_with_onprogress(live: Live) -> None:
    node = node_or_skip()
    client = LiveNodeClient(node, live.mcp_url, live.token, "progress", json.dumps({"command": SLOW_LINES}))
    try:
        client.until("initialized")
        first = client.until("progress")
        assert first["message"] == "step1" and first["progress"] == 6
        result = client.until("result", timeout=30)
        assert result["isError"] is False, result
        assert json.loads(result["text"])["stdout"] == "step1\nstep2\nstep3\nstep4\n"
        client.until("done")
        assert client.proc.wait(10) == 0, client.stderr()
    finally:
        client.stop()
    progress = [line for line in client.seen if line["step"] == "progress"]
    assert progress[-1]["message"] == "step4" and progress[-1]["progress"] == 24
    assert not [line for line in client.seen if line["step"] == "transport_error"], client.seen


def test_the_typescript_sdk_abort_cancels_the_command_on_the_machine(live: Live) -> None:
    node = node_or_skip()
    marker = live.root / f"marker-{uuid.uuid4().hex[:8]}"
    command = f"echo begun; sleep 30; touch {marker}"
    client = LiveNodeClient(node, live.mcp_url, live.token, "cancel", json.dumps({"command": command}))
    try:
        client.until("progress", timeout=30)
        aborted = client.until("aborted")
        assert "cancel" in aborted["message"].lower() or "abort" in aborted["message"].lower(), aborted
        posted = client.until("posted")["methods"]
        assert "notifications/cancelled" in posted, posted
        client.until("done")
    finally:
        client.stop()
    wait_until(lambda: live.in_flight() == [], timeout=10, what="the command to leave the in-flight list")
    wait_until(
        lambda: [r for r in live.shim.audit() if str(marker) in json.dumps(r)], timeout=10, what="the audit record"
    )
    assert not marker.exists()
    [record] = [r for r in live.shim.audit() if str(marker) in json.dumps(r)]
    assert record["result"].get("cancelled") is True, record


def test_closing_a_tool_calls_event_stream_cancels_the_command(live: Live) -> None:
    """A client that goes away (the 2026-07-28 way to cancel; any client that drops the
    connection) stops the command too: the call's handler is cancelled with its stream."""
    marker = live.root / f"marker-{uuid.uuid4().hex[:8]}"
    command = f"echo begun; sleep 30; touch {marker}"
    body = {
        "jsonrpc": "2.0",
        "id": 41,
        "method": "tools/call",
        "params": {
            "name": "local_pc_execute_command",
            "arguments": {"command": command},
            "_meta": {"progressToken": "close-me"},
        },
    }
    headers = {
        "Authorization": f"Bearer {live.token}",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-11-25",
    }
    with httpx.Client(timeout=30) as http, http.stream("POST", live.mcp_url, json=body, headers=headers) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = []
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith("data:") and "notifications/progress" in line:
                break
        assert json.loads(lines[-1][5:])["params"]["message"] == "begun", lines
        response.close()  # the client goes away mid-call
    wait_until(lambda: live.in_flight() == [], timeout=10, what="the command to leave the in-flight list")
    wait_until(
        lambda: [r for r in live.shim.audit() if str(marker) in json.dumps(r)], timeout=10, what="the audit record"
    )
    assert not marker.exists()
    [record] = [r for r in live.shim.audit() if str(marker) in json.dumps(r)]
    assert record["result"].get("cancelled") is True, record


class SharedTokenNodeClient(NodeClient):
    """``node mcp_shared_token_client.mjs <url> <token> <B's arguments> <A's arguments>``."""

    def __init__(self, node: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [node, str(CLIENTS / "mcp_shared_token_client.mjs"), *args],
            cwd=CLIENTS,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, daemon=True).start()


def test_two_typescript_clients_on_one_token_cancel_only_their_own_call(live: Live) -> None:
    """Claude Code and Cursor from one ``.mcp.json``: each SDK client numbers its requests
    from 0, so both calls have the same id; each client has its own ``Mcp-Session-Id``, and
    A's ``notifications/cancelled`` stops A's command only."""
    node = node_or_skip()
    tag = uuid.uuid4().hex[:8]
    go = live.root / f"go-{tag}"
    never = live.root / f"never-{tag}"
    command_b = f"echo begun; while [ ! -e {go} ]; do sleep 0.1; done; echo finished"
    command_a = f"echo begun; sleep 30; touch {never}"
    client = SharedTokenNodeClient(
        node,
        live.mcp_url,
        live.token,
        json.dumps({"command": command_b, "timeout_seconds": 60}),
        json.dumps({"command": command_a}),
    )
    try:
        connected = client.until("connected")
        client.until("b_running", timeout=30)
        client.until("a_running", timeout=30)
        cancelled = client.until("a_cancelled")
        assert cancelled["status"] == 202
        assert cancelled["idsA"] == cancelled["idsB"], cancelled  # the same JSON-RPC id
        # A's command is stopped: gone from the in-flight list, cancelled in the audit ...
        wait_until(
            lambda: not [op for op in live.in_flight() if str(never) in op["summary"]],
            timeout=10,
            what="A's command to leave the in-flight list",
        )
        go.touch()  # ... and only then may B's command finish
        b = client.until("b_result", timeout=30)
        client.until("done")
        assert client.proc.wait(10) == 0, client.stderr()
    finally:
        client.stop()
    assert b["isError"] is False, b
    answer = json.loads(b["text"])
    assert answer.get("cancelled") is not True and answer["exit_code"] == 0, answer
    assert answer["stdout"] == "begun\nfinished\n"
    wait_until(
        lambda: [r for r in live.shim.audit() if str(never) in json.dumps(r)], timeout=10, what="A's audit record"
    )
    assert not never.exists()
    [record] = [r for r in live.shim.audit() if str(never) in json.dumps(r)]
    assert record["result"].get("cancelled") is True, record
    sessions = {connected["sessionA"], connected["sessionB"]}
    assert None not in sessions and len(sessions) == 2, connected
