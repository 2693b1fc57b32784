"""Typed wire messages of the remotes app, validated on the way in.

- the ``/ws`` remote actions' bodies (spec/sessions-and-remotes.md §2.1):
  ``remote-connect`` (``RemoteConnectBody``), ``remote-disconnect`` (``RemoteNameBody``),
  ``remote-call`` (``RemoteCallBody``, also the body of ``POST
  /api/v1/remotes/{remotename}/call``), ``remote-call-result`` (``RemoteCallResult``);
- the downstream ``remote-call`` event the server sends (§2.2, ``remote_call_event``);
- the channel-layer messages (``core.protocol.ChannelMessage``) the ``/ws`` consumer
  receives from ``remotes.services`` (``RemoteCallMessage``, ``RemoteProbeMessage``,
  ``RemoteDisconnectedMessage``), and the ``remote.reply`` it answers a call or a probe
  with (``RemoteCallReply``, ``RemoteProbeReply``).

Every parser raises ``InvalidRequest`` whose message names the field that is wrong
(``core.validation.describe_validation_error``); the consumer turns it into
``{"error": "<message>", "nonce"}``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from core.errors import InvalidRequest
from core.protocol import ChannelMessage, ChannelRequest
from core.validation import parse_body
from core.wire import encode
from remotes.schemas import non_local_refs

__all__ = [
    "FunctionSpec",
    "RemoteCallAnswer",
    "RemoteCallBody",
    "RemoteCallMessage",
    "RemoteCallReply",
    "RemoteCallResult",
    "RemoteConnectBody",
    "RemoteDisconnectedMessage",
    "RemoteNameBody",
    "RemoteProbeMessage",
    "RemoteProbeReply",
    "check_remotename",
    "encode",
    "parse_body",
    "remote_call_event",
]

REMOTENAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,63}$"
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_FUNCTIONS = 128
MAX_CALL_TIMEOUT = 300.0  # seconds (§2.3)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

REMOTENAME_RULE = "1-64 characters from letters, digits and '._/-', starting with a letter or digit"
FUNCTION_NAME_RULE = "1-64 characters from letters, digits, '_' and '-'"


def check_remotename(value: str) -> str:
    """Return ``value`` when it is a valid remote name (§2.1), else raise ``ValueError``."""
    if not re.fullmatch(REMOTENAME_PATTERN, value):
        raise ValueError(f"must be {REMOTENAME_RULE}")
    return value


class FunctionSpec(BaseModel):
    """One function of a remote: ``{name, description, parameters}`` (§2.1)."""

    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    description: StrictStr = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(FUNCTION_NAME_PATTERN, value):
            raise ValueError(f"must be {FUNCTION_NAME_RULE}")
        return value

    @field_validator("description", mode="before")
    @classmethod
    def _description(cls, value: Any) -> Any:
        return "" if value is None else value

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters(cls, value: Any) -> Any:
        if value is None:
            return dict(EMPTY_PARAMETERS)
        if not isinstance(value, dict):
            raise ValueError("must be a JSON Schema object")
        try:
            validator_for(value, default=Draft202012Validator).check_schema(value)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        if value.get("type") != "object":
            raise ValueError('the schema\'s "type" must be "object"')
        remote_refs = non_local_refs(value)
        if remote_refs:
            raise ValueError(f"only local $ref ('#/...') are allowed, got {remote_refs[0][:100]!r}")
        return value


class RemoteConnectBody(BaseModel):
    """``remote-connect`` body: ``{remotename, tools}`` (``functions`` is an alias of ``tools``)."""

    model_config = ConfigDict(extra="ignore")

    remotename: StrictStr
    tools: list[FunctionSpec]

    @field_validator("remotename")
    @classmethod
    def _remotename(cls, value: str) -> str:
        return check_remotename(value)

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[FunctionSpec]) -> list[FunctionSpec]:
        if len(value) > MAX_FUNCTIONS:
            raise ValueError(f"a remote has 0 to {MAX_FUNCTIONS} functions, got {len(value)}")
        seen: set[str] = set()
        for spec in value:
            if spec.name in seen:
                raise ValueError(f"duplicate function name '{spec.name}'")
            seen.add(spec.name)
        return value

    @classmethod
    def parse(cls, body: Any) -> RemoteConnectBody:
        """Validate a ``remote-connect`` body, accepting ``functions`` for ``tools``."""
        alias = isinstance(body, dict) and "tools" not in body and "functions" in body
        if alias:
            body = {**body, "tools": body["functions"]}
        try:
            parsed: RemoteConnectBody = parse_body(cls, body)
        except InvalidRequest as exc:
            if alias:  # name the field the client actually sent
                exc.message = exc.message.replace("tools", "functions", 1)
                exc.args = (exc.message,)
            raise
        return parsed


class RemoteNameBody(BaseModel):
    """``remote-disconnect`` body: ``{remotename}``."""

    model_config = ConfigDict(extra="ignore")

    remotename: StrictStr


class RemoteCallBody(BaseModel):
    """``remote-call`` body: ``{remotename, function, args, timeout?}`` (timeout in seconds, ≤ 300)."""

    model_config = ConfigDict(extra="ignore")

    remotename: StrictStr
    function: StrictStr
    args: dict[str, Any] = Field(default_factory=dict, description="the function's arguments, per its parameters")
    timeout: float | None = Field(
        default=None,
        description=f"seconds to wait, above 0 and at most {MAX_CALL_TIMEOUT:g} (default: the server's)",
        json_schema_extra={"exclusiveMinimum": 0, "maximum": MAX_CALL_TIMEOUT},
    )

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError("must be an object")
        return value

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout_type(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError("must be a number of seconds")
        return value

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= MAX_CALL_TIMEOUT:
            raise ValueError(f"must be a number of seconds above 0 and at most {MAX_CALL_TIMEOUT:g}")
        return value


def remote_call_event(*, request_id: str, remotename: str, function: str, args: dict[str, Any]) -> str:
    """The downstream ``remote-call`` event (§2.2) as a frame; it never carries a nonce."""
    return encode(
        {"action": "remote-call", "requestId": request_id, "remotename": remotename, "function": function, "args": args}
    )


class RemoteCallAnswer(BaseModel):
    """The answer of ``POST /api/v1/remotes/{remotename}/call``: ``{"result": <any JSON value>}``."""

    result: Any = None


class RemoteCallResult(BaseModel):
    """``remote-call-result`` (§2.1, §2.2): ``{requestId, result}`` or ``{requestId, error}``,
    at the top level of the frame or under ``body``.

    No reply is ever sent, so nothing here is refused: a ``requestId`` that is not a
    string matches no call (``request_id`` ``None``), an absent ``result`` means ``null``,
    and an ``error`` that is not a string is relayed as its JSON text.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    request_id: str | None = Field(default=None, alias="requestId")
    result: Any = None
    error: Any = None

    @field_validator("request_id", mode="before")
    @classmethod
    def _request_id(cls, value: Any) -> Any:
        return value if isinstance(value, str) else None

    @classmethod
    def from_frame(cls, message: dict[str, Any], body: Any) -> RemoteCallResult:
        """The result fields of a frame: its top level when it has a ``requestId``, else
        its ``body`` (an object), else none."""
        fields = message if "requestId" in message else (body if isinstance(body, dict) else {})
        return cls.model_validate(fields)

    def reply(self) -> RemoteCallReply:
        """What the waiting caller gets: ``{"error": text}`` or ``{"result": value}``."""
        if self.error is not None:
            return RemoteCallReply(error=self.error if isinstance(self.error, str) else json.dumps(self.error))
        return RemoteCallReply(result=self.result)


