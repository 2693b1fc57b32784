"""Approvals with the REAL Claude Code and codex (tests/clients) launched by a real
``manage.py serve`` against the fake model (docs/agents.md#approvals): a ``Bash`` request
in manual mode becomes an approval listed over REST while the agent shows ``waiting for
approval``; approving it runs the command and the timeline names who approved; a deny's
message is what the model receives; a policy allowing ``Read`` answers without asking; a
supervising agent approves over MCP with its own token; nobody answering gives the
agent's default (deny) when the approval expires.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agents.types import DEFAULT_AGENT_TYPES
from tests.agents.fake_model import FakeModel, call, say
from tests.agents.real_cli.conftest import API_KEY, Run, cli_or_skip
from tests.agents.real_cli.dispatch_fixtures import Dispatch, attach_shim, dispatch_serve  # noqa: F401 - a fixture
from tests.agents.real_cli.test_dispatch_hooks_claude import Agent, _tool_results, launch
from tests.mcp.test_mcp_endpoint import mcp_client, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

QUICK_TIMEOUT = 4  # seconds: the approval timeout of the *-quick types

# A supervising agent of admin's, on no host this serve supervises (so it is left alone),
# with its own token: what an agent's MCP client holds as DISPATCH_MCP_TOKEN.
_SUPERVISOR = """
import json
from django.contrib.auth import get_user_model
from agents import services, tokens
from agents.models import Agent
admin = get_user_model().objects.get(username="admin")
boss = services.agent_create(owner=admin, type="claude-ask", name="boss", cwd={cwd!r})
Agent.objects.filter(pk=boss.pk).update(status="running", host="elsewhere.invalid")
print(json.dumps({{"agent": boss.pk, "token": tokens.agent_token_mint(agent=boss)}}))
"""


@pytest.fixture
def claude(
    fake_model: FakeModel,
    run: Run,
    dispatch_serve: Callable[[dict[str, Any]], Dispatch],  # noqa: F811 - the fixture imported above
) -> Dispatch:
    """Dispatch with the pinned Claude Code in manual mode (``--permission-mode default``:
    it asks before Bash) as ``claude-ask``, and as ``claude-quick`` whose approvals expire
    after ``QUICK_TIMEOUT`` seconds."""
    program = cli_or_skip("claude")
    default = DEFAULT_AGENT_TYPES["claude"]
    env = {"HOME": str(run.home), "ANTHROPIC_BASE_URL": fake_model.url, "ANTHROPIC_API_KEY": API_KEY}
    asking = {
        **default,
        "argv": [program, *default["argv"][1:]],  # the default argv: manual mode
        "full_access_argv": [program, *default["full_access_argv"][1:]],
        "env": env,
        "hooks": "claude",
    }
    quick = {**asking, "approval_timeout": QUICK_TIMEOUT}
    return dispatch_serve({"claude-ask": asking, "claude-quick": quick})


def approvals(agent: Agent, status: str = "pending") -> list[dict[str, Any]]:
    response = agent.api("GET", "/api/v1/approvals", params={"status": status, "agent_id": agent.id})
    assert response.status_code == 200, response.text
    return list(response.json()["approvals"])


def wait_pending(agent: Agent) -> dict[str, Any]:
    return dict(agent.wait(lambda: (found := approvals(agent)) and found[0], "a pending approval"))


def answer(agent: Agent, approval_id: str, decision: str, message: str = "") -> dict[str, Any]:
    body = {"decision": decision, "message": message}
    response = agent.api("POST", f"/api/v1/approvals/{approval_id}/answer", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def last_tool_result(fake_model: FakeModel) -> str:
    """The newest tool_result the model received (the whole conversation is in each request)."""
    texts = _tool_results([r for r in fake_model.received("/v1/messages") if r.agent_loop][-1].body)
    assert texts, "the model received no tool result"
    return texts[-1]


def test_a_bash_request_waits_for_approval_and_runs_once_approved_over_rest(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(call("Bash", {"command": "echo ok > approved.txt", "description": "write"}), say("after-yes"))
    agent = launch(claude, "claude-ask", run, "write approved marker-p1")

    pending = wait_pending(agent)
    assert (pending["tool_name"], pending["tool_summary"]) == ("Bash", "echo ok > approved.txt")
    agent.wait(lambda: agent.row()["latest_event_type"] == "blocked", "the agent waiting for approval")
    assert agent.row()["latest_event_message"] == "approval requested: Bash `echo ok > approved.txt`"
    assert not (run.workdir / "approved.txt").exists()

    answered = answer(agent, pending["id"], "allow_once")
    assert answered["status"] == "allowed" and answered["answered_by_user"] == "admin"
    agent.wait_event("done", "turn finished")
    assert (run.workdir / "approved.txt").read_text() == "ok\n"
    said = [(e["type"], e["message"]) for e in agent.events() if e["metadata"].get("approval_id") == pending["id"]]
    assert said == [
        ("blocked", "approval requested: Bash `echo ok > approved.txt`"),
        ("working", "approved once by admin: Bash `echo ok > approved.txt`"),
    ]
    assert "Error" not in last_tool_result(fake_model)


def test_always_allow_makes_a_dispatch_rule_and_writes_nothing_into_the_project(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(
        call("Bash", {"command": "echo one >> always.txt", "description": "append"}),
        call("Bash", {"command": "echo one >> always.txt", "description": "append again"}),
        say("after-always"),
    )
    agent = launch(claude, "claude-ask", run, "append twice marker-p9")

    pending = wait_pending(agent)
    answered = answer(agent, pending["id"], "allow_always")
    assert answered["status"] == "allowed"
    agent.wait_event("done", "turn finished")
    # The same call again was answered without a person: Claude's session rule or Dispatch's.
    assert (run.workdir / "always.txt").read_text() == "one\none\n"
    assert [a["id"] for a in approvals(agent, "pending")] == []
    rules = agent.api("GET", "/api/v1/approval-rules").json()["rules"]
    assert [(r["tool"], r["action"]) for r in rules] == [("Bash", "allow")], rules
    # Claude got its suggestion back for the session only: nothing in the project's settings.
    assert not (run.workdir / ".claude" / "settings.local.json").exists()


def test_a_deny_message_is_what_the_model_receives(claude: Dispatch, fake_model: FakeModel, run: Run) -> None:
    fake_model.queue(call("Bash", {"command": "echo no > denied.txt", "description": "write"}), say("after-no"))
    agent = launch(claude, "claude-ask", run, "write denied marker-p2")

    pending = wait_pending(agent)
    answer(agent, pending["id"], "deny", "not here: write it under /srv/scratch instead")
    agent.wait_event("done", "turn finished")
    assert "not here: write it under /srv/scratch instead" in last_tool_result(fake_model)
    assert not (run.workdir / "denied.txt").exists()
    agent.wait_event(
        "working", "denied by admin: Bash `echo no > denied.txt` — not here: write it under /srv/scratch instead"
    )


def test_a_policy_allowing_read_answers_without_asking(claude: Dispatch, fake_model: FakeModel, run: Run) -> None:
    # A file outside the working folder: Claude Code asks before reading it in manual mode.
    outside = run.home / "outside-notes.txt"
    outside.write_text("the secret word is marmalade\n")
    rule = httpx.post(
        f"{claude.server.url}/api/v1/approval-rules",
        json={"tool": "Read", "action": "allow"},
        headers={"Authorization": f"Bearer {claude.token}"},
        timeout=10,
    )
    assert rule.status_code == 201, rule.text
    fake_model.queue(call("Read", {"file_path": str(outside)}), say("after-read"))
    agent = launch(claude, "claude-ask", run, "read the notes marker-p3")

    agent.wait_event("done", "turn finished")
    assert "marmalade" in last_tool_result(fake_model)
    decided = approvals(agent, "allowed")
    assert [(a["tool_name"], a["tool_summary"], a["rule"]["id"]) for a in decided] == [
        ("Read", str(outside), rule.json()["id"])
    ]
    assert not approvals(agent, "pending")
    assert not [e for e in agent.events() if e["type"] == "blocked"]  # nobody was asked


def test_a_supervising_agent_approves_over_mcp_with_its_own_token(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    made = claude.inst.manage("shell", "-c", _SUPERVISOR.format(cwd=str(run.workdir)))
    boss = json.loads(made.stdout.strip().splitlines()[-1])
    fake_model.queue(call("Bash", {"command": "echo boss > boss.txt", "description": "write"}), say("after-boss"))
    agent = launch(claude, "claude-ask", run, "write boss marker-p4")
    pending = wait_pending(agent)

    async def supervise() -> tuple[Any, Any]:
        async with mcp_client(f"{claude.server.url}/mcp", boss["token"]) as client:
            listed = json.loads(text_of(await client.call_tool("list_approvals", {})))
            answered = await client.call_tool(
                "answer_approval", {"approval_id": pending["id"], "decision": "allow_once"}
            )
            return listed, json.loads(text_of(answered))

    listed, answered = anyio.run(supervise)
    assert [a["approval_id"] for a in listed["approvals"]] == [pending["id"]]
    assert answered["answered_by"] == "agent boss (supervisor)"
    agent.wait_event("done", "turn finished")
    assert (run.workdir / "boss.txt").read_text() == "boss\n"
    shown = agent.api("GET", f"/api/v1/approvals/{pending['id']}").json()
    assert (shown["answered_by_agent_id"], shown["answered_by_user"]) == (boss["agent"], None)
    agent.wait_event("working", "approved once by agent boss (supervisor): Bash `echo boss > boss.txt`")


def test_nobody_answering_gives_the_default_deny_when_it_expires(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(call("Bash", {"command": "echo late > late.txt", "description": "write"}), say("after-expiry"))
    agent = launch(claude, "claude-quick", run, "write late marker-p5")

    pending = wait_pending(agent)
    expiry = "expired: denied (default): Bash `echo late > late.txt`"
    agent.wait(lambda: any(e["message"] == expiry for e in agent.events()), "the expiry", timeout=QUICK_TIMEOUT + 25)
    agent.wait_event("done", "turn finished")
    assert "Nobody answered the permission request in time" in last_tool_result(fake_model)
    assert not (run.workdir / "late.txt").exists()
    expired = agent.api("GET", f"/api/v1/approvals/{pending['id']}").json()
    assert (expired["status"], expired["decision"], expired["answered_by"]) == ("expired", "deny", "timeout")


# --- codex: its PermissionRequest hook fires where it would ask for an escalation -----------------


@pytest.fixture
def codex(
    fake_model: FakeModel,
    run: Run,
    dispatch_serve: Callable[[dict[str, Any]], Dispatch],  # noqa: F811 - the fixture imported above
) -> Dispatch:
    """Dispatch with the pinned codex (its default approval mode: it asks before a command
    that needs to leave the sandbox) as ``codex`` and ``codex-quick`` (approvals expire
    after ``QUICK_TIMEOUT`` seconds), its CODEX_HOME naming the fake model (FINDINGS.md 3a)."""
    program = cli_or_skip("codex")
    home = run.home / ".codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "gpt-fake"\nmodel_provider = "fake"\n\n[model_providers.fake]\nname = "fake"\n'
        f'base_url = "{fake_model.url}/v1"\nwire_api = "responses"\nenv_key = "FAKE_MODEL_API_KEY"\n'
    )
    default = DEFAULT_AGENT_TYPES["codex"]
    spec = {
        **default,
        "argv": [program, *default["argv"][1:]],
        "full_access_argv": [program, *default["full_access_argv"][1:]],
        "env": {"HOME": str(run.home), "CODEX_HOME": str(home), "FAKE_MODEL_API_KEY": "fake-key"},
    }
    return dispatch_serve({"codex": spec, "codex-quick": {**spec, "hooks": "codex", "approval_timeout": QUICK_TIMEOUT}})


def escalated(command: str) -> Any:
    """codex's shell tool asking to run ``command`` outside its sandbox: what makes it ask."""
    return call(
        "exec_command",
        {"cmd": command, "sandbox_permissions": "require_escalated", "justification": "write outside the workspace"},
    )


