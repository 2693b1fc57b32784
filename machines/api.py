"""REST routes of the machines app (machines.md §1, §6; issue "Machines" item 7).

The device-login endpoints are unauthenticated (rate-limited) and answer RFC 8628 /
RFC 6749 §5.2 errors. The operation routes wait on a shim, so they are async views. The
bodies of these plain views are the models of ``machines.protocol``, which validate them
and describe them in the OpenAPI schema (``core.openapi.documented``).
"""

from __future__ import annotations

import json
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.contrib.auth.models import User
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST
from drf_spectacular.utils import extend_schema, inline_serializer
from limits import parse
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from agents.tokens import agent_scope_forbid, agent_scope_session, calling_agent
from core.api import DispatchAPIView
from core.authentication import authenticated_user
from core.errors import InvalidRequest
from core.http import json_api, json_object
from core.openapi import OPEN, Operation, documented
from core.services import rate_limiter
from core.validation import parse_plain
from machines import selectors
from machines.protocol import (
    DefaultMachineAnswer,
    DefaultMachineBody,
    DeviceCodeBody,
    DeviceTokenBody,
    SessionCopyAnswer,
    SessionCopyBody,
    SessionOpAnswer,
    SessionOpBody,
)
from machines.services import connections, device, router
from machines.services.copy import copy_between_machines
from machines.services.operations import attached_machines, machine_op

DEVICE_ENDPOINT_RATE = "30 per 60 seconds"  # per client address, each device endpoint


def _device_body(request: HttpRequest) -> dict[str, Any]:
    if request.content_type == "application/json":
        try:
            body = json.loads(request.body or b"{}")
        except ValueError:
            raise device.DeviceFlowError("invalid_request", "body is not valid JSON") from None
        if not isinstance(body, dict):
            raise device.DeviceFlowError("invalid_request", "body must be a JSON object")
        return body
    return request.POST.dict()


def _device_throttled(request: HttpRequest, endpoint: str) -> bool:
    limit = parse(DEVICE_ENDPOINT_RATE)
    key = (settings.REDIS_PREFIX, "device-endpoint", endpoint, str(request.META.get("REMOTE_ADDR", "")))
    return not rate_limiter().hit(limit, *key)


def _oauth_error(error: str, description: str, status: int = 400) -> JsonResponse:
    response = JsonResponse({"error": error, "error_description": description}, status=status)
    response["Cache-Control"] = "no-store"
    return response


@documented(
    Operation(
        "post",
        "Start a shim's device login (RFC 8628 §3.1); unauthenticated, rate-limited",
        "machines",
        DeviceCodeBody,
        security=OPEN,
        body_required=False,
        responses={"200": "device_code, user_code, verification_uri(_complete), expires_in, interval"},
    ),
    rate_limited=True,
)
@csrf_exempt
@login_not_required
@require_POST
def device_code(request: HttpRequest) -> JsonResponse:
    """``POST /api/v1/machines/device/code`` ``{machine_id, hostname, platform, arch}`` (RFC 8628 §3.1)."""
    if _device_throttled(request, "code"):
        return _oauth_error("slow_down", "too many requests; try again in a minute", status=429)
    try:
        body = DeviceCodeBody.model_validate(_device_body(request))
        grant = device.device_authorization_start(
            machine_id=body.machine_id, hostname=body.hostname, platform=body.platform, arch=body.arch
        )
    except device.DeviceFlowError as exc:
        return _oauth_error(exc.error, exc.message)
    except InvalidRequest as exc:
        return _oauth_error("invalid_request", exc.message)
    response = JsonResponse(grant.as_response())
    response["Cache-Control"] = "no-store"
    return response


@documented(
    Operation(
        "post",
        "Poll for the machine token (RFC 8628 §3.4); errors as RFC 6749 §5.2",
        "machines",
        DeviceTokenBody,
        security=OPEN,
        body_required=False,
        responses={
            "200": "access_token, token_type: Bearer",
            "400": "authorization_pending, slow_down, access_denied, expired_token, invalid_grant",
        },
    ),
    rate_limited=True,
)
@csrf_exempt
@login_not_required
@require_POST
def device_token(request: HttpRequest) -> JsonResponse:
    """``POST /api/v1/machines/device/token`` ``{device_code}`` (RFC 8628 §3.4–3.5)."""
    if _device_throttled(request, "token"):
        return _oauth_error("slow_down", "too many requests; try again in a minute", status=429)
    try:
        issued = device.device_token_poll(device_code=DeviceTokenBody.model_validate(_device_body(request)).device_code)
    except device.DeviceFlowError as exc:
        return _oauth_error(exc.error, exc.message)
    response = JsonResponse({"access_token": issued.raw, "token_type": "Bearer", "machine_id": issued.token.machine_id})
    response["Cache-Control"] = "no-store"
    return response


class MachineSerializer(serializers.Serializer):
    machine_id = serializers.CharField()
    display_name = serializers.CharField(source="name")
    hostname = serializers.CharField()
    platform = serializers.CharField()
    arch = serializers.CharField()
    capabilities = serializers.JSONField()
    granted_capabilities = serializers.JSONField()
    allowed_roots = serializers.JSONField()
    status = serializers.SerializerMethodField()
    is_default = serializers.SerializerMethodField()
    last_active_at = serializers.DateTimeField()
    created_at = serializers.DateTimeField()

    def get_status(self, machine: Any) -> dict[str, str]:
        return {"connection": machine.connection_status, "health": machine.health, "reason": machine.status_reason}

    def get_is_default(self, machine: Any) -> bool:
        return bool(machine.machine_id == self.context.get("default_machine_id"))


