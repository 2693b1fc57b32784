"""The pydantic shapes of agents, runs, events, messages and approvals
(``agents.serializers``) write the JSON the DRF ``ModelSerializer``s they replaced wrote,
byte for byte: same keys in the same order, the same nulls, timestamps in the current
time zone (``Z`` for UTC, microseconds kept). The oracles below are those serializers as
they were."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework import serializers

from agents.models import Agent, AgentEvent, AgentMessage, Approval, ApprovalRule, Run
from agents.serializers import agent_data, approval_data, event_data, message_data, rule_data, run_data
from peers.models import Peer


class AgentOracle(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.get_username", read_only=True)
    parent = serializers.CharField(source="parent_id", allow_null=True, read_only=True)  # type: ignore[assignment]
    launched_by = serializers.CharField(source="launched_by_id", allow_null=True, read_only=True)
    peer = serializers.SerializerMethodField()

    class Meta:
        model = Agent
        fields = [
            "id",
            "owner",
            "name",
            "type",
            "status",
            "cwd",
            "parent",
            "launched_by",
            "launched_by_peer",
            "host",
            "full_access",
            "latest_event_type",
            "latest_event_message",
            "latest_event_at",
            "peer",
            "peer_agent_id",
            "stale",
            "last_error",
            "created_at",
            "updated_at",
        ]

    def get_peer(self, agent: Agent) -> str | None:
        return agent.peer.label if agent.peer_id is not None and agent.peer is not None else None


class RunOracle(serializers.ModelSerializer):
    agent_id = serializers.CharField(read_only=True)

    class Meta:
        model = Run
        fields = ["id", "agent_id", "input", "status", "output", "error", "created_at", "started_at", "finished_at"]


class EventOracle(serializers.ModelSerializer):
    agent_id = serializers.CharField(read_only=True)
    run_id = serializers.CharField(allow_null=True, read_only=True)

    class Meta:
        model = AgentEvent
        fields = ["id", "agent_id", "run_id", "type", "message", "metadata", "created_at", "mirrored"]


class MessageOracle(serializers.ModelSerializer):
    sender_agent_id = serializers.CharField(allow_null=True, read_only=True)
    sender_user = serializers.CharField(source="sender_user.get_username", allow_null=True, read_only=True)
    recipient_agent_id = serializers.CharField(read_only=True)

    class Meta:
        model = AgentMessage
        fields = [
            "id",
            "sender_agent_id",
            "sender_user",
            "recipient_agent_id",
            "content",
            "status",
            "error",
            "created_at",
            "pasted_at",
            "delivered_at",
        ]


class RuleOracle(serializers.ModelSerializer):
    agent_id = serializers.CharField(allow_null=True, read_only=True)
    created_by_approval_id = serializers.CharField(allow_null=True, read_only=True)

    class Meta:
        model = ApprovalRule
        fields = ["id", "agent_id", "tool", "pattern", "action", "created_at", "created_by_approval_id"]


class ApprovalOracle(serializers.ModelSerializer):
    agent_id = serializers.CharField(read_only=True)
    agent_name = serializers.CharField(source="agent.name", read_only=True)
    answered_by_user = serializers.CharField(
        source="answered_by_user.get_username", allow_null=True, read_only=True, default=None
    )
    answered_by_agent_id = serializers.CharField(allow_null=True, read_only=True)
    answered_by_peer = serializers.SerializerMethodField()
    rule = RuleOracle(source="answered_by_rule", allow_null=True, read_only=True)

    class Meta:
        model = Approval
        fields = [
            "id",
            "agent_id",
            "agent_name",
            "tool_name",
            "tool_input",
            "tool_summary",
            "suggestions",
            "hook_event",
            "status",
            "decision",
            "message",
            "answered_by",
            "answered_by_user",
            "answered_by_agent_id",
            "answered_by_peer",
            "rule",
            "asked_at",
            "answered_at",
            "expires_at",
        ]

    def get_answered_by_peer(self, approval: Approval) -> str | None:
        peer = approval.answered_by_peer
        return peer.label if peer is not None else None


# Whole seconds, microseconds, and a time given in another zone than the current one.
WHEN = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
WHEN_MICRO = datetime(2026, 3, 1, 12, 0, 0, 5, tzinfo=UTC)
WHEN_ELSEWHERE = datetime(2026, 3, 1, 14, 30, 0, 250000, tzinfo=dt_timezone(timedelta(hours=2)))


def _rows() -> dict[str, list[tuple[Any, Any]]]:
    alice = User(pk=1, username="alice")
    bob = User(pk=2, username="bob")
    lab = Peer(pk=7, label="lab")
    lead = Agent(pk="agt_000000000001", owner=alice, name="lead", type="expert", status="running", cwd="/w")
    shadow = Agent(
        pk="agt_000000000002",
        owner=alice,
        name="far: 2",
        type="claude",
        status=Agent.Status.STOPPED,
        cwd="/x",
        parent=lead,
        launched_by=lead,
        launched_by_peer={"instance": "inst_1", "agent_id": "agt_9", "nested": [1, 2.5, None, True]},
        host="box",
        full_access=True,
        latest_event_type="waiting_user",
        latest_event_message="which branch?",
        latest_event_at=WHEN_MICRO,
        peer=lab,
        peer_agent_id="agt_ffffffffffff",
        stale=True,
        last_error="gone",
        created_at=WHEN,
        updated_at=WHEN_ELSEWHERE,
    )
    lead.created_at = lead.updated_at = WHEN
    run = Run(pk="run_000000000001", agent=lead, input={"instruction": "hi", "input": None, "remotes": ["w"]})
    run.created_at = WHEN_ELSEWHERE
    finished = Run(
        pk="run_000000000002",
        agent=lead,
        input={},
        status="failed",
        error="boom",
        created_at=WHEN,
        started_at=WHEN_MICRO,
        finished_at=WHEN_ELSEWHERE,
    )
    event = AgentEvent(pk=3, agent=lead, run=run, type="system", message="m", metadata={"a": [1]}, created_at=WHEN)
    bare_event = AgentEvent(pk=4, agent=lead, type=AgentEvent.Type.DONE, created_at=WHEN_MICRO, mirrored=True)
    from_user = AgentMessage(pk=5, sender_user=bob, recipient_agent=lead, content="hi", created_at=WHEN)
    from_agent = AgentMessage(
        pk=6,
        sender_agent=lead,
        recipient_agent=shadow,
        content="x" * 3,
        status="delivered",
        error="",
        created_at=WHEN_MICRO,
        pasted_at=WHEN_ELSEWHERE,
        delivered_at=WHEN,
    )
    rule = ApprovalRule(pk=8, owner=alice, agent=None, tool="Bash", pattern="ls *", action="allow", created_at=WHEN)
    agent_rule = ApprovalRule(pk=9, owner=alice, agent=lead, tool="*", action="deny", created_at=WHEN_MICRO)
    agent_rule.created_by_approval_id = "apr_000000000001"
    pending = Approval(pk="apr_000000000001", agent=lead, tool_name="Bash", expires_at=WHEN_ELSEWHERE, asked_at=WHEN)
    answered = Approval(
        pk="apr_000000000002",
        agent=shadow,
        tool_name="Read",
        tool_input={"file_path": "/etc/hosts"},
        tool_summary="/etc/hosts",
        suggestions=[{"type": "addRules"}],
        status="allowed",
        decision="allow_once",
        message="",
        answered_by="alice",
        answered_by_user=alice,
        answered_by_agent=lead,
        answered_by_rule=rule,
        answered_by_peer=lab,
        asked_at=WHEN_MICRO,
        answered_at=WHEN,
        expires_at=WHEN_ELSEWHERE,
    )
    return {
        "agent": [(lead, AgentOracle), (shadow, AgentOracle)],
        "run": [(run, RunOracle), (finished, RunOracle)],
        "event": [(event, EventOracle), (bare_event, EventOracle)],
        "message": [(from_user, MessageOracle), (from_agent, MessageOracle)],
        "rule": [(rule, RuleOracle), (agent_rule, RuleOracle)],
        "approval": [(pending, ApprovalOracle), (answered, ApprovalOracle)],
    }


RENDER = {
    "agent": agent_data,
    "run": run_data,
    "event": event_data,
    "message": message_data,
    "rule": rule_data,
    "approval": approval_data,
}


@pytest.mark.parametrize("zone", ["UTC", "Europe/Rome", "America/Los_Angeles"])
@pytest.mark.parametrize("kind", list(RENDER))
def test_each_shape_writes_the_json_its_model_serializer_wrote(kind: str, zone: str) -> None:
    with timezone.override(zone):
        for row, oracle in _rows()[kind]:
            expected = json.dumps(oracle(row).data)
            assert json.dumps(RENDER[kind](row)) == expected
