"""``POST /api/v1/agents/{id}/hooks``: a CLI agent's hook reports (docs/agents.md "Hooks").

Called by ``agents/hook_client.py``, which a CLI runs at each hook event. Only the
agent's OWN token (``DISPATCH_MCP_TOKEN``) may report for it: another agent's token and a
user's credentials are refused (403), so nothing but the CLI Dispatch started can move
its state or confirm its messages.
"""

from __future__ import annotations

import json
from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from agents import cli_hooks, selectors
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


class AgentHookView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/hooks`` ``{"event", "payload"}`` → 200 ``{"output": null | {...}}``.

    401 without a valid token, 403 for a token that is not this agent's own (another
    agent's, a user's), 404 for an unknown agent, 400 for a bad body (an event not in
    ``cli_hooks.HOOK_EVENTS``, a payload that is not an object or null); nothing changes
    on any error.
    """

    @extend_schema(
        request=HookReportSerializer,
        responses={200: inline_serializer("HookAnswer", {"output": serializers.JSONField(allow_null=True)})},
    )
    def post(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        caller = calling_agent(request)
        if caller is None or caller.pk != agent.pk:
            who = "a user's credentials" if caller is None else f"the token of agent '{caller.pk}'"
            raise DispatchError(
                "PERMISSION_DENIED",
                f"only agent '{agent.pk}' itself (its DISPATCH_MCP_TOKEN) may report its hooks, not {who}",
                {"agent_id": agent.pk},
            )
        incoming = HookReportSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        output = cli_hooks.hook_event_record(
            agent=agent, event=incoming.validated_data["event"], payload=incoming.validated_data["payload"]
        )
        return Response({"output": output})
