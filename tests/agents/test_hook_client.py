"""The hook command (agents/hook_client.py; docs/agents.md#hooks) run as the CLIs run it —
a subprocess with the event's JSON on stdin and the agent's environment — against a real
``manage.py serve``: it reports the event with the agent's token, prints Dispatch's
``output`` for the CLI, and always exits 0 (silent without Dispatch's variables, one line
on stderr when Dispatch is down or refuses)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from agents import cli_hooks
from tests.backends import free_port
from tests.infra import Instance, Server, instance

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# The agent lives on another host: this serve's CLI supervisor leaves it alone (it would
# otherwise stop a "running" agent that has no tmux session, and revoke its token).
_SETUP = """
import json
from django.contrib.auth import get_user_model
from agents import services, tokens
from agents.models import Agent
dana = get_user_model().objects.create_user("dana", password="pw-secret-123")
agent = services.agent_create(owner=dana, type="claude", name="coder", cwd={cwd!r})
Agent.objects.filter(pk=agent.pk).update(status="running", host="elsewhere.invalid")
from core.services import api_token_create
print(json.dumps({{"agent": agent.pk, "token": tokens.agent_token_mint(agent=agent),
                  "user_token": api_token_create(user=dana).raw}}))
"""
START = {"session_id": "s-1", "hook_event_name": "SessionStart", "source": "startup", "cwd": "/w"}


@dataclass
class Served:
    instance: Instance
    server: Server
    agent: str
    token: str
    user_token: str

    def agent_row(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.user_token}"}
        response = httpx.get(f"{self.server.url}/api/v1/agents/{self.agent}", headers=headers, timeout=10)
        return dict(response.json())

    def env(self, **overrides: str) -> dict[str, str]:
        return {
            "PATH": "/usr/bin:/bin",
            "DISPATCH_URL": self.server.url,
            "DISPATCH_AGENT_ID": self.agent,
            "DISPATCH_MCP_TOKEN": self.token,
            **overrides,
        }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cwd = str(tmp_path_factory.mktemp("hook-client"))
    with instance(DISPATCH_LOG_LEVEL="INFO") as inst:  # INFO: the MCP call lines below
        created = json.loads(inst.manage("shell", "-c", _SETUP.format(cwd=cwd)).stdout.strip().splitlines()[-1])
        server = inst.serve()
        yield Served(inst, server, created["agent"], created["token"], created["user_token"])


def hook(event: str, payload: Any, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the hook command as a CLI does (``hook_command`` through a shell), but with
    ``-S``: no site-packages, no virtualenv — the client must need nothing but the standard
    library (and must not import agents/types.py for the standard library's ``types``)."""
    stdin = payload if isinstance(payload, str) else json.dumps(payload)
    command = cli_hooks.hook_command(event).replace(shlex.quote(sys.executable), f"{shlex.quote(sys.executable)} -S", 1)
    assert command != cli_hooks.hook_command(event)
    return subprocess.run(
        ["sh", "-c", command],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_it_reports_the_event_to_dispatch_with_the_agents_token(served):
    done = hook("SessionStart", START, served.env())

    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    row = served.agent_row()
    assert row["latest_event_type"] == "system" and row["latest_event_message"] == "ready (SessionStart)"

    done = hook("PreToolUse", {"tool_name": "Bash", "tool_input": {"command": "ls"}}, served.env())
    assert (done.returncode, done.stdout) == (0, "")
    assert served.agent_row()["latest_event_message"] == "tool: Bash"


def test_stdin_that_is_not_json_is_reported_without_a_payload(served):
    done = hook("Stop", "not json {", served.env())

    assert done.returncode == 0 and done.stdout == ""
    assert "not JSON" in done.stderr and done.stderr.count("\n") == 1
    assert served.agent_row()["latest_event_message"] == "turn finished"


def test_without_dispatchs_variables_it_does_nothing_silently(served):
    before = served.agent_row()["latest_event_at"]
    for missing in ("DISPATCH_URL", "DISPATCH_AGENT_ID", "DISPATCH_MCP_TOKEN"):
        env = served.env()
        del env[missing]
        done = hook("Stop", {"last_assistant_message": "x"}, env)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert served.agent_row()["latest_event_at"] == before


def test_a_refused_token_exits_0_with_one_line_on_stderr(served):
    done = hook("Stop", {}, served.env(DISPATCH_MCP_TOKEN=served.user_token))

    assert done.returncode == 0 and done.stdout == ""
    assert "403" in done.stderr and done.stderr.count("\n") == 1


def test_when_dispatch_is_down_it_exits_0_silently_on_stdout():
    env = {
        "PATH": "/usr/bin:/bin",
        "DISPATCH_URL": f"http://127.0.0.1:{free_port()}",
        "DISPATCH_AGENT_ID": "agt_000000000000",
        "DISPATCH_MCP_TOKEN": "t" * 43,
    }
    done = hook("UserPromptSubmit", {"prompt": "hello"}, env)

    assert done.returncode == 0 and done.stdout == ""
    assert "could not report" in done.stderr and done.stderr.count("\n") == 1


@pytest.fixture
def answering() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A stand-in for Dispatch's hook route answering ``{"output": {...}}`` (the real route
    answers null until approvals exist): what the client must print for the CLI."""
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append({"path": self.path, "auth": self.headers["Authorization"], "body": body})
            answer = json.dumps({"output": {"hookSpecificOutput": {"decision": {"behavior": "allow"}}}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


def test_a_non_null_output_is_printed_as_json_for_the_cli(answering):
    url, received = answering
    env = {"DISPATCH_URL": url, "DISPATCH_AGENT_ID": "agt_0123456789ab", "DISPATCH_MCP_TOKEN": "tok"}

    done = hook("PermissionRequest", {"tool_name": "Bash"}, env)

    assert done.returncode == 0 and done.stderr == ""
    assert json.loads(done.stdout) == {"hookSpecificOutput": {"decision": {"behavior": "allow"}}}
    assert received == [
        {
            "path": "/api/v1/agents/agt_0123456789ab/hooks",
            "auth": "Bearer tok",
            "body": {"event": "PermissionRequest", "payload": {"tool_name": "Bash"}},
        }
    ]


# --- the agent's MCP calls (dispatch/mcp/server.py; docs/mcp.md) ----------------------------------
# The served agent's own token on /mcp, as its CLI uses it: each tools/call is one INFO line
# and one system event on the agent's timeline, without the arguments.


async def test_each_mcp_call_of_an_agent_is_one_log_line_and_one_timeline_event(served):
    from tests.mcp.test_mcp_endpoint import mcp_client

    before = served.agent_row()
    secret = "agt_0000deadbeef"  # an argument: it must appear nowhere in the log
    async with mcp_client(f"{served.server.url}/mcp", served.token) as client:
        listed = await client.call_tool("list_agents", {})
        missing = await client.call_tool("get_agent_history", {"agent_id": secret})
    assert not listed.is_error and missing.is_error

    headers = {"Authorization": f"Bearer {served.user_token}"}
    events = httpx.get(f"{served.server.url}/api/v1/agents/{served.agent}/events", headers=headers, timeout=10)
    calls = [e for e in reversed(events.json()["events"]) if e["message"].startswith("MCP tool")]
    assert [(e["type"], e["message"], e["metadata"]["tool"], e["metadata"]["ok"]) for e in calls] == [
        ("system", "MCP tool list_agents", "list_agents", True),
        ("system", "MCP tool get_agent_history", "get_agent_history", False),
    ]
    assert all(isinstance(e["metadata"]["ms"], int) and e["metadata"]["ms"] >= 0 for e in calls)
    assert set(calls[0]["metadata"]) == {"tool", "ok", "ms"}
    after = served.agent_row()  # a side note: what the agent last reported stays its latest event
    assert (after["latest_event_type"], after["latest_event_message"]) == (
        before["latest_event_type"],
        before["latest_event_message"],
    )

    log = served.server.log()
    lines = [line for line in log.splitlines() if "MCP tool" in line and served.agent in line]
    assert len(lines) == 2, lines
    assert f"MCP tool list_agents by agent {served.agent}: ok in " in lines[0] and lines[0].endswith(" ms")
    assert f"MCP tool get_agent_history by agent {served.agent}: error NOT_FOUND in " in lines[1]
    assert secret not in log
