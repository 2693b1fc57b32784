"""The approval pages (agents/approval_pages.py, docs/agents.md#approvals-on-the-pages):
the box on the agent page, ``/approvals/``, ``/approvals/<id>/``, the answer form, the
policy rules, and the hostile cases (another user's id, no CSRF token, a replayed answer).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from agents import approvals, services
from agents.models import Agent, AgentEvent, Approval, ApprovalRule
from tests.peers.conftest import make_peer  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db

COMMAND = "rm -rf build && echo '<script>alert(1)</script>' | tee /tmp/" + "very-long-path-segment/" * 12 + "x"


@pytest.fixture
def agent(owner: Any, tmp_path: Any) -> Agent:
    created = services.agent_create(owner=owner, type="shell", name="builder", cwd=str(tmp_path))
    Agent.objects.filter(pk=created.pk).update(status="running")
    created.refresh_from_db()
    return created


@pytest.fixture
def pending(agent: Agent) -> Approval:
    return approvals.approval_request(
        agent=agent,
        tool_name="Bash",
        tool_input={"command": COMMAND, "description": "clean"},
        suggestions=[
            {
                "type": "addRules",
                "rules": [{"toolName": "Bash", "ruleContent": "rm:*"}],
                "behavior": "allow",
                "destination": "localSettings",
            }
        ],
    )


def login(user: Any, **kwargs: Any) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert match, "no CSRF token on the page"
    return match.group(1)


def test_the_agent_page_shows_the_pending_approval_with_its_exact_input_escaped_and_three_buttons(
    owner, agent, pending
):
    html = login(owner).get(f"/agents/{agent.pk}/").content.decode()
    assert f'data-approval="{pending.pk}"' in html
    assert "rm -rf build &amp;&amp; echo &#x27;&lt;script&gt;alert(1)&lt;/script&gt;&#x27;" in html
    assert "<script>alert(1)" not in html
    for decision, words in (
        ("allow_once", "Approve once"),
        ("allow_always", "Always allow this rule"),
        ("deny", "Deny"),
    ):
        assert f'data-decision="{decision}">{words}</button>' in html
    assert "allow Bash(rm:*) (localSettings)" in html  # the CLI's suggested rule
    assert 'name="message"' in html


def test_the_live_fragment_carries_the_box_while_pending_and_drops_it_once_answered(owner, agent, pending):
    client = login(owner)
    assert f'data-approval="{pending.pk}"' in client.get(f"/agents/{agent.pk}/fragment").content.decode()
    approvals.approval_answer(approval_id=pending.pk, decision="allow_once", user=owner)
    fragment = client.get(f"/agents/{agent.pk}/fragment").content.decode()
    assert 'class="approval-box"' not in fragment
    assert "Approvals answered" in fragment and "approved once" in fragment and ">alice<" in fragment


def test_approve_once_from_the_agent_page_answers_it_as_the_user_and_returns_to_the_page(owner, agent, pending):
    client = login(owner)
    response = client.post(
        f"/approvals/{pending.pk}/answer", {"decision": "allow_once", "next": f"/agents/{agent.pk}/"}
    )
    assert response.status_code == 302 and response["Location"] == f"/agents/{agent.pk}/"
    pending.refresh_from_db()
    assert (pending.status, pending.decision, pending.answered_by_user) == ("allowed", "allow_once", owner)
    assert AgentEvent.objects.filter(agent=agent, message__startswith="approved once by alice").exists()


def test_deny_with_a_message_keeps_the_message_for_the_model(owner, agent, pending):
    login(owner).post(f"/approvals/{pending.pk}/answer", {"decision": "deny", "message": "use make clean"})
    pending.refresh_from_db()
    assert (pending.status, pending.message) == ("denied", "use make clean")


def test_always_allow_makes_a_rule_shown_on_the_approvals_page(owner, agent, pending):
    client = login(owner)
    client.post(f"/approvals/{pending.pk}/answer", {"decision": "allow_always"})
    rule = ApprovalRule.objects.get(created_by_approval=pending)
    html = client.get("/approvals/").content.decode()
    assert f'data-rule="{rule.pk}"' in html


def test_a_lost_race_shows_already_answered_by_the_winner_not_an_error_page(owner, member, agent, pending):
    approvals.approval_answer(approval_id=pending.pk, decision="deny", user=owner)
    client = login(owner)
    response = client.post(
        f"/approvals/{pending.pk}/answer", {"decision": "allow_once", "next": f"/agents/{agent.pk}/"}, follow=True
    )
    assert response.status_code == 200
    html = response.content.decode()
    assert "already answered" in html and "alice" in html
    pending.refresh_from_db()
    assert pending.decision == "deny"


def test_a_replayed_answer_is_told_it_was_already_answered(owner, agent, pending):
    client = login(owner)
    body = {"decision": "allow_once"}
    client.post(f"/approvals/{pending.pk}/answer", body)
    html = client.post(f"/approvals/{pending.pk}/answer", body, follow=True).content.decode()
    assert "already answered" in html
    assert Approval.objects.get(pk=pending.pk).answered_by == "alice"


def test_the_approvals_page_lists_every_pending_approval_of_the_user_and_the_nav_counts_them(owner, agent, pending):
    second = approvals.approval_request(agent=agent, tool_name="WebFetch", tool_input={"url": "https://example.com/x"})
    html = login(owner).get("/approvals/").content.decode()
    assert f'data-approval="{pending.pk}"' in html and f'data-approval="{second.pk}"' in html
    assert "https://example.com/x" in html
    assert re.search(r'id="nav-approvals"[^>]*>Approvals <span class="badge nav-count"[^>]*>2</span>', html)
    assert 'name="viewport" content="width=device-width, initial-scale=1"' in html
    assert 'hx-get="/approvals/linked"' in html  # linked instances load after the page


def test_one_approval_page_shows_the_box_then_who_decided(owner, agent, pending):
    client = login(owner)
    assert 'data-decision="allow_once"' in client.get(f"/approvals/{pending.pk}/").content.decode()
    approvals.approval_answer(approval_id=pending.pk, decision="deny", message="no", user=owner)
    html = client.get(f"/approvals/{pending.pk}/").content.decode()
    assert 'data-decision="allow_once"' not in html
    assert "denied</strong> by alice" in html


def test_a_policy_decision_names_its_rule(owner, agent):
    rule = approvals.approval_rule_create(user=owner, tool="Read", action="allow")
    decided = approvals.approval_request(agent=agent, tool_name="Read", tool_input={"file_path": "/etc/hosts"})
    html = login(owner).get(f"/approvals/{decided.pk}/").content.decode()
    assert f"policy: #{rule.pk} allow Read (every agent)" in html


def test_a_link_alone_never_approves_the_page_needs_a_login(agent, pending):
    response = Client().get(f"/approvals/{pending.pk}/")
    assert response.status_code == 302 and "/login" in response["Location"]
    response = Client().post(f"/approvals/{pending.pk}/answer", {"decision": "allow_once"})
    assert response.status_code in (302, 403)
    assert Approval.objects.get(pk=pending.pk).status == "pending"


def test_another_users_approval_is_404_on_the_page_and_the_answer_form(outsider, agent, pending):
    client = login(outsider)
    assert client.get(f"/approvals/{pending.pk}/").status_code == 404
    assert client.post(f"/approvals/{pending.pk}/answer", {"decision": "allow_once"}).status_code == 404
    assert pending.pk not in client.get("/approvals/").content.decode()
    assert Approval.objects.get(pk=pending.pk).status == "pending"


def test_the_answer_form_needs_the_csrf_token(owner, agent, pending):
    client = login(owner, enforce_csrf_checks=True)
    assert client.post(f"/approvals/{pending.pk}/answer", {"decision": "allow_once"}).status_code == 403
    assert Approval.objects.get(pk=pending.pk).status == "pending"
    token = csrf_of(client.get(f"/approvals/{pending.pk}/").content.decode())
    response = client.post(f"/approvals/{pending.pk}/answer", {"decision": "allow_once", "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert Approval.objects.get(pk=pending.pk).status == "allowed"


def test_a_bad_decision_is_a_note_and_changes_nothing(owner, agent, pending):
    html = (
        login(owner).post(f"/approvals/{pending.pk}/answer", {"decision": "yes please"}, follow=True).content.decode()
    )
    assert "decision must be one of" in html
    assert Approval.objects.get(pk=pending.pk).status == "pending"


def test_rules_are_added_and_deleted_from_the_approvals_page(owner, outsider, agent):
    client = login(owner)
    client.post("/approvals/rules", {"action": "deny", "tool": "Bash", "pattern": "curl *", "agent": agent.pk})
    rule = ApprovalRule.objects.get(owner=owner)
    assert (rule.action, rule.tool, rule.pattern, rule.agent_id) == ("deny", "Bash", "curl *", agent.pk)
    html = client.get("/approvals/").content.decode()
    assert f'data-rule="{rule.pk}"' in html and "curl *" in html
    # a bad rule is refused with why, nothing added
    html = client.post("/approvals/rules", {"action": "maybe", "tool": "Bash"}, follow=True).content.decode()
    assert "Rule not added: action must be one of" in html
    assert ApprovalRule.objects.count() == 1
    # another user can neither delete it nor attach a rule to alice's agent
    stranger = login(outsider)
    stranger.post(f"/approvals/rules/{rule.pk}/delete")
    stranger.post("/approvals/rules", {"action": "allow", "tool": "*", "agent": agent.pk})
    assert list(ApprovalRule.objects.values_list("owner__username", flat=True)) == ["alice"]
    client.post(f"/approvals/rules/{rule.pk}/delete")
    assert not ApprovalRule.objects.exists()


def test_a_shadow_waiting_for_approval_points_to_the_approvals_page(owner, make_peer):  # noqa: F811 - the fixture
    link = make_peer(owner, label="Cloud")
    shadow = Agent.objects.create(
        owner=owner,
        name="remote",
        type="claude",
        status="running",
        cwd="/srv/repo",
        peer=link.peer,
        peer_agent_id="agt_0123456789ab",
        latest_event_type="blocked",
        latest_event_message="approval requested: Bash `ls`",
    )
    html = login(owner).get(f"/agents/{shadow.pk}/").content.decode()
    assert 'id="shadow-approval"' in html and "waiting for approval on Cloud" in html
    assert 'href="/approvals/"' in html
