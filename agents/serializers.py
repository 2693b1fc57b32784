"""Output shapes of agents, runs, events, messages and approvals (docs/agents.md#the-rest-api).

One pydantic model per object for the REST API and for the live events broadcast after
each change, so a list item, a single-object answer and an ``agent.upsert`` frame carry
the same fields; the views document their answers with the same models. REST fields are
snake_case; timestamps are ISO 8601 in the current time zone (UTC: ``…Z``, microseconds
kept), as DRF wrote them before these models.

Each model's ``from_row(row)`` reads the database row (its related rows as the queries
of ``agents.selectors`` select them); ``<name>_data(row)`` is its JSON-safe dict.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from django.core.exceptions import ObjectDoesNotExist
from django.utils import timezone
from pydantic import AfterValidator, BaseModel, Field, JsonValue

from agents.models import Agent, AgentEvent, AgentMessage, Approval, ApprovalRule, Run


def _in_current_zone(value: datetime) -> datetime:
    # What DRF's DateTimeField wrote: the time in the current time zone, so an answer
    # reads the same whichever process made the row.
    return timezone.localtime(value) if timezone.is_aware(value) else timezone.make_aware(value)


Timestamp = Annotated[datetime, AfterValidator(_in_current_zone)]


def _one_of(choices: list[str], description: str | None = None) -> Any:
    """A text field whose schema names its values (a model's ``choices``): an answer shows
    what is stored, so the values are described, not enforced."""
    return Field(json_schema_extra={"enum": list(choices)}, description=description)


def _related(row: Any, field: str) -> Any:
    """``row``'s related object ``field``, ``None`` when unset or deleted meanwhile (as DRF's
    attribute lookup gave)."""
    if getattr(row, f"{field}_id") is None:
        return None
    try:
        return getattr(row, field)
    except ObjectDoesNotExist:
        return None


def _username(row: Any, field: str) -> str | None:
    """The username of ``row``'s user ``field``, ``None`` when unset or deleted meanwhile
    (as DRF's attribute lookup gave)."""
    if getattr(row, f"{field}_id") is None:
        return None
    try:
        user = getattr(row, field)
    except ObjectDoesNotExist:
        return None
    return None if user is None else str(user.get_username())


def _id(value: Any) -> str | None:
    return None if value is None else str(value)


class AgentData(BaseModel):
    """An agent (docs/agents.md#the-rest-api)."""

    id: str
    owner: str = Field(description="the owner's username")
    name: str
    type: str
    status: str = _one_of(Agent.Status.values)
    cwd: str
    parent: str | None = Field(description="the parent agent's id, or null")
    launched_by: str | None = Field(description="the id of the agent that launched it, or null")
    launched_by_peer: JsonValue = Field(description="who launched it from a linked instance, or null")
    host: str
    full_access: bool
    latest_event_type: str
    latest_event_message: str
    latest_event_at: Timestamp | None
    peer: str | None = Field(description="the peer's label on shadow agents, else null")
    peer_agent_id: str
    stale: bool
    last_error: str
    created_at: Timestamp
    updated_at: Timestamp

    @classmethod
    def from_row(cls, agent: Agent) -> AgentData:
        """``agent`` with its owner (and its peer, on a shadow agent)."""
        return cls(
            id=agent.pk,
            owner=str(agent.owner.get_username()),
            name=agent.name,
            type=agent.type,
            status=agent.status,
            cwd=agent.cwd,
            parent=_id(agent.parent_id),
            launched_by=_id(agent.launched_by_id),
            launched_by_peer=agent.launched_by_peer,
            host=agent.host,
            full_access=agent.full_access,
            latest_event_type=agent.latest_event_type,
            latest_event_message=agent.latest_event_message,
            latest_event_at=agent.latest_event_at,
            peer=agent.peer.label if agent.peer_id is not None and agent.peer is not None else None,
            peer_agent_id=agent.peer_agent_id,
            stale=agent.stale,
            last_error=agent.last_error,
            created_at=agent.created_at,
            updated_at=agent.updated_at,
        )


class RunData(BaseModel):
    """A run of an expert agent (docs/agents.md#prompts-and-runs)."""

    id: str
    agent_id: str
    input: JsonValue = Field(description='{"instruction", "input", **options}')
    status: str = _one_of(Run.Status.values)
    output: str
    error: str
    created_at: Timestamp
    started_at: Timestamp | None
    finished_at: Timestamp | None

    @classmethod
    def from_row(cls, run: Run) -> RunData:
        return cls(
            id=run.pk,
            agent_id=str(run.agent_id),
            input=run.input,
            status=run.status,
            output=run.output,
            error=run.error,
            created_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
        )


class AgentEventData(BaseModel):
    """One event of an agent's timeline (docs/agents.md#the-timeline)."""

    id: int
    agent_id: str
    run_id: str | None
    type: str = _one_of(AgentEvent.Type.values)
    message: str
    metadata: JsonValue
    created_at: Timestamp
    mirrored: bool

    @classmethod
    def from_row(cls, event: AgentEvent) -> AgentEventData:
        return cls(
            id=event.pk,
            agent_id=str(event.agent_id),
            run_id=_id(event.run_id),
            type=event.type,
            message=event.message,
            metadata=event.metadata,
            created_at=event.created_at,
            mirrored=event.mirrored,
        )


class AgentMessageData(BaseModel):
    """A message to an agent (docs/agents.md#messages-and-their-status)."""

    id: int
    sender_agent_id: str | None
    sender_user: str | None = Field(description="the sending user's username, or null")
    recipient_agent_id: str
    content: str
    status: str = _one_of(AgentMessage.Status.values)
    error: str
    created_at: Timestamp
    # A CLI with hooks: pasted into its pane, not yet taken (delivered waits for the CLI's
    # UserPromptSubmit hook; docs/agents.md#hooks).
    pasted_at: Timestamp | None = Field(description="when the text was pasted into a CLI's pane (null: not yet)")
    delivered_at: Timestamp | None

    @classmethod
    def from_row(cls, message: AgentMessage) -> AgentMessageData:
        """``message`` with its sending user (``select_related`` it for a page)."""
        return cls(
            id=message.pk,
            sender_agent_id=_id(message.sender_agent_id),
            sender_user=_username(message, "sender_user"),
            recipient_agent_id=str(message.recipient_agent_id),
            content=message.content,
            status=message.status,
            error=message.error,
            created_at=message.created_at,
            pasted_at=message.pasted_at,
            delivered_at=message.delivered_at,
        )


class ApprovalRuleData(BaseModel):
    """An approval rule (docs/agents.md#approvals)."""

    id: int
    agent_id: str | None = Field(description="null: every agent of the user")
    tool: str
    pattern: str
    action: str = _one_of(ApprovalRule.Action.values)
    created_at: Timestamp
    created_by_approval_id: str | None = Field(description='the approval whose "Always allow this rule" made it')

    @classmethod
    def from_row(cls, rule: ApprovalRule) -> ApprovalRuleData:
        return cls(
            id=rule.pk,
            agent_id=_id(rule.agent_id),
            tool=rule.tool,
            pattern=rule.pattern,
            action=rule.action,
            created_at=rule.created_at,
            created_by_approval_id=_id(rule.created_by_approval_id),
        )


class ApprovalData(BaseModel):
    """An approval (docs/agents.md#approvals): what was asked, the answer and who gave it
    (``answered_by`` in words; the answerer's user, agent, rule or linked instance)."""

    id: str
    agent_id: str
    agent_name: str
    tool_name: str
    tool_input: JsonValue
    tool_summary: str
    suggestions: JsonValue
    hook_event: str
    status: str = _one_of(Approval.Status.values)
    decision: str = _one_of(Approval.Decision.values, '"" until answered')
    message: str
    answered_by: str
    answered_by_user: str | None
    answered_by_agent_id: str | None
    answered_by_peer: str | None = Field(description="the linked instance's label, or null")
    rule: ApprovalRuleData | None = Field(description="the policy rule that decided, or null")
    asked_at: Timestamp
    answered_at: Timestamp | None
    expires_at: Timestamp

    @classmethod
    def from_row(cls, approval: Approval) -> ApprovalData:
        """``approval`` with its agent, answering user, rule and linked instance."""
        rule = _related(approval, "answered_by_rule")
        peer = _related(approval, "answered_by_peer")
        return cls(
            id=approval.pk,
            agent_id=str(approval.agent_id),
            agent_name=approval.agent.name,
            tool_name=approval.tool_name,
            tool_input=approval.tool_input,
            tool_summary=approval.tool_summary,
            suggestions=approval.suggestions,
            hook_event=approval.hook_event,
            status=approval.status,
            decision=approval.decision,
            message=approval.message,
            answered_by=approval.answered_by,
            answered_by_user=_username(approval, "answered_by_user"),
            answered_by_agent_id=_id(approval.answered_by_agent_id),
            answered_by_peer=peer.label if peer is not None else None,
            rule=None if rule is None else ApprovalRuleData.from_row(rule),
            asked_at=approval.asked_at,
            answered_at=approval.answered_at,
            expires_at=approval.expires_at,
        )


def approval_data(approval: Approval) -> dict[str, Any]:
    """The approval as a JSON-safe dict (``ApprovalData``)."""
    return ApprovalData.from_row(approval).model_dump(mode="json")


def agent_data(agent: Agent) -> dict[str, Any]:
    """The agent as a JSON-safe dict (``AgentData``; timestamps as ISO 8601 strings)."""
    return AgentData.from_row(agent).model_dump(mode="json")


def run_data(run: Run) -> dict[str, Any]:
    """The run as a JSON-safe dict (``RunData``)."""
    return RunData.from_row(run).model_dump(mode="json")


def event_data(event: AgentEvent) -> dict[str, Any]:
    """The event as a JSON-safe dict (``AgentEventData``)."""
    return AgentEventData.from_row(event).model_dump(mode="json")


def message_data(message: AgentMessage) -> dict[str, Any]:
    """The message as a JSON-safe dict (``AgentMessageData``)."""
    return AgentMessageData.from_row(message).model_dump(mode="json")


def rule_data(rule: ApprovalRule) -> dict[str, Any]:
    """The approval rule as a JSON-safe dict (``ApprovalRuleData``)."""
    return ApprovalRuleData.from_row(rule).model_dump(mode="json")
