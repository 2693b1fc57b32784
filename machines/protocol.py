"""The shim wire protocol, platform side (docs/shim-protocol.md).

The protocol itself — envelope, message types, operations, capabilities, error payload,
close codes, version rule, id patterns, limits, ``encode`` — is defined once, in
``machines.shim.protocol`` (standard library only: the shim installs without the
server), and imported from there. This module adds only what the server needs on top:

- ``Hello``: the model the platform validates a shim's ``HELLO`` payload with (the
  shim builds that payload in ``machines.shim.connection.Shim.hello_frame``, and a test
  holds the two to the same fields);
- ``negotiate``: the platform's choice of version (docs/shim-protocol.md#the-handshake);
- the server's views of the shared tables: ``DEFAULT_LIMITS`` (the ``HELLO_ACK.limits``
  it grants), ``OPERATIONS`` keyed the way the router reads it, ``CALLER_OPERATIONS``,
  ``CAPABILITIES``;
- the channel-layer messages (``core.protocol.ChannelMessage``) the shim consumer
  receives from ``machines.services`` (``MachineOpMessage``, ``MachineRevokedMessage``,
  ``MachineTakeoverMessage``), and the ``MachineReplyMessage`` it answers an operation with.

The operations' payloads are defined beside it, in ``machines.shim.payloads`` (``PAYLOADS``, one
standard-library dataclass per operation); ``machines.schemas`` derives the platform's
pydantic models from them, beside the bodies of the machines app's REST routes.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from core import wire
from core.protocol import ChannelMessage, ChannelRequest
from machines.shim.protocol import (
    MACHINE_ID_PATTERN,
    PROTOCOL_VERSION,
    SESSION_ID_PATTERN,
    Capability,
    Limits,
    MessageType,
    parse_version,
)
from machines.shim.protocol import OPERATIONS as SHIM_OPERATIONS

__all__ = [
    "CALLER_OPERATIONS",
    "CAPABILITIES",
    "DEFAULT_LIMITS",
    "OPERATIONS",
    "SESSION_ID_PATTERN",  # the shim protocol's, for machines.services
    "Hello",
    "MachineCancelMessage",
    "MachineFlowMessage",
    "MachineInputMessage",
    "MachineOpMessage",
    "MachineOutputMessage",
    "MachineReplyMessage",
    "MachineRevokedMessage",
    "MachineTakeoverMessage",
    "OperationCancelMessage",
    "negotiate",
]

# The limits the platform grants in HELLO_ACK (docs/shim-protocol.md#the-handshake; 2.1 adds the
# two stream limits, in bytes).
DEFAULT_LIMITS: dict[str, Any] = Limits().as_payload()

# Operation → (capability it needs, the response type a success carries): the shim
# protocol's table, keyed the way the router and the consumer read it.
OPERATIONS: dict[str, tuple[str | None, str]] = {
    str(op): (None if capability is None else str(capability), str(response))
    for op, (response, capability) in SHIM_OPERATIONS.items()
}
# Operations a caller may request through machine_op (the rest are the platform's own).
CALLER_OPERATIONS = frozenset(op for op in OPERATIONS if op not in (MessageType.MACHINE_LIST_REQUEST, MessageType.PING))
CAPABILITIES = frozenset(str(capability) for capability in Capability)


class Hello(BaseModel):
    """The shim's ``HELLO`` payload, as the platform accepts it."""

    model_config = ConfigDict(extra="ignore")

    shim_version: StrictStr = Field(max_length=64)
    protocol_version: StrictStr = Field(max_length=16)
    machine_id: StrictStr = Field(pattern=MACHINE_ID_PATTERN)
    hostname: StrictStr = Field(min_length=1, max_length=255)
    display_name: StrictStr | None = Field(default=None, max_length=255)
    platform: Literal["linux", "darwin"]
    arch: StrictStr = Field(min_length=1, max_length=32)
    capabilities: list[Literal["shell", "files"]] = Field(max_length=8)
    allowed_roots: list[StrictStr] = Field(max_length=64)
    sessions: list[StrictStr] = Field(min_length=1, max_length=256)
    hardware_devices: list[Any] = Field(default_factory=list, max_length=64)

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, value: Any) -> Any:
        # Everything in a HELLO is stored and shown: text must be writable as UTF-8.
        if not wire.encodable(json.dumps(value, ensure_ascii=False, default=str)):
            raise ValueError("HELLO holds text that is not valid UTF-8 (a lone surrogate)")
        return value

    @field_validator("protocol_version")
    @classmethod
    def _version(cls, value: str) -> str:
        parse_version(value)
        return value

    @field_validator("allowed_roots")
    @classmethod
    def _roots(cls, value: list[str]) -> list[str]:
        for root in value:
            if not root.startswith("/") or "\x00" in root or len(root) > 4096:
                raise ValueError(f"allowed_roots entries must be absolute paths, got {root[:100]!r}")
        return value

    @field_validator("sessions")
    @classmethod
    def _sessions(cls, value: list[str]) -> list[str]:
        for session_id in value:
            if session_id != "*" and not re.fullmatch(SESSION_ID_PATTERN, session_id):
                raise ValueError(f"invalid session id {session_id[:100]!r}")
        return value