def codex_output(fake_model: FakeModel) -> str:
    """The newest function_call_output codex sent the model."""
    body = [r for r in fake_model.received("/v1/responses") if r.agent_loop][-1].body
    outputs = [item.get("output") for item in body.get("input", []) if item.get("type") == "function_call_output"]
    assert outputs, "the model received no function_call_output"
    return json.dumps(outputs[-1], ensure_ascii=False)


def test_codex_waits_for_approval_and_runs_once_approved(codex: Dispatch, fake_model: FakeModel, run: Run) -> None:
    target = run.home / "codex-approved.txt"
    fake_model.queue(escalated(f"echo yes > {target}"), say("after-yes"))
    agent = launch(codex, "codex", run, "write approved marker-q1")

    pending = wait_pending(agent)
    assert (pending["tool_name"], pending["tool_summary"]) == ("Bash", f"echo yes > {target}")
    assert agent.row()["latest_event_type"] == "blocked"
    answer(agent, pending["id"], "allow_once")
    agent.wait_event("done", "turn finished")
    assert target.read_text() == "yes\n"
    agent.wait_event("working", f"approved once by admin: Bash `echo yes > {target}`")


def test_codex_gets_the_deny_message(codex: Dispatch, fake_model: FakeModel, run: Run) -> None:
    target = run.home / "codex-denied.txt"
    fake_model.queue(escalated(f"echo no > {target}"), say("after-no"))
    agent = launch(codex, "codex", run, "write denied marker-q2")

    answer(agent, wait_pending(agent)["id"], "deny", "stay inside the workspace")
    agent.wait_event("done", "turn finished")
    assert "stay inside the workspace" in codex_output(fake_model)
    assert not target.exists()