class MachineListView(DispatchAPIView):
    """``GET /api/v1/machines`` → ``{"machines": [...]}``: the caller's machines with status."""

    @extend_schema(responses={200: inline_serializer("MachineList", {"machines": MachineSerializer(many=True)})})
    def get(self, request: Request) -> Response:
        user = authenticated_user(request)
        context = {"default_machine_id": router.default_machine_id(user=user)}
        machines = selectors.machines_for(user=user)
        return Response({"machines": MachineSerializer(machines, many=True, context=context).data})


class MachineDetailView(DispatchAPIView):
    """``DELETE /api/v1/machines/{machine_id}``: revoke a machine (its sockets close 4401)."""

    @extend_schema(responses={200: MachineSerializer})
    def delete(self, request: Request, machine_id: str) -> Response:
        agent_scope_forbid(calling_agent(request), "revoke machines")
        machine = connections.machine_revoke(user=authenticated_user(request), machine_id=machine_id)
        return Response(MachineSerializer(machine, context={}).data)


class SessionMachineSerializer(serializers.Serializer):
    """One machine attached to a session, as ``GET /api/v1/sessions/{session_id}/machines``
    answers it: what its shim reports (§5 ``MACHINE_LIST_RESPONSE``) plus its name, status,
    whether it is the default and ``last_active_at`` (ISO 8601, like every REST machine
    route; the ``list_machines`` tool says ``last_active_ts``, epoch seconds, as §6 does)."""

    machine_id = serializers.CharField()
    display_name = serializers.CharField()
    hostname = serializers.CharField(required=False)
    platform = serializers.CharField(required=False)
    arch = serializers.CharField(required=False)
    capabilities = serializers.JSONField(required=False)
    hardware_devices = serializers.JSONField(required=False)
    status = serializers.JSONField()
    is_default = serializers.BooleanField()
    last_active_at = serializers.DateTimeField(allow_null=True)


class SessionMachinesView(DispatchAPIView):
    """``GET /api/v1/sessions/{session_id}/machines`` → ``{"machines": [machine, …]}``, the
    machines attached to the session (``attached_machines``)."""

    @extend_schema(
        responses={200: inline_serializer("SessionMachines", {"machines": SessionMachineSerializer(many=True)})}
    )
    def get(self, request: Request, session_id: str) -> Response:
        agent_scope_session(calling_agent(request), session_id)
        machines = attached_machines(user=authenticated_user(request), session_id=session_id)
        return Response({"machines": SessionMachineSerializer(machines, many=True).data})


@documented(
    Operation(
        "put",
        "Set (or clear, with null) your default machine, named as target_machine may be",
        "machines",
        DefaultMachineBody,
        DefaultMachineAnswer,
    )
)
@require_http_methods(["PUT"])
@json_api
async def default_machine(request: HttpRequest, user: User) -> dict[str, Any]:
    """``PUT /api/v1/machines/default`` ``{"machine_id": "<machine>" | null}`` (``DefaultMachineBody``):
    the routing default (§6 step 3), named as a ``target_machine`` may be (id, host or
    display name, unique prefix) → ``{"machine_id": "<its id>" | null}``. Errors:
    ``MACHINE_NOT_ATTACHED`` (404: none of the caller's machines), ``MACHINE_AMBIGUOUS``
    (409, with the candidates), ``INVALID_REQUEST`` (400), ``PERMISSION_DENIED`` (403: an
    agent token)."""
    agent_scope_forbid(calling_agent(request), "set the default machine")
    body = parse_plain(DefaultMachineBody, json_object(request))
    machine_id = await database_sync_to_async(router.default_machine_set)(user=user, machine=body.machine_id)
    return DefaultMachineAnswer(machine_id=machine_id).model_dump()


@documented(
    Operation("post", "Route an operation to a machine of the session", "machines", SessionOpBody, SessionOpAnswer)
)
@require_POST
@json_api
async def session_op(request: HttpRequest, user: User, session_id: str) -> dict[str, Any]:
    """``POST /api/v1/sessions/{session_id}/ops`` ``{op, payload, target_machine?}``.

    200 ``{"machine_id", "type", "payload"}`` (the shim's response); errors carry the
    spec's code (``MACHINE_NOT_ATTACHED`` 404, ``PATH_OUTSIDE_ALLOWED_ROOT`` 400, …).
    """
    agent_scope_session(calling_agent(request), session_id)
    body = parse_plain(SessionOpBody, json_object(request))
    return await machine_op(
        user=user,
        session_id=session_id,
        op=body.op,
        payload=body.payload,
        target_machine=body.target_machine,
        caller="api",
    )


@documented(
    Operation(
        "post",
        "Copy a file between two machines, verified by SHA-256",
        "machines",
        SessionCopyBody,
        SessionCopyAnswer,
    )
)
@require_POST
@json_api
async def session_copy(request: HttpRequest, user: User, session_id: str) -> dict[str, Any]:
    """``POST /api/v1/sessions/{session_id}/copy`` → ``{"size_bytes", "sha256"}`` (§6 cross-machine copy)."""
    agent_scope_session(calling_agent(request), session_id)
    body = parse_plain(SessionCopyBody, json_object(request))
    return await copy_between_machines(
        user=user,
        session_id=session_id,
        source_machine=body.source_machine,
        source_path=body.source_path,
        destination_machine=body.destination_machine,
        destination_path=body.destination_path,
        overwrite=body.overwrite,
        caller="api",
    )
