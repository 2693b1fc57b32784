"""``POST /api/v1/agents/{id}/hooks``: a CLI agent's hook reports (docs/agents.md#hooks),
and ``GET /api/v1/agents/{id}/hooks/approvals/{approval_id}``: the answer its
``PermissionRequest`` hook waits for (docs/agents.md#approvals).

Called by ``agents/hook_client.py``, which a CLI runs at each hook event. Only the
agent's OWN token (``DISPATCH_MCP_TOKEN``) may report for it: another agent's token and a
user's credentials are refused (403), so nothing but the CLI Dispatch started can move
its state or confirm its messages.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from pydantic import BaseModel, Field, JsonValue, PlainSerializer, WithJsonSchema, field_validator
from rest_framework.request import Request
from rest_framework.response import Response

from agents import approval_selectors, approvals, cli_hooks, selectors
from agents.models import Agent, Approval
from agents.tokens import calling_agent
from core.api import DispatchAPIView
from core.authentication import authenticated_user
from core.errors import DispatchError
from core.validation import WireModel, parse_request

if TYPE_CHECKING:
    HookEvent = str
    ApprovalStatus = str
else:
    HookEvent = Literal[cli_hooks.HOOK_EVENTS]
    ApprovalStatus = Literal[tuple(Approval.Status.values)]


class HookReportBody(WireModel):
    """``POST /api/v1/agents/{id}/hooks``: ``{"event", "payload"}``, one hook event of the
    agent's CLI and its stdin JSON: an object (at most ``cli_hooks.MAX_PAYLOAD_BYTES`` of
    UTF-8 JSON, no NUL anywhere) or null."""

    event: HookEvent
    payload: dict[str, JsonValue] | None = Field(
        description=f"the hook's stdin JSON: an object of at most {cli_hooks.MAX_PAYLOAD_BYTES} bytes, or null"
    )

    @field_validator("payload", mode="before")
    @classmethod
    def _an_object_or_null(cls, value: Any) -> Any:
        # The route's own sentence for anything else, rather than a dictionary's.
        if value is not None and not isinstance(value, dict):
            raise ValueError("must be a JSON object or null")
        return value

    @field_validator("payload")
    @classmethod
    def _storable(cls, value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        if value is None:
            return None
        if _holds_nul(value):  # PostgreSQL stores no NUL, in text or in jsonb
            raise ValueError("must not hold a NUL character")
        size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > cli_hooks.MAX_PAYLOAD_BYTES:
            raise ValueError(f"must be at most {cli_hooks.MAX_PAYLOAD_BYTES} bytes of JSON")
        return value


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(key) or _holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_holds_nul(item) for item in value)
    return False


# The hook client has always read an expiry as Python's isoformat wrote it ("+00:00").
IsoTimestamp = Annotated[
    datetime,
    PlainSerializer(datetime.isoformat, return_type=str),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]


class HookApprovalData(BaseModel):
    """An approval as the hook client reads it (docs/agents.md#approvals)."""

    id: str
    status: ApprovalStatus
    decision: str
    expires_at: IsoTimestamp
    wait_seconds: float = Field(description="seconds left until the approval expires (0 once answered)")
    poll_seconds: float = Field(description="seconds the hook client waits between its reads")

    @classmethod
    def from_row(cls, approval: Approval) -> HookApprovalData:
        left = 0.0
        if approval.status == Approval.Status.PENDING:
            left = max(0.0, (approval.expires_at - timezone.now()).total_seconds())
        return cls(
            id=approval.pk,
            status=approval.status,
            decision=approval.decision,
            expires_at=approval.expires_at,
            wait_seconds=round(left, 3),
            poll_seconds=cli_hooks.APPROVAL_POLL_SECONDS,
        )


class HookAnswerData(BaseModel):
    """What a hook report or an approval read answers: ``output``, the JSON object the CLI
    prints on the hook's stdout (null: nothing), and the approval a ``PermissionRequest``
    made (absent otherwise)."""

    output: dict[str, JsonValue] | None
    approval: HookApprovalData | None = None

    def data(self) -> dict[str, Any]:
        """The JSON-safe dict, without ``approval`` when none was given."""
        return self.model_dump(mode="json", exclude_unset=True)


def _own_agent(request: Request, agent_id: str) -> Agent:
    """The agent ``agent_id`` when the caller is that agent itself (its own token), else
    ``NotFound`` (not the caller's owner's agent) or ``PERMISSION_DENIED``."""
    agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
    caller = calling_agent(request)
    if caller is None or caller.pk != agent.pk:
        who = "a user's credentials" if caller is None else f"the token of agent '{caller.pk}'"
        raise DispatchError(
            "PERMISSION_DENIED",
            f"only agent '{agent.pk}' itself (its DISPATCH_MCP_TOKEN) may report its hooks, not {who}",
            {"agent_id": agent.pk},
        )
    return agent


class AgentHookView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/hooks`` ``{"event", "payload"}`` → 200 ``{"output": null | {...}}``,
    plus ``"approval"`` (``HookApprovalData``) for a ``PermissionRequest``: when it is
    ``pending`` the hook client reads ``GET .../hooks/approvals/{id}`` every
    ``poll_seconds`` until its output comes (docs/agents.md#approvals).

    401 without a valid token, 403 for a token that is not this agent's own (another
    agent's, a user's), 404 for an unknown agent, 400 for a bad body (an event not in
    ``cli_hooks.HOOK_EVENTS``, a payload that is not an object or null); nothing changes
    on any error.
    """

    @extend_schema(
        request=HookReportBody,
        responses={200: HookAnswerData},
    )
    def post(self, request: Request, agent_id: str) -> Response:
        agent = _own_agent(request, agent_id)
        body = parse_request(HookReportBody, request.data)
        answer = cli_hooks.hook_event_record(agent=agent, event=body.event, payload=body.payload)
        if answer.approval is None:
            return Response(HookAnswerData(output=answer.output).data())
        return Response(
            HookAnswerData(output=answer.output, approval=HookApprovalData.from_row(answer.approval)).data()
        )


class AgentHookApprovalView(DispatchAPIView):
    """``GET /api/v1/agents/{id}/hooks/approvals/{approval_id}`` → 200 ``{"output": null |
    {...}, "approval": {...}}``: what the agent's waiting ``PermissionRequest`` hook prints
    once answered (``cli_hooks.approval_output``); ``output`` null while pending. An
    approval whose time is up is expired first (its default applies). The agent's own
    token only (as the hooks route: 401, 403); 404 for an approval not of this agent.
    Each read is one short query: the client waits between reads, the server never holds
    the request (docs/agents.md#approvals).
    """

    @extend_schema(responses={200: HookAnswerData})
    def get(self, request: Request, agent_id: str, approval_id: str) -> Response:
        agent = _own_agent(request, agent_id)
        if selectors.is_valid_id(approval_id):
            approvals.approvals_expire_due(approval_id=approval_id)
        approval = approval_selectors.approval_of_agent(agent=agent, approval_id=approval_id)
        answer = HookAnswerData(
            output=cli_hooks.approval_output(approval), approval=HookApprovalData.from_row(approval)
        )
        return Response(answer.data())
