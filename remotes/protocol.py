"""Typed wire messages of the remotes app, validated on the way in.

- the ``/ws`` remote actions' bodies (docs/ws-protocol.md#actions):
  ``remote-connect`` (``RemoteConnectBody``), ``remote-disconnect`` (``RemoteNameBody``),
  ``remote-call`` (``RemoteCallBody``, also the body of ``POST
  /api/v1/remotes/{remotename}/call``), ``remote-call-result`` (``RemoteCallResult``);
- the downstream ``remote-call`` event the server sends (docs/ws-protocol.md#remote-call-event,
  ``remote_call_event``) and
  the ``requestId`` it carries (``new_request_id``);
- the channel-layer messages (``core.protocol.ChannelMessage``) the ``/ws`` consumer
  receives from ``remotes.services`` (``RemoteCallMessage``, ``RemoteProbeMessage``,
  ``RemoteDisconnectedMessage``), and the ``remote.reply`` it answers a call or a probe
  with (``RemoteCallReply``, ``RemoteProbeReply``).

Every parser raises ``InvalidRequest`` whose message names the field that is wrong
(``core.validation.describe_validation_error``); the consumer turns it into
``{"error": "<message>", "nonce"}``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
from typing import Any, Literal

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictStr, field_validator

from core.errors import InvalidRequest
from core.protocol import ChannelMessage, ChannelRequest
from core.validation import WireModel, parse_body
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
    "new_request_id",
    "parse_body",
    "remote_call_event",
]

REMOTENAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,63}$"
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_FUNCTIONS = 128
MAX_CALL_TIMEOUT = 300.0  # seconds (docs/ws-protocol.md#remote-call)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

REMOTENAME_RULE = "1-64 characters from letters, digits and '._/-', starting with a letter or digit"
FUNCTION_NAME_RULE = "1-64 characters from letters, digits, '_' and '-'"


def check_remotename(value: str) -> str:
    """Return ``value`` when it is a valid remote name, else raise ``ValueError``
    (docs/ws-protocol.md#remote-connect)."""
    if not re.fullmatch(REMOTENAME_PATTERN, value):
        raise ValueError(f"must be {REMOTENAME_RULE}")
    return value


class FunctionSpec(WireModel):
    """One function of a remote: ``{name, description, parameters}``; a null ``description``
    or ``parameters`` is absent (``""``, an object schema without properties)."""

    null_as_absent = ("description", "parameters")

    name: StrictStr
    description: StrictStr = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(FUNCTION_NAME_PATTERN, value):
            raise ValueError(f"must be {FUNCTION_NAME_RULE}")
        return value

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "$schema" in value and not isinstance(value["$schema"], str):
            raise ValueError('"$schema" must be a string')  # validator_for raises TypeError
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


class RemoteCallBody(WireModel):
    """``remote-call`` body: ``{remotename, function, args, timeout?}`` (timeout in seconds, ≤ 300;
    a null ``args`` is none, ``{}``)."""

    null_as_absent = ("args",)

    remotename: StrictStr
    function: StrictStr
    # dict[str, Any], not JsonValue: a body decoded from JSON holds JSON values only, and
    # walking them again would cost each call its size.
    args: dict[str, Any] = Field(default_factory=dict, description="the function's arguments, per its parameters")
    timeout: StrictFloat | None = Field(
        default=None,
        description=f"seconds to wait, above 0 and at most {MAX_CALL_TIMEOUT:g} (default: the server's)",
        json_schema_extra={"exclusiveMinimum": 0, "maximum": MAX_CALL_TIMEOUT},
    )

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= MAX_CALL_TIMEOUT:
            raise ValueError(f"must be a number of seconds above 0 and at most {MAX_CALL_TIMEOUT:g}")
        return value


REQUEST_BASE_BITS = 52


def _request_numbers() -> itertools.count[int]:
    return itertools.count(secrets.randbits(REQUEST_BASE_BITS))


_numbers = _request_numbers()


def _renumber_after_fork() -> None:
    # A forked child would otherwise hand out the very numbers its parent goes on issuing.
    global _numbers
    _numbers = _request_numbers()


os.register_at_fork(after_in_child=_renumber_after_fork)


def new_request_id(remotename: str) -> str:
    """A ``requestId`` for one downstream call of ``remotename``: ``'<remotename>#<n>'``,
    ``n`` a decimal integer below 2**53 (exact as a JSON/JavaScript number, should a client
    parse it); clients treat the whole id as opaque (docs/ws-protocol.md#request-ids).

    An id is never issued twice for a user — not across ws sessions, serving processes or
    restarts — because a public client that reconnects sends the late
    ``remote-call-result`` of a failed call on its new socket, where it must not match a
    newer call. ``n`` is a process-wide counter (never reused within the process, whatever
    the session or name) that starts at a random base of ``REQUEST_BASE_BITS`` (52) bits
    drawn from ``secrets`` when the process starts (or forks). Two processes — two
    servers, or one server before and after a restart — can only issue the same ``n`` if
    their bases lie closer than the number of calls one of them sends: with a billion
    calls per process that is a chance of about 2 * 10**9 / 2**52 ≈ 4 * 10**-7 per pair of
    processes, and even then only an answer that arrives late, for the same name, within
    the caller's wait could be misrouted. Starting below 2**52 keeps ``n`` below 2**53 for
    at least 2**52 calls.
    """
    return f"{remotename}#{next(_numbers)}"


def remote_call_event(*, request_id: str, remotename: str, function: str, args: dict[str, Any]) -> str:
    """The downstream ``remote-call`` event as a frame; it never carries a nonce."""
    return encode(
        {"action": "remote-call", "requestId": request_id, "remotename": remotename, "function": function, "args": args}
    )


class RemoteCallAnswer(BaseModel):
    """The answer of ``POST /api/v1/remotes/{remotename}/call``: ``{"result": <any JSON value>}``."""

    result: Any = None


class RemoteCallResult(BaseModel):
    """``remote-call-result``: ``{requestId, result}`` or ``{requestId, error}``,
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
    ``reply_channel`` with a ``RemoteProbeReply`` (a takeover of a stale name)."""

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
    it)."""

    type: Literal["remote.reply"] = "remote.reply"
    result: Any = None
    error: str | None = None
    code: str | None = None
    delivered: bool | None = None


class RemoteProbeReply(ChannelMessage):
    """``remote.reply`` to a ``remote.probe``: ``{"serving": bool}``."""

    type: Literal["remote.reply"] = "remote.reply"
    serving: bool
