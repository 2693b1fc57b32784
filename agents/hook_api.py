"""``POST /api/v1/agents/{id}/hooks``: a CLI agent's hook reports (docs/agents.md "Hooks"),
and ``GET /api/v1/agents/{id}/hooks/approvals/{approval_id}``: the answer its
``PermissionRequest`` hook waits for (docs/agents.md "Approvals").

Called by ``agents/hook_client.py``, which a CLI runs at each hook event. Only the
agent's OWN token (``DISPATCH_MCP_TOKEN``) may report for it: another agent's token and a
user's credentials are refused (403), so nothing but the CLI Dispatch started can move
its state or confirm its messages.
"""

from __future__ import annotations

import json
from typing import Any

from django.utils import timezone
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from agents import approval_selectors, approvals, cli_hooks, selectors
from agents.models import Agent, Approval
from agents.tokens import calling_agent
from core.api import DispatchAPIView
from core.authentication import authenticated_user
from core.errors import DispatchError


class HookPayloadField(serializers.JSONField):
    """A hook's stdin JSON: an object (at most ``cli_hooks.MAX_PAYLOAD_BYTES`` of UTF-8
    JSON) or null."""

    def to_internal_value(self, data: Any) -> Any:
        if data is None:
            return None
        if not isinstance(data, dict):
            raise serializers.ValidationError("must be a JSON object or null")
        if _holds_nul(data):  # PostgreSQL stores no NUL, in text or in jsonb
            raise serializers.ValidationError("must not hold a NUL character")
        size = len(json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > cli_hooks.MAX_PAYLOAD_BYTES:
            raise serializers.ValidationError(f"must be at most {cli_hooks.MAX_PAYLOAD_BYTES} bytes of JSON")
        return data


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(key) or _holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_holds_nul(item) for item in value)
    return False


class HookReportSerializer(serializers.Serializer):
    event = serializers.ChoiceField(choices=cli_hooks.HOOK_EVENTS)
    payload = HookPayloadField(allow_null=True)


class HookApprovalSerializer(serializers.Serializer):
    id = serializers.CharField()
    status = serializers.ChoiceField(choices=Approval.Status.values)
    decision = serializers.CharField(allow_blank=True)
    expires_at = serializers.DateTimeField()
    wait_seconds = serializers.FloatField(help_text="seconds left until the approval expires (0 once answered)")
    poll_seconds = serializers.FloatField(help_text="seconds the hook client waits between its reads")


def _approval_body(approval: Approval | None) -> dict[str, Any] | None:
    """The approval as the hook client reads it (``HookApprovalSerializer``), or ``None``."""
    if approval is None:
        return None
    left = 0.0
    if approval.status == Approval.Status.PENDING:
        left = max(0.0, (approval.expires_at - timezone.now()).total_seconds())
    return {
        "id": approval.pk,
        "status": approval.status,
        "decision": approval.decision,
        "expires_at": approval.expires_at.isoformat(),
        "wait_seconds": round(left, 3),
        "poll_seconds": cli_hooks.APPROVAL_POLL_SECONDS,
    }


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


HookAnswerSerializer = inline_serializer(
    "HookAnswer",
    {
        "output": serializers.JSONField(allow_null=True),
        "approval": HookApprovalSerializer(allow_null=True, required=False),
    },
)


class AgentHookView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/hooks`` ``{"event", "payload"}`` → 200 ``{"output": null | {...}}``,
    plus ``"approval"`` (``HookApprovalSerializer``) for a ``PermissionRequest``: when it is
    ``pending`` the hook client reads ``GET .../hooks/approvals/{id}`` every
    ``poll_seconds`` until its output comes (docs/agents.md "Approvals").

    401 without a valid token, 403 for a token that is not this agent's own (another
    agent's, a user's), 404 for an unknown agent, 400 for a bad body (an event not in
    ``cli_hooks.HOOK_EVENTS``, a payload that is not an object or null); nothing changes
    on any error.
    """

    @extend_schema(
        request=HookReportSerializer,
        responses={200: HookAnswerSerializer},
    )
    def post(self, request: Request, agent_id: str) -> Response:
        agent = _own_agent(request, agent_id)
        incoming = HookReportSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        answer = cli_hooks.hook_event_record(
            agent=agent, event=incoming.validated_data["event"], payload=incoming.validated_data["payload"]
        )
        body: dict[str, Any] = {"output": answer.output}
        if answer.approval is not None:
            body["approval"] = _approval_body(answer.approval)
        return Response(body)


class AgentHookApprovalView(DispatchAPIView):
    """``GET /api/v1/agents/{id}/hooks/approvals/{approval_id}`` → 200 ``{"output": null |
    {...}, "approval": {...}}``: what the agent's waiting ``PermissionRequest`` hook prints
    once answered (``cli_hooks.approval_output``); ``output`` null while pending. An
    approval whose time is up is expired first (its default applies). The agent's own
    token only (as the hooks route: 401, 403); 404 for an approval not of this agent.
    Each read is one short query: the client waits between reads, the server never holds
    the request (docs/agents.md "Approvals").
    """

    @extend_schema(responses={200: HookAnswerSerializer})
    def get(self, request: Request, agent_id: str, approval_id: str) -> Response:
        agent = _own_agent(request, agent_id)
        if selectors.is_valid_id(approval_id):
            approvals.approvals_expire_due(approval_id=approval_id)
        approval = approval_selectors.approval_of_agent(agent=agent, approval_id=approval_id)
        return Response({"output": cli_hooks.approval_output(approval), "approval": _approval_body(approval)})
