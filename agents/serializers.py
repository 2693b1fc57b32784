"""Output shapes of agents, runs, events and messages (docs/agents.md#the-rest-api).

One shape per object for the REST API and for the live events broadcast after each
change, so a list item, a single-object answer and an ``agent.upsert`` frame carry the
same fields. REST fields are snake_case.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ObjectDoesNotExist
from rest_framework import serializers

from agents.models import Agent, AgentEvent, AgentMessage, Approval, ApprovalRule, Run


class AgentSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.get_username", read_only=True)
    # The metaclass moves declared fields off the class, so this never shadows Field.parent.
    parent = serializers.CharField(source="parent_id", allow_null=True, read_only=True)  # type: ignore[assignment]
    launched_by = serializers.CharField(source="launched_by_id", allow_null=True, read_only=True)
    peer = serializers.SerializerMethodField(help_text="the peer's label on shadow agents, else null")

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


class RunSerializer(serializers.ModelSerializer):
    agent_id = serializers.CharField(read_only=True)

    class Meta:
        model = Run
        fields = [
            "id",
            "agent_id",
            "input",
            "status",
            "output",
            "error",
            "created_at",
            "started_at",
            "finished_at",
        ]


class AgentEventSerializer(serializers.ModelSerializer):
    agent_id = serializers.CharField(read_only=True)
    run_id = serializers.CharField(allow_null=True, read_only=True)

    class Meta:
        model = AgentEvent
        fields = ["id", "agent_id", "run_id", "type", "message", "metadata", "created_at", "mirrored"]


class AgentMessageSerializer(serializers.ModelSerializer):
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
        # A CLI with hooks: pasted into its pane, not yet taken (delivered waits for the
        # CLI's UserPromptSubmit hook; docs/agents.md "Hooks").
        extra_kwargs = {"pasted_at": {"help_text": "when the text was pasted into a CLI's pane (null: not yet)"}}

    def to_representation(self, instance: AgentMessage) -> dict[str, Any]:
        """The fields of ``Meta.fields`` as ``ModelSerializer`` renders them (timestamps
        ISO 8601 in the current time zone, ``Z`` for UTC; nulls as ``None``), built
        directly: a message is rendered on every send (the answer and its
        ``message.created`` frame) and ``ModelSerializer`` rebuilds its fields from the
        model for each instance, most of a small message's cost."""
        sender_user = None
        if instance.sender_user_id is not None:
            try:
                sender_user = instance.sender_user
            except ObjectDoesNotExist:  # deleted meanwhile: null, as DRF's attribute lookup gives
                sender_user = None
        return {
            "id": instance.pk,
            "sender_agent_id": None if instance.sender_agent_id is None else str(instance.sender_agent_id),
            "sender_user": None if sender_user is None else str(sender_user.get_username()),
            "recipient_agent_id": str(instance.recipient_agent_id),
            "content": str(instance.content),
            "status": str(instance.status),
            "error": str(instance.error),
            "created_at": _timestamp(instance.created_at),
            "pasted_at": _timestamp(instance.pasted_at),
            "delivered_at": _timestamp(instance.delivered_at),
        }


# One unbound DRF field renders every message timestamp exactly as a ModelSerializer's would.
_TIMESTAMP = serializers.DateTimeField(read_only=True)


def _timestamp(value: datetime | None) -> str | None:
    return None if value is None else _TIMESTAMP.to_representation(value)


class ApprovalRuleSerializer(serializers.ModelSerializer):
    agent_id = serializers.CharField(allow_null=True, read_only=True, help_text="null: every agent of the user")
    created_by_approval_id = serializers.CharField(
        allow_null=True, read_only=True, help_text='the approval whose "Always allow this rule" made it'
    )

    class Meta:
        model = ApprovalRule
        fields = ["id", "agent_id", "tool", "pattern", "action", "created_at", "created_by_approval_id"]


class ApprovalSerializer(serializers.ModelSerializer):
    """An approval (docs/agents.md "Approvals"): what was asked, the answer and who gave it
    (``answered_by`` in words; the answerer's user, agent, rule or linked instance)."""

    agent_id = serializers.CharField(read_only=True)
    agent_name = serializers.CharField(source="agent.name", read_only=True)
    answered_by_user = serializers.CharField(
        source="answered_by_user.get_username", allow_null=True, read_only=True, default=None
    )
    answered_by_agent_id = serializers.CharField(allow_null=True, read_only=True)
    answered_by_peer = serializers.SerializerMethodField(help_text="the linked instance's label, or null")
    rule = ApprovalRuleSerializer(
        source="answered_by_rule", allow_null=True, read_only=True, help_text="the policy rule that decided, or null"
    )

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


def approval_data(approval: Approval) -> dict[str, Any]:
    """The approval as a JSON-safe dict (``ApprovalSerializer``)."""
    return dict(ApprovalSerializer(approval).data)


def agent_data(agent: Agent) -> dict[str, Any]:
    """The agent as a JSON-safe dict (timestamps as ISO 8601 strings)."""
    return dict(AgentSerializer(agent).data)


def run_data(run: Run) -> dict[str, Any]:
    """The run as a JSON-safe dict."""
    return dict(RunSerializer(run).data)


def event_data(event: AgentEvent) -> dict[str, Any]:
    """The event as a JSON-safe dict."""
    return dict(AgentEventSerializer(event).data)