def test_codex_nobody_answering_gives_the_default_deny(codex: Dispatch, fake_model: FakeModel, run: Run) -> None:
    target = run.home / "codex-late.txt"
    fake_model.queue(escalated(f"echo late > {target}"), say("after-expiry"))
    agent = launch(codex, "codex-quick", run, "write late marker-q3")

    wait_pending(agent)
    agent.wait_event("done", "turn finished")
    assert "Nobody answered the permission request in time" in codex_output(fake_model)
    assert not target.exists()


def test_codex_a_policy_rule_answers_without_asking(codex: Dispatch, fake_model: FakeModel, run: Run) -> None:
    target = run.home / "codex-policy.txt"
    rule = httpx.post(
        f"{codex.server.url}/api/v1/approval-rules",
        json={"tool": "Bash", "pattern": f"echo * > {run.home}/*", "action": "allow"},
        headers={"Authorization": f"Bearer {codex.token}"},
        timeout=10,
    )
    assert rule.status_code == 201, rule.text
    fake_model.queue(escalated(f"echo ruled > {target}"), say("after-rule"))
    agent = launch(codex, "codex", run, "write by rule marker-q4")

    agent.wait_event("done", "turn finished")
    assert target.read_text() == "ruled\n"
    decided = approvals(agent, "allowed")
    assert [(a["tool_summary"], a["rule"]["id"]) for a in decided] == [(f"echo ruled > {target}", rule.json()["id"])]
    assert not [e for e in agent.events() if e["type"] == "blocked"]  # nobody was asked


