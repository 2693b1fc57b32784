"""The hook client's wait for an approval (agents/hook_client.py;
docs/agents.md#approvals), against a scripted local HTTP server: it reads the approval until its output
comes and prints it, runs as the CLI runs it (a subprocess, standard library only), and
gives up printing nothing — the CLI's own dialog then asks — when Dispatch refuses the
token, forgets the approval, or stays silent past the approval's wait."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agents import cli_hooks, hook_client

PENDING = {"id": "apr_0123456789ab", "status": "pending", "wait_seconds": 30, "poll_seconds": 0.2}
ALLOW = {"hookSpecificOutput": {"hookEventName": "PermissionRequest", "decision": {"behavior": "allow"}}}
Script = Callable[[str, str, int], tuple[int, Any]]  # (method, path, n-th read) -> (status, body)


@pytest.fixture
def scripted() -> Iterator[Callable[[Script], tuple[str, list[tuple[str, str]]]]]:
    servers: list[ThreadingHTTPServer] = []

    def start(script: Script) -> tuple[str, list[tuple[str, str]]]:
        seen: list[tuple[str, str]] = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                if method == "POST":
                    self.rfile.read(int(self.headers["Content-Length"]))
                seen.append((method, self.path))
                status, body = script(method, self.path, sum(1 for m, _ in seen if m == "GET"))
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self) -> None:
                self._answer("POST")

            def do_GET(self) -> None:
                self._answer("GET")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", seen

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def run_hook(url: str) -> subprocess.CompletedProcess[str]:
    command = cli_hooks.hook_command("PermissionRequest")
    command = command.replace(shlex.quote(sys.executable), f"{shlex.quote(sys.executable)} -S", 1)
    env = {
        "PATH": "/usr/bin:/bin",
        "DISPATCH_URL": url,
        "DISPATCH_AGENT_ID": "agt_0123456789ab",
        "DISPATCH_MCP_TOKEN": "tok",
    }
    payload = json.dumps({"tool_name": "Bash", "tool_input": {"command": "ls"}})
    return subprocess.run(["sh", "-c", command], input=payload, env=env, capture_output=True, text=True, timeout=30)


def test_the_hook_waits_for_the_answer_and_prints_it(scripted: Any) -> None:
    def script(method: str, path: str, reads: int) -> tuple[int, Any]:
        if method == "POST":
            return 200, {"output": None, "approval": PENDING}
        if reads < 3:
            return 200, {"output": None, "approval": PENDING}
        return 200, {"output": ALLOW, "approval": {**PENDING, "status": "allowed"}}

    url, seen = scripted(script)
    done = run_hook(url)
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout) == ALLOW
    reads = [path for method, path in seen if method == "GET"]
    assert reads == ["/api/v1/agents/agt_0123456789ab/hooks/approvals/apr_0123456789ab"] * 3


def test_a_refused_token_while_waiting_prints_nothing_at_once(scripted: Any) -> None:
    def script(method: str, path: str, reads: int) -> tuple[int, Any]:
        if method == "POST":
            return 200, {"output": None, "approval": PENDING}
        return 401, {"error": {"code": "AUTHENTICATION_FAILED", "message": "revoked", "details": {}}}

    url, seen = scripted(script)
    done = run_hook(url)
    assert (done.returncode, done.stdout) == (0, "")
    assert "401" in done.stderr and len([m for m, _ in seen if m == "GET"]) == 1


def test_a_silent_dispatch_is_given_up_after_the_wait_and_its_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    reads: list[str] = []

    def sleep(seconds: float) -> None:
        now[0] += seconds

    def unreachable(url: str, token: str, body: bytes | None = None) -> Any:
        reads.append(url)
        raise OSError("connection refused")

    monkeypatch.setattr(hook_client, "_call", unreachable)
    output = hook_client.wait_for_answer(
        "http://x/approvals/a",
        "tok",
        {**PENDING, "wait_seconds": 5, "poll_seconds": 1.0},
        sleep=sleep,
        clock=lambda: now[0],
    )
    assert output is None
    assert now[0] >= 5 + hook_client.GRACE and len(reads) == int(5 + hook_client.GRACE)