# --- channel-layer messages: the /ws consumer receives them from remotes.services, and replies --


class RemoteCallMessage(ChannelRequest):
    """``remote.call``: run ``function`` of the remote ``remote_id`` this session serves and
    answer on ``reply_channel`` (``RemoteCallReply``); ``timeout`` is the caller's wait in
    seconds (the pending call is kept that long plus a grace), ``None`` for the default."""

    type: Literal["remote.call"] = "remote.call"
    remote_id: int
    remotename: str
    function: str
    args: dict[str, Any]
    timeout: float | None = None


class RemoteProbeMessage(ChannelRequest):
    """``remote.probe``: does this session still serve ``remote_id``? Answered at once on
    ``reply_channel`` with a ``RemoteProbeReply`` (§2, a takeover of a stale name)."""

    type: Literal["remote.probe"] = "remote.probe"
    remote_id: int


class RemoteDisconnectedMessage(ChannelMessage):
    """``remote.disconnected``: the remote ``remote_id`` was disconnected (maybe by another
    session); ``reason`` is shown to the client, a default when absent."""

    type: Literal["remote.disconnected"] = "remote.disconnected"
    remote_id: int
    reason: str | None = None


class RemoteCallReply(ChannelMessage):
    """``remote.reply`` to a ``remote.call``: ``{"result": <any JSON value>}``, or ``{"error":
    <text>}`` with, for a platform error, its ``code`` (``REMOTE_DISCONNECTED``, …) and
    ``delivered: false`` when the call never reached the client (the caller may re-route
    it, §2.4)."""

    type: Literal["remote.reply"] = "remote.reply"
    result: Any = None
    error: str | None = None
    code: str | None = None
    delivered: bool | None = None


class RemoteProbeReply(ChannelMessage):
    """``remote.reply`` to a ``remote.probe``: ``{"serving": bool}``."""

    type: Literal["remote.reply"] = "remote.reply"
    serving: bool
