"""Approvals over the hooks route, REST and MCP (docs/agents.md#approvals): the hook's
answer and the output the CLI reads, who may read and answer, and the error shapes."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from agents import approval_selectors, tokens
from agents.models import Agent, AgentEvent, Approval, ApprovalRule
from dispatch.mcp.tools import tools_for
from tests.agents.conftest import Api, error_of, force_status

pytestmark = pytest.mark.django_db

SUGGESTIONS = [
    {
        "type": "addRules",
        "rules": [{"toolName": "Bash", "ruleContent": "ls:*"}],
        "behavior": "allow",
        "destination": "localSettings",
    }
]


@pytest.fixture
def claude_agent(owner: Any, make_agent: Any) -> Agent:
    return force_status(make_agent(owner, type="claude", name="c"), "running")


@pytest.fixture
def codex_agent(owner: Any, make_agent: Any) -> Agent:
    return force_status(make_agent(owner, type="codex", name="x"), "running")


def agent_api(agent: Agent) -> Api:
    return Api(tokens.agent_token_mint(agent=agent))


def permission_request(api: Api, agent: Agent, command: str = "ls -la", suggestions: Any = None) -> Any:
    payload = {
        "hook_event_name": "PermissionRequest",
        "tool_name": "Bash",
        "tool_input": {"command": command, "description": "list"},
        "permission_suggestions": suggestions or [],
    }
    response = api.post(f"/api/v1/agents/{agent.pk}/hooks", {"event": "PermissionRequest", "payload": payload})
    assert response.status_code == 200, response.content
    return response.json()


def poll(api: Api, agent: Agent, approval_id: str) -> Any:
    return api.get(f"/api/v1/agents/{agent.pk}/hooks/approvals/{approval_id}")


def decision_of(output: dict[str, Any]) -> dict[str, Any]:
    assert output["hookSpecificOutput"]["hookEventName"] == "PermissionRequest"
    decision: dict[str, Any] = output["hookSpecificOutput"]["decision"]
    return decision


# --- the hook waits, then prints the answer ---------------------------------------------------


def test_a_pending_request_answers_no_output_and_the_poll_gets_the_persons_answer(
    claude_agent: Agent, api: Api
) -> None:
    hook = agent_api(claude_agent)
    answer = permission_request(hook, claude_agent)
    pending = answer["approval"]
    assert answer["output"] is None and pending["status"] == "pending"
    assert 0 < pending["wait_seconds"] <= 300 and pending["poll_seconds"] == 0.5
    assert poll(hook, claude_agent, pending["id"]).json()["output"] is None

    listed = api.get("/api/v1/approvals").json()["approvals"]
    assert [(a["id"], a["tool_summary"], a["agent_name"]) for a in listed] == [(pending["id"], "ls -la", "c")]
    answered = api.post(f"/api/v1/approvals/{pending['id']}/answer", {"decision": "allow_once"})
    assert answered.status_code == 200 and answered.json()["answered_by_user"] == "alice"

    output = poll(hook, claude_agent, pending["id"]).json()["output"]
    assert decision_of(output) == {"behavior": "allow"}
    claude_agent.refresh_from_db()
    assert (claude_agent.latest_event_type, claude_agent.latest_event_message) == (
        "working",
        "approved once by alice: Bash `ls -la`",
    )


def test_deny_with_a_message_is_what_the_cli_gives_the_model(claude_agent: Agent, api: Api) -> None:
    hook = agent_api(claude_agent)
    approval_id = permission_request(hook, claude_agent)["approval"]["id"]
    api.post(f"/api/v1/approvals/{approval_id}/answer", {"decision": "deny", "message": "run git status instead"})
    assert decision_of(poll(hook, claude_agent, approval_id).json()["output"]) == {
        "behavior": "deny",
        "message": "run git status instead",
    }


def test_always_allow_gives_claude_its_own_suggestion_back_and_codex_none(
    claude_agent: Agent, codex_agent: Agent, api: Api
) -> None:
    claude_hook = agent_api(claude_agent)
    first = permission_request(claude_hook, claude_agent, suggestions=SUGGESTIONS)["approval"]["id"]
    api.post(f"/api/v1/approvals/{first}/answer", {"decision": "allow_always"})
    assert decision_of(poll(claude_hook, claude_agent, first).json()["output"]) == {
        "behavior": "allow",
        # For the session only: Dispatch's rule lasts; the CLI writes nothing into the project.
        "updatedPermissions": [{**SUGGESTIONS[0], "destination": "session"}],
    }
    # The rule answers the next request at once: the hook prints the answer without waiting.
    again = permission_request(claude_hook, claude_agent, command="ls src")
    assert decision_of(again["output"]) == {"behavior": "allow"} and again["approval"]["status"] == "allowed"

    codex_hook = agent_api(codex_agent)
    other = permission_request(codex_hook, codex_agent, suggestions=SUGGESTIONS)["approval"]["id"]
    api.post(f"/api/v1/approvals/{other}/answer", {"decision": "allow_always"})
    # codex fails closed on any updatedPermissions (its permission-request output schema).
    assert decision_of(poll(codex_hook, codex_agent, other).json()["output"]) == {"behavior": "allow"}


def test_a_policy_deny_answers_the_hook_at_once_with_the_rule_named(claude_agent: Agent, api: Api) -> None:
    created = api.post("/api/v1/approval-rules", {"tool": "Bash", "pattern": "curl *", "action": "deny"})
    assert created.status_code == 201, created.content
    answer = permission_request(agent_api(claude_agent), claude_agent, command="curl https://x.test")
    rule_id = created.json()["id"]
    assert decision_of(answer["output"]) == {
        "behavior": "deny",
        "message": f"denied by Dispatch policy rule #{rule_id}",
    }
    shown = api.get(f"/api/v1/approvals/{answer['approval']['id']}").json()
    assert shown["rule"]["id"] == rule_id and shown["answered_by"] == f"policy rule #{rule_id}"


def test_an_expired_request_answers_the_default_on_the_next_poll(claude_agent: Agent) -> None:
    hook = agent_api(claude_agent)
    approval_id = permission_request(hook, claude_agent)["approval"]["id"]
    Approval.objects.filter(pk=approval_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    answer = poll(hook, claude_agent, approval_id).json()
    assert answer["approval"]["status"] == "expired"
    assert decision_of(answer["output"])["behavior"] == "deny"
    assert "Nobody answered" in decision_of(answer["output"])["message"]
    assert (
        AgentEvent.objects.filter(agent=claude_agent).latest("pk").message == "expired: denied (default): Bash `ls -la`"
    )


# --- hostile ----------------------------------------------------------------------------------


def test_a_forged_hook_call_without_the_agents_token_changes_nothing(
    claude_agent: Agent, make_agent: Any, owner: Any, api: Api
) -> None:
    other = force_status(make_agent(owner, type="claude", name="other"), "running")
    body = {"event": "PermissionRequest", "payload": {"tool_name": "Bash", "tool_input": {"command": "rm -rf ~"}}}
    assert Api("not-a-token").post(f"/api/v1/agents/{claude_agent.pk}/hooks", body).status_code == 401
    assert error_of(api.post(f"/api/v1/agents/{claude_agent.pk}/hooks", body))["code"] == "PERMISSION_DENIED"
    assert agent_api(other).post(f"/api/v1/agents/{claude_agent.pk}/hooks", body).status_code == 403
    assert not Approval.objects.exists()
    # Nor may another agent, or the user, read the answer a hook waits on.
    approval_id = permission_request(agent_api(claude_agent), claude_agent)["approval"]["id"]
    assert poll(agent_api(other), claude_agent, approval_id).status_code == 403
    assert poll(api, claude_agent, approval_id).status_code == 403
    assert poll(agent_api(other), other, approval_id).status_code == 404  # not that agent's approval


def test_another_users_approval_is_404_like_an_unknown_one(claude_agent: Agent, outsider_token: str) -> None:
    approval_id = permission_request(agent_api(claude_agent), claude_agent)["approval"]["id"]
    stranger = Api(outsider_token)
    for path in (f"/api/v1/approvals/{approval_id}", "/api/v1/approvals/apr_000000000000"):
        assert error_of(stranger.get(path))["code"] == "NOT_FOUND"
        assert error_of(stranger.post(f"{path}/answer", {"decision": "allow_once"}))["code"] == "NOT_FOUND"
    assert stranger.get("/api/v1/approvals").json() == {"approvals": []}
    assert Approval.objects.get(pk=approval_id).status == "pending"


def test_a_replayed_answer_is_409_naming_who_answered(claude_agent: Agent, api: Api) -> None:
    approval_id = permission_request(agent_api(claude_agent), claude_agent)["approval"]["id"]
    assert api.post(f"/api/v1/approvals/{approval_id}/answer", {"decision": "deny"}).status_code == 200
    replay = api.post(f"/api/v1/approvals/{approval_id}/answer", {"decision": "deny"})
    assert replay.status_code == 409
    error = error_of(replay)
    assert error["code"] == "APPROVAL_ANSWERED" and "denied by alice at" in error["message"]
    assert error["details"]["answered_by"] == "alice"


def test_an_agent_answering_its_own_approval_is_403_and_another_agents_answer_is_its_own(
    claude_agent: Agent, make_agent: Any, owner: Any
) -> None:
    own = agent_api(claude_agent)
    approval_id = permission_request(own, claude_agent)["approval"]["id"]
    refused = own.post(f"/api/v1/approvals/{approval_id}/answer", {"decision": "allow_once"})
    assert refused.status_code == 403 and "its own approval" in error_of(refused)["message"]
    assert own.get("/api/v1/approvals").json() == {"approvals": []}  # its own are not its to answer

    boss = force_status(make_agent(owner, type="claude", name="boss"), "running")
    supervisor = agent_api(boss)
    assert [a["id"] for a in supervisor.get("/api/v1/approvals").json()["approvals"]] == [approval_id]
    answered = supervisor.post(f"/api/v1/approvals/{approval_id}/answer", {"decision": "allow_once"}).json()
    assert (answered["answered_by_agent_id"], answered["answered_by_user"]) == (boss.pk, None)


def test_bad_bodies_are_400_and_change_nothing(claude_agent: Agent, api: Api) -> None:
    approval_id = permission_request(agent_api(claude_agent), claude_agent)["approval"]["id"]
    for body in ({}, {"decision": "yes"}, {"decision": 1}, {"decision": "allow_once", "message": "fine by me"}):
        assert api.post(f"/api/v1/approvals/{approval_id}/answer", body).status_code == 400, body
    for body in ({"tool": "Bash", "action": "sometimes"}, {"tool": "", "action": "allow"}, {"action": "allow"}):
        assert api.post("/api/v1/approval-rules", body).status_code == 400, body
    assert api.get("/api/v1/approvals", status="bogus").status_code == 400
    assert Approval.objects.get(pk=approval_id).status == "pending" and not ApprovalRule.objects.exists()


def test_rules_are_a_persons_own(claude_agent: Agent, api: Api, outsider_token: str) -> None:
    rule = api.post("/api/v1/approval-rules", {"tool": "Read", "action": "allow", "agent_id": claude_agent.pk}).json()
    assert api.get("/api/v1/approval-rules", agent_id=claude_agent.pk).json()["rules"][0]["id"] == rule["id"]
    stranger = Api(outsider_token)
    assert stranger.get("/api/v1/approval-rules").json() == {"rules": []}
    assert stranger.delete(f"/api/v1/approval-rules/{rule['id']}").status_code == 404
    assert agent_api(claude_agent).delete(f"/api/v1/approval-rules/{rule['id']}").status_code == 403
    assert api.delete(f"/api/v1/approval-rules/{rule['id']}").status_code == 204
    assert not ApprovalRule.objects.exists()


# --- MCP --------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_supervising_agent_lists_and_answers_over_mcp_as_itself(
    claude_agent: Agent, make_agent: Any, owner: Any
) -> None:
    approval_id = permission_request(agent_api(claude_agent), claude_agent)["approval"]["id"]
    boss = force_status(make_agent(owner, type="claude", name="boss"), "running")

    async def run() -> tuple[Any, Any]:
        tools = await tools_for(user=owner, caller_agent=boss)
        listed = await tools["list_approvals"]({})
        answered = await tools["answer_approval"]({"approval_id": approval_id, "decision": "allow_once"})
        return listed, answered

    listed, answered = async_to_sync(run)()
    assert [a["approval_id"] for a in listed["approvals"]] == [approval_id]
    assert (answered["status"], answered["answered_by"]) == ("allowed", "agent boss (supervisor)")
    assert Approval.objects.get(pk=approval_id).answered_by_agent_id == boss.pk
    assert approval_selectors.approvals_for(user=owner).count() == 0


def test_the_sessions_pending_approvals_expire_when_it_ends(claude_agent: Agent) -> None:
    hook = agent_api(claude_agent)
    approval_id = permission_request(hook, claude_agent)["approval"]["id"]
    ended = hook.post(
        f"/api/v1/agents/{claude_agent.pk}/hooks", {"event": "SessionEnd", "payload": {"reason": "other"}}
    )
    assert ended.status_code == 200
    expired = Approval.objects.get(pk=approval_id)
    assert (expired.status, expired.decision) == ("expired", "deny")