# --- the machine audit names the approval ------------------------------------------------------

_AUDIT = """
import json
from machines.models import AuditRecord
print(json.dumps([[r.op, r.details] for r in AuditRecord.objects.filter(caller={agent!r}).order_by("ts")]))
"""


def test_a_machine_tool_call_approved_in_dispatch_names_its_approval_in_the_audit(
    claude: Dispatch, fake_model: FakeModel, run: Run, tmp_path: Path
) -> None:
    root = tmp_path / "pc"
    root.mkdir()
    (root / "notes.txt").write_text("remember the milk marker-p7\n")
    agent = launch(claude, "claude-ask", run, "hello marker-p6")
    agent.wait_event("done", "turn finished")  # the fallback answer; the shim attaches to its session now
    attach_shim(claude, agent.id, root)
    fake_model.queue(call("mcp__dispatch__local_pc_file_read", {"path": "notes.txt"}), say("read-done"))
    agent.send("read my note marker-p8")

    pending = wait_pending(agent)
    assert (pending["tool_name"], pending["tool_input"]) == ("mcp__dispatch__local_pc_file_read", {"path": "notes.txt"})
    answer(agent, pending["id"], "allow_once")
    agent.wait_event("done", "turn finished", count=2)
    assert "remember the milk marker-p7" in last_tool_result(fake_model)
    audited = json.loads(
        claude.inst.manage("shell", "-c", _AUDIT.format(agent=agent.id)).stdout.strip().splitlines()[-1]
    )
    assert audited == [["FILE_READ", {"path": "notes.txt", "approval_id": pending["id"]}]]