def negotiate(shim_version: str) -> str | None:
    """The negotiated version (same major, lower minor), or ``None`` on a major mismatch."""
    shim_major, shim_minor = parse_version(shim_version)
    our_major, our_minor = parse_version(PROTOCOL_VERSION)
    if shim_major != our_major:
        return None
    return f"{our_major}.{min(shim_minor, our_minor)}"


# --- channel-layer messages: the shim consumer receives them from machines.services, and replies


class MachineOpMessage(ChannelRequest):
    """``machine.op``: send operation ``op`` with ``payload`` to this shim as the frame
    ``request_id`` of session ``session_id``, and answer on ``reply_channel``
    (``MachineReplyMessage``); the caller waits ``timeout`` seconds (the pending entry is
    kept 5 s longer)."""

    type: Literal["machine.op"] = "machine.op"
    op: str
    payload: dict[str, Any]
    request_id: str
    session_id: str | None
    timeout: float
    relay: bool = False
    """Protocol 2.1 live operation: besides the final ``MachineReplyMessage``, the consumer
    relays the shim's ``COMMAND_OUTPUT`` frames (``MachineOutputMessage``) and its stdin
    ``FLOW`` grants (``MachineFlowMessage``) to ``reply_channel``, in the order they came."""


class MachineReplyMessage(ChannelMessage):
    """``machine.reply`` to a ``machine.op``: the shim's response frame's ``type``
    (``response_type``: the operation's response, or ``ERROR``) and its ``payload`` (an
    ``ERROR`` payload ``{code, message, details?}``, the platform's own when the machine
    could not be reached)."""

    type: Literal["machine.reply"] = "machine.reply"
    response_type: str
    payload: dict[str, Any]


class MachineOutputMessage(ChannelMessage):
    """``machine.output`` (consumer → the caller's reply channel, 2.1): one ``COMMAND_OUTPUT``
    frame of operation ``request_id``: ``stream`` ``"stdout"|"stderr"``, ``data`` (UTF-8
    text, or base64 when ``encoding`` is ``"base64"``), ``seq`` (from 0 per operation across
    both streams; a gap means a message was lost)."""

    type: Literal["machine.output"] = "machine.output"
    request_id: str
    stream: Literal["stdout", "stderr"]
    data: str
    encoding: Literal["utf-8", "base64"]
    seq: StrictInt = Field(ge=0)


class MachineFlowMessage(ChannelMessage):
    """``machine.flow`` (2.1): a ``FLOW`` credit grant for operation ``request_id``'s
    ``stream``: ``credit_total`` is cumulative (bytes the sender may have sent since the
    start; a lost or repeated grant is harmless). Caller → consumer for ``stdout``/``stderr``
    (forwarded to the shim as ``FLOW``); consumer → caller for ``stdin`` (the shim's grant)."""

    type: Literal["machine.flow"] = "machine.flow"
    request_id: str
    stream: Literal["stdin", "stdout", "stderr"]
    credit_total: int


class MachineInputMessage(ChannelMessage):
    """``machine.input`` (caller → consumer, 2.1): send ``COMMAND_INPUT {request_id, data,
    encoding, eof}`` to the shim (``data`` UTF-8 text or base64; ``eof`` closes the
    command's stdin after it)."""

    type: Literal["machine.input"] = "machine.input"
    request_id: str
    data: str = ""
    encoding: Literal["utf-8", "base64"] = "base64"
    eof: bool = False


class MachineCancelMessage(ChannelMessage):
    """``machine.cancel`` (anyone → consumer, 2.1): send ``CANCEL {request_id}`` to the shim
    (under a fresh envelope id; the consumer swallows the shim's ``ACK``). Harmless for an
    operation that already ended."""

    type: Literal["machine.cancel"] = "machine.cancel"
    request_id: str


class OperationCancelMessage(ChannelMessage):
    """``operation.cancel`` (the cancel route, an MCP ``notifications/cancelled`` → the
    caller's channel of an in-flight operation): stop operation ``request_id`` (a command,
    a copy or a pipe); ``reason`` is for humans."""

    type: Literal["operation.cancel"] = "operation.cancel"
    request_id: str
    reason: str = "cancelled"


class MachineRevokedMessage(ChannelMessage):
    """``machine.revoked``: the machine's token was revoked (close 4401)."""

    type: Literal["machine.revoked"] = "machine.revoked"


class MachineTakeoverMessage(ChannelMessage):
    """``machine.takeover``: the machine reconnected on another socket; the connection
    ``connection_id`` (this one, unless it already changed) gives way (4427)."""

    type: Literal["machine.takeover"] = "machine.takeover"
    connection_id: str
