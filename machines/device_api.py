"""The shim's device-login endpoints (docs/shim-protocol.md, device login: RFC 8628):
unauthenticated and rate-limited per client address; errors are RFC 6749 §5.2 answers, and
every answer carries ``Cache-Control: no-store``. Their bodies are ``machines.device_schemas``
models; the flow itself is ``machines.services.device``."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from limits import parse

from core.errors import InvalidRequest
from core.openapi import OPEN, Operation, documented
from core.services import rate_limiter
from machines.device_schemas import (
    DeviceCodeAnswer,
    DeviceCodeBody,
    DeviceFlowErrorAnswer,
    DeviceTokenAnswer,
    DeviceTokenBody,
)
from machines.services import device

DEVICE_ENDPOINT_RATE = "30 per 60 seconds"  # per client address, each device endpoint


DEVICE_ERRORS = {400: DeviceFlowErrorAnswer, 429: DeviceFlowErrorAnswer}  # RFC 6749 §5.2's shape


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


def _not_cached(response: JsonResponse) -> JsonResponse:
    """RFC 6749 §5.1: token endpoint answers, success and error alike, carry both headers
    (``Pragma`` for HTTP/1.0 caches); the device code answer holds a secret too."""
    response["Cache-Control"] = "no-store"
    response["Pragma"] = "no-cache"
    return response


def _oauth_error(error: str, description: str, status: int = 400) -> JsonResponse:
    return _not_cached(JsonResponse({"error": error, "error_description": description}, status=status))


@documented(
    Operation(
        "post",
        "Start a shim's device login (RFC 8628 §3.1); unauthenticated, rate-limited",
        "machines",
        DeviceCodeBody,
        DeviceCodeAnswer,
        security=OPEN,
        form=True,
        errors=DEVICE_ERRORS,
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
    return _not_cached(JsonResponse(grant.as_response()))


@documented(
    Operation(
        "post",
        "Poll for the machine token (RFC 8628 §3.4); errors as RFC 6749 §5.2",
        "machines",
        DeviceTokenBody,
        DeviceTokenAnswer,
        security=OPEN,
        form=True,
        errors=DEVICE_ERRORS,
    ),
    rate_limited=True,
)
@csrf_exempt
@login_not_required
@require_POST
def device_token(request: HttpRequest) -> JsonResponse:
    """``POST /api/v1/machines/device/token`` ``{grant_type, device_code}`` (RFC 8628 §3.4–3.5),
    JSON or form-encoded; every answer is ``Cache-Control: no-store`` + ``Pragma: no-cache``."""
    if _device_throttled(request, "token"):
        return _oauth_error("slow_down", "too many requests; try again in a minute", status=429)
    try:
        body = DeviceTokenBody.model_validate(_device_body(request))
        issued = device.device_token_poll(device_code=body.device_code, grant_type=body.grant_type)
    except device.DeviceFlowError as exc:
        return _oauth_error(exc.error, exc.message)
    answer = DeviceTokenAnswer(access_token=issued.raw, token_type="Bearer", machine_id=issued.token.machine_id)
    return _not_cached(JsonResponse(answer.model_dump()))
