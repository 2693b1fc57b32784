"""The bodies and answers of the device login routes (``POST /api/v1/machines/device/code``
and ``…/token``: docs/shim-protocol.md#getting-a-token, RFC 8628). Their values are checked
by ``machines.services.device``, which answers RFC 6749 errors, so the models only read
and describe them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, WithJsonSchema

from core.validation import WireModel
from machines.shim.protocol import MACHINE_ID_PATTERN

DEVICE_GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"  # RFC 8628 §3.4


def _device_text(limit: int) -> WithJsonSchema:
    # machines.services.device strips a value, then wants it non-empty and at most `limit`
    # characters: the schema says the same of the value as sent.
    return WithJsonSchema({"type": "string", "minLength": 1, "maxLength": limit, "pattern": r"\S"})


class DeviceCodeBody(WireModel):
    """``POST /api/v1/machines/device/code``: ``{machine_id, hostname, platform, arch}``
    (docs/shim-protocol.md#getting-a-token, RFC 8628 §3.1; ``client_id``/``grant_type``
    accepted and ignored). The values are checked by ``machines.services.device`` with
    RFC 6749 §5.2 errors (a missing one too: absent reads as ``null``, refused there)."""

    absent_as_null = ("machine_id", "hostname", "platform", "arch")

    machine_id: Annotated[Any, WithJsonSchema({"type": "string", "pattern": MACHINE_ID_PATTERN})]
    hostname: Annotated[Any, _device_text(255)]
    platform: Annotated[Any, _device_text(32)]
    arch: Annotated[Any, _device_text(32)]


class DeviceTokenBody(WireModel):
    """``POST /api/v1/machines/device/token``: ``{grant_type, device_code}``
    (docs/shim-protocol.md#getting-a-token, RFC 8628 §3.4), checked by
    ``machines.services.device`` (a missing ``grant_type`` is ``invalid_request``, another
    one ``unsupported_grant_type``: absent reads as ``null``)."""

    absent_as_null = ("grant_type", "device_code")

    grant_type: Annotated[Any, WithJsonSchema({"type": "string", "const": DEVICE_GRANT_TYPE})]
    device_code: Annotated[Any, WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 200})]


class DeviceCodeAnswer(BaseModel):
    """The answer to ``POST /api/v1/machines/device/code`` (RFC 8628 §3.2): the codes, shown
    once; ``expires_in`` and ``interval`` in seconds."""

    device_code: str
    user_code: str = Field(description="XXXX-XXXX, typed on the verification page")
    verification_uri: str
    verification_uri_complete: str
    expires_in: int
    interval: int


class DeviceTokenAnswer(BaseModel):
    """The answer to an approved ``POST /api/v1/machines/device/token`` (RFC 8628 §3.5,
    RFC 6749 §5.1): the machine token, once."""

    access_token: str
    token_type: Literal["Bearer"]
    machine_id: str


class DeviceFlowErrorAnswer(BaseModel):
    """An error of the device endpoints in RFC 6749 §5.2's shape (RFC 8628 §3.5 adds
    ``authorization_pending``, ``slow_down``, ``access_denied``, ``expired_token``), not
    the API's ``{error: {code, message, details}}``."""

    error: Literal[
        "invalid_request",
        "unsupported_grant_type",
        "invalid_grant",
        "authorization_pending",
        "slow_down",
        "access_denied",
        "expired_token",
    ]
    error_description: str
