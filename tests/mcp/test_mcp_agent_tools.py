"""The agent tools and agent tokens on ``/mcp``, against a real ``manage.py serve`` driven
by the SDK's streamable-HTTP client (docs/mcp.md#tools, agents/tools.py).

One server for the module: ``bob`` has the expert agent ``boss`` (whose agent token the
tests use) and ``eve`` an agent of her own. The server's model endpoint is the scripted
double (``tests/agents/llm_double.py``), so expert runs it queues really run; its CLI
agents go to a private tmux server (``DISPATCH_TMUX_SOCKET``), killed at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from tests.agents.llm_double import LlmDouble, answer
from tests.infra import Instance, Server, instance, wait_until
from tests.mcp.test_mcp_endpoint import AGENT_TOOLS, INITIALIZE, MACHINE_TOOLS, mcp_client, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_SETUP = """
import json
from django.contrib.auth import get_user_model
from agents import services
from agents.tokens import agent_token_mint
from core.services import api_token_create
User = get_user_model()
bob = User.objects.create_user("bob", password="pw-secret-123")
eve = User.objects.create_user("eve", password="pw-secret-123")
boss = services.agent_create(owner=bob, type="expert", name="boss", cwd={cwd!r})
hidden = services.agent_create(owner=eve, type="expert", name="hidden", cwd={cwd!r})
print(json.dumps({{
    "bob": api_token_create(user=bob).raw,
    "eve": api_token_create(user=eve).raw,
    "boss": boss.pk,
    "boss_token": agent_token_mint(agent=boss),
    "hidden": hidden.pk,
}}))
"""


@dataclass
class Live:
    instance: Instance
    server: Server
    llm: LlmDouble
    cwd: str
    bob: str  # bob's API token
    eve: str
    boss: str  # bob's expert agent
    boss_token: str  # its agent token
    hidden: str  # eve's agent
    socket: str  # the server's private tmux server

    @property
    def mcp_url(self) -> str:
        return f"{self.server.url}/mcp"

    def api(self, path: str, token: str | None = None) -> Any:
        response = self.server.get(path, token or self.bob)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    socket = f"dispatch-mcp-tests-{uuid.uuid4().hex[:10]}"
    llm = LlmDouble().start()
    try:
        with instance() as inst:
            cwd = inst.env["DISPATCH_DATA_DIR"]
            created = json.loads(inst.manage("shell", "-c", _SETUP.format(cwd=cwd)).stdout.strip().splitlines()[-1])
            server = inst.serve(
                DISPATCH_LLM_BASE_URL=llm.url, DISPATCH_LLM_MODEL="double-1", DISPATCH_TMUX_SOCKET=socket
            )
            yield Live(instance=inst, server=server, llm=llm, cwd=cwd, socket=socket, **created)
    finally:
        llm.stop()
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)
        (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / socket).unlink(missing_ok=True)


async def call(live: Live, token: str, name: str, arguments: dict[str, Any]) -> tuple[bool, str]:
    async with mcp_client(live.mcp_url, token) as client:
        result = await client.call_tool(name, arguments)
    return bool(result.is_error), text_of(result)


async def ok(live: Live, token: str, name: str, arguments: dict[str, Any]) -> Any:
    failed, text = await call(live, token, name, arguments)
    assert not failed, text
    return json.loads(text)


# --- toolsets and authentication ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_an_agent_token_gets_dispatch_event_and_a_user_token_does_not(live: Live, mode: str) -> None:
    async with mcp_client(live.mcp_url, live.boss_token, mode) as client:
        as_agent = [tool.name for tool in (await client.list_tools()).tools]
    async with mcp_client(live.mcp_url, live.bob, mode) as client:
        as_user = [tool.name for tool in (await client.list_tools()).tools]
        with pytest.raises(MCPError) as raised:
            await client.call_tool("dispatch_event", {"type": "done", "message": "x"})
    assert set(as_agent) == MACHINE_TOOLS | AGENT_TOOLS | {"dispatch_event"}
    assert set(as_user) == MACHINE_TOOLS | AGENT_TOOLS
    assert len(as_agent) == len(set(as_agent))
    assert raised.value.code == INVALID_PARAMS


async def test_dispatch_event_with_an_agent_token_lands_on_the_agents_timeline(live: Live) -> None:
    event = await ok(live, live.boss_token, "dispatch_event", {"type": "waiting_user", "message": "which branch?"})

    assert (event["agent_id"], event["type"]) == (live.boss, "waiting_user")
    events = live.api(f"/api/v1/agents/{live.boss}/events")["events"]
    assert (events[0]["type"], events[0]["message"]) == ("waiting_user", "which branch?")
    agent = live.api(f"/api/v1/agents/{live.boss}")
    assert agent["latest_event_type"] == "waiting_user"


async def test_dispatch_event_with_bad_arguments_is_an_invalid_request_result(live: Live) -> None:
    failed, text = await call(live, live.boss_token, "dispatch_event", {"type": "system", "message": "x" * 100_000})
    assert failed and text.startswith("INVALID_REQUEST: ") and len(text) < 2_000


async def test_an_agent_tokens_machine_session_is_the_agent(live: Live, tmp_path: Path) -> None:
    shim = live.instance.shim("agent-box", tmp_path, "--session", live.boss, token=live.bob, state_dir=tmp_path / "s")
    try:
        as_agent = await ok(live, live.boss_token, "list_machines", {})
        as_user = await ok(live, live.bob, "list_machines", {})
        async with mcp_client(live.mcp_url, live.boss_token) as client:
            described = {tool.name: tool.description or "" for tool in (await client.list_tools()).tools}
            ran = await client.call_tool("local_pc_execute_command", {"argv": ["pwd"]})
            # An agent token acts only in its own session (docs/mcp.md#tools).
            elsewhere = await client.call_tool("local_pc_execute_command", {"argv": ["pwd"], "session_id": "default"})
    finally:
        shim.stop()
    assert [machine["machine_id"] for machine in as_agent] == [shim.machine_id]
    assert as_user == []  # the user token's own session is "default"
    assert "Attached machine: agent-box." in described["local_pc_execute_command"]
    assert not ran.is_error, ran
    assert elsewhere.is_error
    assert text_of(elsewhere).startswith("PERMISSION_DENIED: an agent token acts only in its own session")
    assert ran.structured_content is not None
    assert ran.structured_content["stdout"].strip() == str(tmp_path.resolve())


def test_a_revoked_or_stopped_agents_token_is_refused_with_401(live: Live) -> None:
    setup = (
        "from agents import services; from agents.tokens import agent_token_mint; "
        "from django.contrib.auth import get_user_model; "
        f"a = services.agent_create(owner=get_user_model().objects.get(username='bob'), type='expert', "
        f"name='short-lived', cwd={live.cwd!r}); print(a.pk); print(agent_token_mint(agent=a))"
    )
    agent_id, token = live.instance.manage("shell", "-c", setup).stdout.split()[-2:]
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {token}"}
    assert httpx.post(live.mcp_url, json=INITIALIZE, headers=headers, timeout=10).status_code == 200

    live.instance.manage(
        "shell",
        "-c",
        "from agents.tokens import agent_tokens_revoke; from agents.models import Agent; "
        f"agent_tokens_revoke(agent=Agent.objects.get(pk={agent_id!r}))",
    )
    refused = httpx.post(live.mcp_url, json=INITIALIZE, headers=headers, timeout=10)
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'
    assert refused.json()["error"]["code"] == "AUTHENTICATION_FAILED"


# --- list_agents / get_agent_history ---------------------------------------------------------


async def test_list_agents_and_history_are_scoped_to_the_tokens_user(live: Live) -> None:
    bobs = await ok(live, live.boss_token, "list_agents", {})
    eves = await ok(live, live.eve, "list_agents", {})
    own = await ok(live, live.boss_token, "get_agent_history", {})  # defaults to the calling agent
    failed, text = await call(live, live.boss_token, "get_agent_history", {"agent_id": live.hidden})
    user_failed, user_text = await call(live, live.bob, "get_agent_history", {"agent_id": live.hidden})

    assert live.boss in {agent["id"] for agent in bobs} and live.hidden not in {agent["id"] for agent in bobs}
    assert [agent["id"] for agent in eves] == [live.hidden]
    assert own["agent"]["id"] == live.boss
    assert failed and text.startswith("NOT_FOUND: ")
    assert user_failed and user_text.startswith("NOT_FOUND: ")


# --- messages ---------------------------------------------------------------------------------


async def test_a_message_to_an_expert_agent_runs_it_and_message_status_says_delivered(live: Live) -> None:
    live.llm.script = [answer("logs summarised")]
    target = await ok(
        live, live.bob, "dispatch_launch_agent", {"name": "reader", "prompt": "", "type": "expert", "child": False}
    )

    sent = await ok(live, live.boss_token, "dispatch_send_message", {"target": "reader", "message": "summarise logs"})
    status = await ok(live, live.bob, "message_status", {"message_id": sent["message_id"]})
    outsider_failed, outsider_text = await call(live, live.eve, "message_status", {"message_id": sent["message_id"]})

    assert (sent["status"], sent["recipient"]) == ("delivered", target["id"])
    assert status["status"] == "delivered" and status["delivered_at"]
    assert outsider_failed and outsider_text.startswith("NOT_FOUND: ")

    def finished_run() -> Any:
        runs = live.api(f"/api/v1/agents/{target['id']}/runs")["runs"]
        return runs if runs and runs[0]["status"] == "succeeded" else None

    runs = wait_until(finished_run, timeout=20, what="the queued run to finish", details=live.server.log)
    assert (runs[0]["input"]["instruction"], runs[0]["output"]) == ("summarise logs", "logs summarised")


async def test_dispatch_send_message_names_the_problem_with_a_target(live: Live) -> None:
    unknown = await call(live, live.bob, "dispatch_send_message", {"target": "nobody-here", "message": "hi"})
    peer = await call(live, live.bob, "dispatch_send_message", {"target": "laptop:agt_0123456789ab", "message": "hi"})
    theirs = await call(live, live.bob, "dispatch_send_message", {"target": live.hidden, "message": "hi"})

    assert unknown[0] and unknown[1].startswith("NOT_FOUND: ") and "boss" in unknown[1]
    assert peer[0] and peer[1].startswith("INVALID_REQUEST: ") and "linked instance" in peer[1]
    assert theirs[0] and theirs[1].startswith("NOT_FOUND: ")


# --- launching ----------------------------------------------------------------------------------


async def test_an_agent_launches_an_expert_child_recorded_as_its_launcher(live: Live) -> None:
    live.llm.script = [answer("child done")]
    launched = await ok(live, live.boss_token, "dispatch_launch_agent", {"name": "child", "prompt": "do the thing"})

    agent = live.api(f"/api/v1/agents/{launched['id']}")
    assert agent["type"] == "expert"  # the default: this server has a model endpoint
    assert (agent["parent"], agent["launched_by"], agent["cwd"]) == (live.boss, live.boss, live.cwd)

    def succeeded() -> Any:
        runs = live.api(f"/api/v1/agents/{launched['id']}/runs")["runs"]
        return runs if runs and runs[0]["status"] == "succeeded" else None

    runs = wait_until(succeeded, timeout=20, what="the child's first run", details=live.server.log)
    assert runs[0]["output"] == "child done"


async def test_an_agent_launches_a_shell_agent_in_tmux(live: Live) -> None:
    arguments = {"name": "builder", "prompt": "echo built-$((6*7))", "type": "shell"}
    launched = await ok(live, live.boss_token, "dispatch_launch_agent", arguments)

    agent = live.api(f"/api/v1/agents/{launched['id']}")
    assert (agent["type"], agent["status"]) == ("shell", "running")
    assert (agent["parent"], agent["launched_by"]) == (live.boss, live.boss)
    session = f"dispatch_{launched['id']}"

    def pane() -> str:
        shown = subprocess.run(
            ["tmux", "-L", live.socket, "capture-pane", "-p", "-t", session],
            capture_output=True,
            text=True,
            check=False,
        )
        return shown.stdout

    wait_until(lambda: "built-42" in pane(), timeout=10, what="the prompt's output in the pane", details=pane)


async def test_a_launch_with_a_location_is_refused_while_nothing_is_linked(live: Live) -> None:
    arguments = {"name": "far", "prompt": "hi", "type": "expert", "location": "laptop"}
    failed, text = await call(live, live.boss_token, "dispatch_launch_agent", arguments)
    assert failed and text.startswith("INVALID_REQUEST: no linked instance")
