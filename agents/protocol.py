"""Typed wire messages of the agents app (docs/ws-protocol.md#send-agent-prompt).

- ``AgentPromptBody``: a prompt ``{instruction, input?, options?}``, the body of
  ``POST /api/v1/agents/{id}/prompt`` and what it documents;
- ``SendAgentPromptBody``: the body of the ``/ws`` action ``send-agent-prompt``
  (``agentId`` and a prompt's fields, checked after the agent);
- ``UserEventMessage``: the channel-layer message ``agents.services.publish_on_commit``
  sends to a user's live-events group, which every ws session and event stream of the
  user receives;
- ``CliDoorbellMessage``: the channel-layer ring ``agents.messages.doorbell_ring`` sends to
  a host's CLI supervisor (``dispatch.background.cli_supervisor_loop``) when a message
  waits for one of its agents;
- ``agent_event_frame`` / ``run_finished_frame``: the ``/ws`` events made from those
  (``agent-event``, ``run-finished``; never a nonce).
"""

from typing import Any, Literal, NotRequired

from pydantic import Field, JsonValue, SkipValidation, ValidationError

# typing_extensions' TypedDict and no ``from __future__ import annotations`` in this module:
# on Python 3.11 only then does a frame type know which keys are NotRequired.
from typing_extensions import TypedDict

from core.errors import InvalidRequest
from core.protocol import ChannelMessage
from core.validation import RawText, WireModel

FINISHED_RUN_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
NOT_AN_OBJECT = "body must be a JSON object with agentId and instruction"


class AgentPromptBody(WireModel):
    """A prompt: ``{instruction, input?, options?}`` (docs/agents.md#prompts-and-runs), the
    body of ``POST /api/v1/agents/{id}/prompt`` (validated with
    ``core.validation.parse_request``: 400 ``VALIDATION_ERROR`` naming the field) and,
    with ``agentId``, of the ``/ws`` action ``send-agent-prompt``
    (``SendAgentPromptBody``). ``options`` (``remotes``, ``tools``, …) are checked by
    ``agents.prompting.prompt_options_check``; ``input`` must be null for a CLI agent."""

    instruction: RawText = Field(description="what the agent is asked (a CLI agent gets it typed)")
    input: JsonValue = Field(default=None, description="any JSON value the run gets beside the instruction")
    options: dict[str, JsonValue] | None = Field(
        default=None,
        description='{"remotes": [name | {"name", "prefix"}], "tools": [native tool name], …}; '
        '"instruction" and "input" are reserved',
    )


class SendAgentPromptBody(WireModel):
    """``send-agent-prompt`` body: ``{agentId}`` and an ``AgentPromptBody``'s fields
    (docs/ws-protocol.md#send-agent-prompt).

    Only the shape is checked here (an object); the fields are passed on as sent to
    ``agents.lifecycle.agent_prompt_any``, which checks them in the order the wire pins:
    the agent first (``no agent 'x'``, whatever else is wrong), then the instruction,
    options and input, each refusal a sentence of its own (``instruction must be a
    non-empty string``).
    """

    # JSON values as the frame carried them (core.wire read it), not copied: the service
    # judges them, after the agent.
    agent_id: SkipValidation[JsonValue] = Field(default=None, alias="agentId")
    instruction: SkipValidation[JsonValue] = None
    input: SkipValidation[JsonValue] = None
    options: SkipValidation[JsonValue] = None

    @classmethod
    def parse(cls, body: Any) -> "SendAgentPromptBody":
        """Validate a ``send-agent-prompt`` body; ``InvalidRequest`` ("body must be a JSON
        object with agentId and instruction") when it is not an object."""
        try:
            return cls.model_validate(body)
        except ValidationError:
            raise InvalidRequest(NOT_AN_OBJECT) from None


class UserEventMessage(ChannelMessage):
    """``user.event``: ``{"type": "user.event", "event": <name>, "data": {...}}``, one of the
    user's live events (``agent.upsert``, ``agent.deleted``, ``agent.event``,
    ``run.updated``, ``message.created``, …; docs/agents.md#the-live-event-stream); ``data`` is the row as
    the REST API shows it (JSON-safe)."""

    type: Literal["user.event"] = "user.event"
    event: str
    data: dict[str, Any]


class CliDoorbellMessage(ChannelMessage):
    """``cli.doorbell``: a message waits for a CLI agent of the host whose group it rings
    (``agents.messages.doorbell_group``); its supervisor passes now rather than at its
    next period."""

    type: Literal["cli.doorbell"] = "cli.doorbell"


class AgentEventFrame(TypedDict):
    """The ``/ws`` event ``{"action": "agent-event", "agentId", "runId", "event": {type,
    message, metadata, created_at}}`` (docs/ws-protocol.md#agent-event)."""

    action: Literal["agent-event"]
    agentId: Any
    runId: Any
    event: dict[str, Any]


class RunFinishedFrame(TypedDict):
    """The ``/ws`` event ``{"action": "run-finished", "agentId", "runId", "status",
    "output" | "error"}``: ``output`` when ``status`` is ``succeeded``, ``error`` otherwise
    (docs/ws-protocol.md#run-finished)."""

    action: Literal["run-finished"]
    agentId: Any
    runId: Any
    status: str
    output: NotRequired[Any]
    error: NotRequired[Any]


def agent_event_frame(data: dict[str, Any]) -> AgentEventFrame:
    """The ``/ws`` event for an ``agent.event``: ``{"action": "agent-event", "agentId",
    "runId", "event": {type, message, metadata, created_at}}``
    (docs/ws-protocol.md#agent-event)."""
    return {
        "action": "agent-event",
        "agentId": data.get("agent_id"),
        "runId": data.get("run_id"),
        "event": {key: data.get(key) for key in ("type", "message", "metadata", "created_at")},
    }


def run_finished_frame(data: dict[str, Any]) -> RunFinishedFrame | None:
    """The ``/ws`` event for a ``run.updated`` whose run finished: ``{"action":
    "run-finished", "agentId", "runId", "status", "output" | "error"}`` (docs/ws-protocol.md#run-finished); ``None``
    while the run is not finished."""
    status = data.get("status")
    if status not in FINISHED_RUN_STATUSES:
        return None
    frame: RunFinishedFrame = {
        "action": "run-finished",
        "agentId": data.get("agent_id"),
        "runId": data.get("id"),
        "status": status,
    }
    if status == "succeeded":
        frame["output"] = data.get("output", "")
    else:
        frame["error"] = data.get("error", "")
    return frame
