"""REST routes of the remotes app (``/api/v1/remotes``)."""

from __future__ import annotations

import json

from channels.db import database_sync_to_async
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from dispatch.api import DispatchAPIView
from dispatch.authentication import authenticated_user
from dispatch.errors import DispatchError, InvalidRequest
from dispatch.services import AuthenticationFailed, api_token_authenticate
from remotes.calls import call_from_body
from remotes.selectors import remotes_for


class FunctionSpecSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    parameters = serializers.JSONField()


class RemoteSerializer(serializers.Serializer):
    remotename = serializers.CharField(source="name")
    functions = FunctionSpecSerializer(source="tools", many=True)
    ws_session = serializers.CharField(source="ws_session_id")
    connected_at = serializers.DateTimeField()


class RemoteListView(DispatchAPIView):
    """``GET /api/v1/remotes`` → ``{"remotes": [...]}``: the caller's connected remotes."""

    @extend_schema(responses={200: inline_serializer("RemoteList", {"remotes": RemoteSerializer(many=True)})})
    def get(self, request: Request) -> Response:
        return Response({"remotes": RemoteSerializer(remotes_for(user=authenticated_user(request)), many=True).data})


def _error(exc: DispatchError) -> JsonResponse:
    response = JsonResponse(exc.as_dict(), status=exc.http_status)
    if exc.http_status == 401:
        response["WWW-Authenticate"] = "Bearer"
    return response


@csrf_exempt
@login_not_required
@require_POST
async def remote_call_api(request: HttpRequest, remotename: str) -> JsonResponse:
    """``POST /api/v1/remotes/{remotename}/call`` with ``{function, args, timeout?}`` (bearer token).

    An async view, not DRF: the wait happens on the channel layer, never on the shared
    sync thread. 200 ``{"result": …}``; errors in the one error shape (404 not connected,
    400 bad arguments, 502 disconnected or failed, 503 busy, 504 timeout).
    """
    scheme, _, raw = request.headers.get("Authorization", "").partition(" ")
    try:
        if scheme.lower() != "bearer" or not raw:
            raise DispatchError("NOT_AUTHENTICATED", "authentication required: send 'Authorization: Bearer <token>'")
        try:
            token = await database_sync_to_async(api_token_authenticate)(raw.strip())
        except AuthenticationFailed:
            raise DispatchError("AUTHENTICATION_FAILED", "invalid, expired or revoked token") from None
        try:
            body = json.loads(request.body or b"{}")
        except ValueError as exc:
            raise InvalidRequest(f"body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("body must be a JSON object")
        result = await call_from_body(user=token.user, body={**body, "remotename": remotename})
    except DispatchError as exc:
        return _error(exc)
    return JsonResponse({"result": result}, json_dumps_params={"ensure_ascii": False}, safe=False)
