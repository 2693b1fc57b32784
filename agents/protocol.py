"""Typed wire messages of the agents app (docs/ws-protocol.md#send-agent-prompt).

- ``SendAgentPromptBody``: the body of the ``/ws`` action ``send-agent-prompt``;
- ``UserEventMessage``: the channel-layer message ``agents.services.publish_on_commit``
  sends to a user's live-events group, which every ws session and event stream of the
  user receives;
- ``CliDoorbellMessage``: the channel-layer ring ``agents.messages.doorbell_ring`` sends to
  a host's CLI supervisor (``dispatch.background.cli_supervisor_loop``) when a message
  waits for one of its agents;
- ``agent_event_frame`` / ``run_finished_frame``: the ``/ws`` events made from those
  (``agent-event``, ``run-finished``; never a nonce).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.errors import InvalidRequest
from core.protocol import ChannelMessage

FINISHED_RUN_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
NOT_AN_OBJECT = "body must be a JSON object with agentId and instruction"


class SendAgentPromptBody(BaseModel):
    """``send-agent-prompt`` body: ``{agentId, instruction, input?, options?}``.

    Only the shape is checked here (an object); the fields are passed as sent to
    ``agents.prompting.agent_prompt_any``, which checks them in the order the wire pins:
    the agent first (``no agent 'x'``), then the instruction, options and input.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    agent_id: Any = Field(default=None, alias="agentId")
    instruction: Any = None
    input: Any = None
    options: Any = None

    @classmethod
    def parse(cls, body: Any) -> SendAgentPromptBody:
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


def agent_event_frame(data: dict[str, Any]) -> dict[str, Any]:
    """The ``/ws`` event for an ``agent.event``: ``{"action": "agent-event", "agentId",
    "runId", "event": {type, message, metadata, created_at}}``
    (docs/ws-protocol.md#agent-event)."""
    return {
        "action": "agent-event",
        "agentId": data.get("agent_id"),
        "runId": data.get("run_id"),
        "event": {key: data.get(key) for key in ("type", "message", "metadata", "created_at")},
    }


def run_finished_frame(data: dict[str, Any]) -> dict[str, Any] | None:
    """The ``/ws`` event for a ``run.updated`` whose run finished: ``{"action":
    "run-finished", "agentId", "runId", "status", "output" | "error"}`` (docs/ws-protocol.md#run-finished); ``None``
    while the run is not finished."""
    status = data.get("status")
    if status not in FINISHED_RUN_STATUSES:
        return None
    frame: dict[str, Any] = {"action": "run-finished", "agentId": data.get("agent_id"), "runId": data.get("id")}
    frame["status"] = status
    if status == "succeeded":
        frame["output"] = data.get("output", "")
    else:
        frame["error"] = data.get("error", "")
    return frame
