"""Approvals: the record, the policy applied first, the one answer that wins, the timeout
(docs/agents.md#approvals)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.db import close_old_connections, connection
from django.dispatch import Signal
from django.test import override_settings
from django.utils import timezone

from agents import approval_selectors, approvals
from agents.models import Agent, AgentEvent, Approval, ApprovalRule
from agents.signals import approval_answered, approval_requested
from core.errors import DispatchError, InvalidRequest, NotFound

pytestmark = pytest.mark.django_db


@pytest.fixture
def cli_agent(owner: Any, make_agent: Callable[..., Agent]) -> Agent:
    return make_agent(owner, type="claude", name="worker")


def ask(agent: Agent, command: str = "ls -la", tool: str = "Bash", **kwargs: Any) -> Approval:
    kwargs.setdefault("suggestions", None)
    return approvals.approval_request(agent=agent, tool_name=tool, tool_input={"command": command}, **kwargs)


@contextmanager
def hearing(signal: Signal) -> Iterator[list[Approval]]:
    """The approvals ``signal`` is sent with while the block runs."""
    heard: list[Approval] = []

    def receiver(sender: Any, approval: Approval, **_: Any) -> None:
        heard.append(approval)

    signal.connect(receiver, dispatch_uid="test_approvals")
    try:
        yield heard
    finally:
        signal.disconnect(dispatch_uid="test_approvals")


def events(agent: Agent) -> list[AgentEvent]:
    return list(AgentEvent.objects.filter(agent=agent).order_by("created_at", "pk"))


# --- the record -------------------------------------------------------------------------------


def test_a_request_without_rules_is_pending_and_the_agent_waits_for_approval(
    cli_agent: Agent, django_capture_on_commit_callbacks: Any
) -> None:
    with hearing(approval_requested) as heard, django_capture_on_commit_callbacks(execute=True):
        approval = ask(cli_agent)
    assert approval.status == "pending" and approval.decision == ""
    assert approval.tool_summary == "ls -la"
    assert approval.expires_at - approval.asked_at == timedelta(seconds=300)
    last = events(cli_agent)[-1]
    assert last.type == "blocked"
    assert last.message == "approval requested: Bash `ls -la`"
    assert last.metadata["approval_id"] == approval.pk
    assert [a.pk for a in heard] == [approval.pk]


def test_the_summary_is_the_file_or_url_a_tool_names(cli_agent: Agent) -> None:
    read = approvals.approval_request(agent=cli_agent, tool_name="Read", tool_input={"file_path": "/etc/hosts"})
    fetch = approvals.approval_request(agent=cli_agent, tool_name="WebFetch", tool_input={"url": "https://x.test/"})
    assert (read.tool_summary, fetch.tool_summary) == ("/etc/hosts", "https://x.test/")


def test_a_request_with_a_tool_name_it_cannot_store_is_refused_and_nothing_recorded(cli_agent: Agent) -> None:
    with pytest.raises(InvalidRequest):
        approvals.approval_request(agent=cli_agent, tool_name="Ba\x00sh", tool_input={})
    with pytest.raises(InvalidRequest):
        approvals.approval_request(agent=cli_agent, tool_name="Bash", tool_input={"command": "a\x00b"})
    assert not Approval.objects.exists()


@override_settings(APPROVAL_TIMEOUT=7, APPROVAL_DEFAULT="allow_once")
def test_the_timeout_and_default_come_from_the_settings(cli_agent: Agent) -> None:
    approval = ask(cli_agent)
    assert approval.expires_at - approval.asked_at == timedelta(seconds=7)
    assert approval.timeout_decision == "allow_once"


# --- policy -----------------------------------------------------------------------------------


def test_a_user_rule_allowing_read_answers_without_asking(owner: Any, cli_agent: Agent) -> None:
    rule = approvals.approval_rule_create(user=owner, tool="Read", action="allow")
    approval = approvals.approval_request(agent=cli_agent, tool_name="Read", tool_input={"file_path": "/x"})
    assert (approval.status, approval.decision, approval.answered_by_rule_id) == ("allowed", "allow_once", rule.pk)
    last = events(cli_agent)[-1]
    assert last.message == f"allowed by policy rule #{rule.pk}: Read `/x`"
    assert last.type == "working" and last.metadata["rule_id"] == rule.pk
    assert not AgentEvent.objects.filter(agent=cli_agent, type="blocked").exists()


def test_deny_beats_allow_at_the_same_level(owner: Any, cli_agent: Agent) -> None:
    approvals.approval_rule_create(user=owner, tool="Bash", action="allow")
    deny = approvals.approval_rule_create(user=owner, tool="*", pattern="curl *", action="deny")
    approval = ask(cli_agent, "curl https://example.test")
    assert (approval.status, approval.answered_by_rule_id) == ("denied", deny.pk)
    assert ask(cli_agent, "ls").status == "allowed"
    assert events(cli_agent)[-2].message == f"denied by policy rule #{deny.pk}: Bash `curl https://example.test`"


def test_the_agents_own_rules_come_before_the_users(owner: Any, cli_agent: Agent) -> None:
    approvals.approval_rule_create(user=owner, tool="Bash", action="deny")
    mine = approvals.approval_rule_create(
        user=owner, tool="Bash", pattern="git status*", action="allow", agent=cli_agent
    )
    assert ask(cli_agent, "git status --short").answered_by_rule_id == mine.pk
    assert ask(cli_agent, "rm -rf /").status == "denied"  # the agent's rule does not match: the user's decides


def test_an_ask_rule_asks_a_person_even_where_a_user_rule_allows(owner: Any, cli_agent: Agent) -> None:
    approvals.approval_rule_create(user=owner, tool="*", action="allow")
    approvals.approval_rule_create(user=owner, tool="Bash", action="ask", agent=cli_agent)
    assert ask(cli_agent).status == "pending"


def test_another_users_rules_never_apply(outsider: Any, cli_agent: Agent) -> None:
    approvals.approval_rule_create(user=outsider, tool="*", action="allow")
    assert ask(cli_agent).status == "pending"


def test_a_rule_for_another_users_agent_is_refused(outsider: Any, cli_agent: Agent) -> None:
    with pytest.raises(NotFound):
        approvals.approval_rule_create(user=outsider, tool="Bash", action="allow", agent=cli_agent)
    with pytest.raises(InvalidRequest):
        approvals.approval_rule_create(user=outsider, tool="Bash", action="maybe")
    with pytest.raises(InvalidRequest):
        approvals.approval_rule_create(user=outsider, tool="Ba sh", action="allow")
    assert not ApprovalRule.objects.exists()


# --- answers ----------------------------------------------------------------------------------


def test_a_person_approves_once_and_the_timeline_says_who(
    owner: Any, cli_agent: Agent, django_capture_on_commit_callbacks: Any
) -> None:
    pending = ask(cli_agent)
    with hearing(approval_answered) as heard, django_capture_on_commit_callbacks(execute=True):
        answered = approvals.approval_answer(approval_id=pending.pk, decision="allow_once", user=owner)
    assert (answered.status, answered.decision, answered.answered_by_user_id) == ("allowed", "allow_once", owner.pk)
    last = events(cli_agent)[-1]
    assert last.message == "approved once by alice: Bash `ls -la`"
    assert last.type == "working" and last.metadata["approval_id"] == answered.pk
    assert [a.pk for a in heard] == [answered.pk]


def test_deny_with_a_message_keeps_the_message_for_the_model(owner: Any, cli_agent: Agent) -> None:
    answered = approvals.approval_answer(
        approval_id=ask(cli_agent).pk, decision="deny", message="use git ls-files instead", user=owner
    )
    assert (answered.status, answered.message) == ("denied", "use git ls-files instead")
    assert events(cli_agent)[-1].message == "denied by alice: Bash `ls -la` — use git ls-files instead"


def test_always_allow_makes_a_rule_from_claudes_suggestion(owner: Any, cli_agent: Agent) -> None:
    suggestion = [
        {
            "type": "addRules",
            "rules": [{"toolName": "Bash", "ruleContent": "npm test:*"}],
            "behavior": "allow",
            "destination": "localSettings",
        }
    ]
    first = ask(cli_agent, "npm test -- --watch", suggestions=suggestion)
    approvals.approval_answer(approval_id=first.pk, decision="allow_always", user=owner)
    rule = ApprovalRule.objects.get()
    assert (rule.agent_id, rule.tool, rule.pattern, rule.action) == (cli_agent.pk, "Bash", "npm test*", "allow")
    assert rule.created_by_approval_id == first.pk
    assert ask(cli_agent, "npm test").answered_by_rule_id == rule.pk
    assert ask(cli_agent, "rm x").status == "pending"


def test_always_allow_takes_claudes_current_wildcard_rule_form(owner: Any, cli_agent: Agent) -> None:
    # Claude Code 2.1 suggests ``Bash(npm test *)``: the star is a wildcard, not a character.
    suggestion = [{"type": "addRules", "rules": [{"toolName": "Bash", "ruleContent": "npm test *"}]}]
    first = ask(cli_agent, "npm test --silent", suggestions=suggestion)
    approvals.approval_answer(approval_id=first.pk, decision="allow_always", user=owner)
    assert ApprovalRule.objects.get().pattern == "npm test *"
    assert ask(cli_agent, "npm test --silent").status == "allowed"
    assert ask(cli_agent, "npm test -- --watch").status == "allowed"
    assert ask(cli_agent, "npm testify").status == "pending"
    assert ask(cli_agent, "rm -rf /").status == "pending"


def test_always_allow_without_a_suggestion_allows_that_exact_request(owner: Any, cli_agent: Agent) -> None:
    approvals.approval_answer(approval_id=ask(cli_agent, "ls [ab]*").pk, decision="allow_always", user=owner)
    assert ask(cli_agent, "ls [ab]*").status == "allowed"
    assert ask(cli_agent, "ls a").status == "pending"


def test_a_second_answer_is_told_who_answered_first(owner: Any, cli_agent: Agent) -> None:
    approval = ask(cli_agent)
    approvals.approval_answer(approval_id=approval.pk, decision="allow_once", user=owner)
    with pytest.raises(DispatchError) as refused:
        approvals.approval_answer(approval_id=approval.pk, decision="deny", user=owner)
    assert refused.value.code == "APPROVAL_ANSWERED" and refused.value.http_status == 409
    assert "allowed by alice at" in refused.value.message
    assert Approval.objects.get(pk=approval.pk).decision == "allow_once"


@pytest.mark.django_db(transaction=True)
def test_two_answers_racing_one_wins_and_the_other_is_told(owner: Any, make_agent: Callable[..., Agent]) -> None:
    approval = ask(make_agent(owner, type="claude", name="racer"))
    barrier = threading.Barrier(2)
    outcomes: dict[str, Any] = {}

    def answer(decision: str) -> None:
        try:
            barrier.wait()
            outcomes[decision] = approvals.approval_answer(approval_id=approval.pk, decision=decision, user=owner)
        except DispatchError as error:
            outcomes[decision] = error
        finally:
            connection.close()
            close_old_connections()

    threads = [threading.Thread(target=answer, args=(d,)) for d in ("allow_once", "deny")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    won = [d for d, o in outcomes.items() if isinstance(o, Approval)]
    lost = [o for o in outcomes.values() if isinstance(o, DispatchError)]
    assert len(won) == 1 and len(lost) == 1 and lost[0].code == "APPROVAL_ANSWERED"
    assert Approval.objects.get(pk=approval.pk).decision == won[0]
    assert AgentEvent.objects.filter(metadata__approval_id=approval.pk, type="working").count() == 1


def test_an_expired_request_gets_the_default_and_a_late_answer_is_told(owner: Any, cli_agent: Agent) -> None:
    approval = ask(cli_agent)
    Approval.objects.filter(pk=approval.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(DispatchError) as refused:
        approvals.approval_answer(approval_id=approval.pk, decision="allow_once", user=owner)
    assert refused.value.code == "APPROVAL_ANSWERED"
    expired = Approval.objects.get(pk=approval.pk)
    assert (expired.status, expired.decision, expired.answered_by) == ("expired", "deny", "timeout")
    assert events(cli_agent)[-1].message == "expired: denied (default): Bash `ls -la`"
    assert not approval_selectors.approvals_for(user=owner).exists()


def test_expiry_applies_an_allowing_default(owner: Any, cli_agent: Agent) -> None:
    with override_settings(APPROVAL_DEFAULT="allow_once"):
        approval = ask(cli_agent)
    expired = approvals.approvals_expire_due(now=approval.expires_at)
    assert [(a.pk, a.status, a.decision) for a in expired] == [(approval.pk, "expired", "allow_once")]
    assert events(cli_agent)[-1].message == "expired: allowed (default): Bash `ls -la`"


# --- hostile ----------------------------------------------------------------------------------


def test_another_users_approval_is_not_found_like_an_unknown_one(outsider: Any, cli_agent: Agent) -> None:
    approval = ask(cli_agent)
    for approval_id in (approval.pk, "apr_000000000000", "../x"):
        with pytest.raises(NotFound):
            approvals.approval_answer(approval_id=approval_id, decision="allow_once", user=outsider)
        with pytest.raises(NotFound):
            approval_selectors.approval_get_for(user=outsider, approval_id=approval_id)
    assert Approval.objects.get(pk=approval.pk).status == "pending"


def test_an_agent_cannot_answer_its_own_approval(owner: Any, cli_agent: Agent) -> None:
    approval = ask(cli_agent)
    with pytest.raises(DispatchError) as refused:
        approvals.approval_answer(approval_id=approval.pk, decision="allow_once", by_agent=cli_agent)
    assert refused.value.code == "PERMISSION_DENIED" and refused.value.http_status == 403
    assert Approval.objects.get(pk=approval.pk).status == "pending"


def test_a_supervising_agent_answers_and_is_recorded(
    owner: Any, outsider: Any, cli_agent: Agent, make_agent: Callable[..., Agent]
) -> None:
    supervisor = make_agent(owner, type="claude", name="boss")
    stranger = make_agent(outsider, type="claude", name="stranger")
    approval = ask(cli_agent)
    with pytest.raises(NotFound):
        approvals.approval_answer(approval_id=approval.pk, decision="allow_once", by_agent=stranger)
    answered = approvals.approval_answer(approval_id=approval.pk, decision="allow_once", by_agent=supervisor)
    assert answered.answered_by_agent_id == supervisor.pk and answered.answered_by_user_id is None
    assert events(cli_agent)[-1].message == "approved once by agent boss (supervisor): Bash `ls -la`"


def test_bad_answers_are_refused_and_change_nothing(owner: Any, cli_agent: Agent) -> None:
    approval = ask(cli_agent)
    for kwargs in (
        {"decision": "maybe", "user": owner},
        {"decision": "allow_once", "message": "why not", "user": owner},
        {"decision": "deny", "message": "x" * 2001, "user": owner},
        {"decision": "deny"},
        {"decision": "deny", "user": owner, "by_agent": cli_agent},
    ):
        with pytest.raises(InvalidRequest):
            approvals.approval_answer(approval_id=approval.pk, **kwargs)
    assert Approval.objects.get(pk=approval.pk).status == "pending"


def test_approvals_for_lists_the_users_pending_ones_only(
    owner: Any, outsider: Any, cli_agent: Agent, make_agent: Callable[..., Agent]
) -> None:
    mine = ask(cli_agent)
    ask(make_agent(outsider, type="claude", name="theirs"))
    answered = ask(cli_agent, "pwd")
    approvals.approval_answer(approval_id=answered.pk, decision="deny", user=owner)
    assert [a.pk for a in approval_selectors.approvals_for(user=owner)] == [mine.pk]
    assert {a.pk for a in approval_selectors.approvals_for(user=owner, status=None)} == {mine.pk, answered.pk}
    assert [a.pk for a in approval_selectors.approvals_for(user=owner, exclude_agent=cli_agent)] == []
    with pytest.raises(InvalidRequest):
        approval_selectors.approvals_for(user=owner, status="bogus")


# --- admin ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["approval", "approvalrule"])
def test_the_admin_lists_approvals_and_rules(admin_client: Any, owner: Any, cli_agent: Agent, model: str) -> None:
    approvals.approval_rule_create(user=owner, tool="Read", pattern="/srv/visible-*", action="allow")
    ask(cli_agent, "echo visible-request")
    response = admin_client.get(f"/admin/agents/{model}/")
    assert response.status_code == 200
    assert "visible-" in response.content.decode()


def test_the_admin_denies_its_own_agents_approvals_through_the_service(
    admin_client: Any, admin_user: Any, owner: Any, make_agent: Callable[..., Agent]
) -> None:
    theirs = ask(make_agent(owner, type="claude", name="theirs"))
    mine = ask(make_agent(admin_user, type="claude", name="mine"))
    selected = [mine.pk, theirs.pk]
    admin_client.post("/admin/agents/approval/", {"action": "deny", "_selected_action": selected})
    assert Approval.objects.get(pk=mine.pk).answered_by_user_id == admin_user.pk
    assert Approval.objects.get(pk=theirs.pk).status == "pending"  # not the admin's to answer
    assert AgentEvent.objects.filter(metadata__approval_id=mine.pk, type="working").exists()


def test_deleting_a_rule_in_the_admin_goes_through_the_service(admin_client: Any, owner: Any) -> None:
    rule = approvals.approval_rule_create(user=owner, tool="Read", action="allow")
    admin_client.post(
        "/admin/agents/approvalrule/", {"action": "delete_selected", "_selected_action": [rule.pk], "post": "yes"}
    )
    assert not ApprovalRule.objects.exists()


# --- the machine audit names the approval that allowed a call -------------------------------


def _allowed(agent: Agent, owner: Any, tool_name: str, tool_input: Any) -> Approval:
    approval = approvals.approval_request(agent=agent, tool_name=tool_name, tool_input=tool_input)
    return approvals.approval_answer(approval_id=approval.pk, decision="allow_once", user=owner)


def test_the_approval_of_that_very_call_is_found_and_no_other(owner: Any, cli_agent: Agent) -> None:
    arguments = {"path": "/srv/notes.txt"}
    approval = _allowed(cli_agent, owner, "mcp__dispatch__local_pc_file_read", arguments)
    found = approval_selectors.approval_for_tool_call(
        agent=cli_agent, tool_name="local_pc_file_read", arguments=arguments
    )
    assert found is not None and found.pk == approval.pk
    other = {"path": "/srv/other.txt"}
    assert (
        approval_selectors.approval_for_tool_call(agent=cli_agent, tool_name="local_pc_file_read", arguments=other)
        is None
    )
    assert (
        approval_selectors.approval_for_tool_call(agent=cli_agent, tool_name="local_pc_file_stat", arguments=arguments)
        is None
    )
    # A later answer about something else: the call is no longer the one just approved.
    _allowed(cli_agent, owner, "Bash", {"command": "ls"})
    assert (
        approval_selectors.approval_for_tool_call(agent=cli_agent, tool_name="local_pc_file_read", arguments=arguments)
        is None
    )


def test_a_denied_or_old_approval_names_no_call(owner: Any, cli_agent: Agent) -> None:
    arguments = {"path": "/srv/notes.txt"}
    denied = approvals.approval_request(
        agent=cli_agent, tool_name="mcp__dispatch__local_pc_file_read", tool_input=arguments
    )
    approvals.approval_answer(approval_id=denied.pk, decision="deny", user=owner)
    assert (
        approval_selectors.approval_for_tool_call(agent=cli_agent, tool_name="local_pc_file_read", arguments=arguments)
        is None
    )
    allowed = _allowed(cli_agent, owner, "mcp__dispatch__local_pc_file_read", arguments)
    Approval.objects.filter(pk=allowed.pk).update(answered_at=timezone.now() - timedelta(seconds=601))
    assert (
        approval_selectors.approval_for_tool_call(agent=cli_agent, tool_name="local_pc_file_read", arguments=arguments)
        is None
    )


@pytest.mark.django_db(transaction=True)
def test_an_agents_machine_tool_call_right_after_its_approval_writes_the_approval_into_the_audit(
    owner: Any, make_agent: Callable[..., Agent]
) -> None:
    from asgiref.sync import async_to_sync

    from agents.tools import with_approval_note
    from core.tools import Tool
    from machines.models import AuditRecord
    from machines.services.audit import audit_record_begin

    agent = make_agent(owner, type="claude", name="auditor")
    arguments = {"path": "/srv/notes.txt"}

    async def routed(called_with: dict[str, Any]) -> Any:
        # What a routed machine operation does: write its audit record before it is sent.
        record_id = await database_sync_to_async(audit_record_begin)(
            user=owner,
            session_id=agent.pk,
            machine_id="laptop",
            request_id="r1",
            op="READ_FILE",
            payload=called_with,
            caller=agent.pk,
        )
        return record_id

    tool = with_approval_note(
        Tool(name="local_pc_file_read", description="", parameters={"type": "object"}, handler=routed), agent
    )
    unapproved = async_to_sync(tool)(arguments)
    approval = _allowed(agent, owner, "mcp__dispatch__local_pc_file_read", arguments)
    approved = async_to_sync(tool)(arguments)
    assert "approval_id" not in AuditRecord.objects.get(pk=unapproved).details
    assert AuditRecord.objects.get(pk=approved).details == {"path": "/srv/notes.txt", "approval_id": approval.pk}


def test_an_agent_answers_allow_once_or_deny_but_makes_no_lasting_rule(owner: Any, cli_agent: Agent) -> None:
    # A supervising agent could otherwise widen for good what another agent may run.
    from agents import services as agent_services

    supervisor = agent_services.agent_create(owner=owner, type="shell", name="boss", cwd="/tmp")
    pending = ask(cli_agent, "npm test")
    with pytest.raises(DispatchError) as refused:
        approvals.approval_answer(approval_id=pending.pk, decision="allow_always", by_agent=supervisor)
    assert refused.value.code == "PERMISSION_DENIED" and "only a person" in refused.value.message
    assert ApprovalRule.objects.count() == 0
    assert Approval.objects.get(pk=pending.pk).status == "pending"
    answered = approvals.approval_answer(approval_id=pending.pk, decision="allow_once", by_agent=supervisor)
    assert answered.status == "allowed" and answered.answered_by_agent_id == supervisor.pk
