"""Channel-layer messages: the typed base every one of them is built on, and the kernel's own.

Every message that crosses the channel layer is a ``ChannelMessage`` (every wire message has
a model, docs/architecture.md#how-the-code-is-written): a frozen pydantic model whose
``type`` field is a ``Literal`` (the Channels handler it reaches: ``"remote.call"`` →
``remote_call``) with that one value as its default, and no field beyond the ones it
declares. Each app keeps its own in its ``protocol.py``; the senders build the model and
hand it to ``core.realtime`` (``ring``, ``ring_on_commit``, ``send_on_commit``,
``layer_send``, ``request_reply``, ``layer_request``), which turns it into the plain dict
the layer carries (``ChannelMessage.for_layer``) right before sending; the receivers
(``core.consumers.receives``, ``core.realtime.Subscription``, ``request_reply``'s ``reply``)
validate what arrives with ``ChannelMessage.received`` — a message that does not fit is
logged and dropped, never raised into a consumer.

A request answered over a fresh reply channel is a ``ChannelRequest``: its sender leaves
``reply_channel`` out, ``core.realtime.request_reply`` fills it in, and a request received
without one does not validate.

The kernel's own messages (``core`` imports no app):

| type | model | sent by (``core.``…) | received by |
|---|---|---|---|
| ``health.probe`` | ``HealthProbeMessage`` | ``realtime.layer_round_trip`` | the same (``/healthz``) |
| ``server.shutdown`` | ``ServerShutdownMessage`` | ``consumers.shutdown_local_connections`` | every consumer |
| ``credential.ended`` | ``CredentialEndedMessage`` | ``revocation.revocation_sweep_once`` | consumers, event streams |
| ``credentials.ring`` | ``CredentialsRingMessage`` | ``revocation.credentials_ended_on_commit`` | the revocation loop |
| ``tools.changed`` | ``ToolsChangedMessage`` | ``tool_changes`` | the MCP relay (``dispatch.mcp.relay``) |
| ``presence.ping`` | ``PresencePingMessage`` | ``services.server_process_liveness`` | a process's presence loop |
| ``presence.pong`` | ``PresencePingReply`` | the presence loop (``dispatch.background``) | the same |
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

RECEIVED = "received"
"""The validation-context key ``ChannelMessage.received`` sets: the message came off the layer."""


class ChannelMessage(BaseModel):
    """One channel-layer message: ``{"type": <its Literal>, <its fields>}``.

    Frozen, and strict about its shape (``extra="forbid"``: a field it does not declare
    makes it malformed). Subclasses declare ``type: Literal["<app>.<name>"] = "<app>.<name>"``
    and their fields with JSON-plain types (the Redis layer is msgpack).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")

    type: str

    @classmethod
    def message_type(cls) -> str:
        """The ``type`` this model carries (its ``Literal``'s one value)."""
        default = cls.model_fields["type"].default
        if not isinstance(default, str):
            raise TypeError(f"{cls.__name__} is not a concrete channel message (no default type)")
        return default

    def for_layer(self) -> dict[str, Any]:
        """The dict the layer carries: ``type`` first, then every field that was set (given
        to the constructor, or filled in by ``request_reply``) — a field left at its default
        stays off the wire, as the senders' dicts always had it, and the receiver's model
        puts the default back. JSON-plain (``mode="json"``): a datetime becomes its ISO
        text, a tuple a list; NaN and the infinities stay floats, as msgpack carries them.
        Raises ``ValueError`` (``PydanticSerializationError``) for a value that has no JSON
        form."""
        return {"type": self.type, **self.model_dump(mode="json", exclude_unset=True)}

    @classmethod
    def received(cls, message: Any) -> Self:
        """``message`` as it came off the layer, validated as this model; raises
        ``pydantic.ValidationError`` when it does not fit (``core.realtime.message_received``
        logs and drops it instead)."""
        return cls.model_validate(message, context={RECEIVED: True})


class ChannelRequest(ChannelMessage):
    """A message answered on ``reply_channel`` (``core.realtime.request_reply``).

    The sender builds it without ``reply_channel``; ``request_reply`` adds a fresh one just
    before sending. Received without one (``received``), it is malformed: nobody could
    answer it.
    """

    reply_channel: str = ""

    @model_validator(mode="after")
    def _answerable(self, info: ValidationInfo) -> Self:
        if info.context and info.context.get(RECEIVED) and not self.reply_channel:
            raise ValueError("a request needs its reply_channel")
        return self


# --- the kernel's own messages -----------------------------------------------------------------


class HealthProbeMessage(ChannelMessage):
    """``health.probe``: ``/healthz``'s round trip through the layer; ``probe`` is a fresh
    random token the receiver compares (``core.realtime.layer_round_trip``)."""

    type: Literal["health.probe"] = "health.probe"
    probe: str


class ServerShutdownMessage(ChannelMessage):
    """``server.shutdown``: this process stops (or found itself reaped); every consumer fails
    its pending work and closes 1012 (``core.consumers.DispatchConsumer.server_shutdown``)."""

    type: Literal["server.shutdown"] = "server.shutdown"


class CredentialEndedMessage(ChannelMessage):
    """``credential.ended``: the token, user, session or link the receiving connection or
    event stream stands on ended; a socket closes 4401, a stream ends (``core.revocation``)."""

    type: Literal["credential.ended"] = "credential.ended"


class CredentialsRingMessage(ChannelMessage):
    """``credentials.ring``: a credential ended; every process's revocation sweep runs now
    (``core.revocation.DOORBELL_GROUP``)."""

    type: Literal["credentials.ring"] = "credentials.ring"


class ToolsChangedMessage(ChannelMessage):
    """``tools.changed``: the user's tool list changed (``core.tool_changes.tools_group``);
    the MCP relay sends ``notifications/tools/list_changed`` (docs/mcp.md#tool-list-changes)."""

    type: Literal["tools.changed"] = "tools.changed"


class PresencePingMessage(ChannelRequest):
    """``presence.ping``: "are you alive, and which of these channels are your open
    connections?", sent to a process's presence group (``core.presence.presence_group``) by
    ``core.services.server_process_liveness`` before a name held by that process is taken
    over (docs/operating.md#a-client-of-a-dead-process-registering-again). ``channel_names``:
    at most a few channel names (a takeover asks about one)."""

    type: Literal["presence.ping"] = "presence.ping"
    channel_names: list[str] = []


class PresencePingReply(ChannelMessage):
    """``presence.pong``: the answer of a live process (``dispatch.background.presence_loop``):
    its ``process_id`` and ``holding``, the asked channel names that are open connections of
    it (``core.presence.local_channel_names``)."""

    type: Literal["presence.pong"] = "presence.pong"
    process_id: str
    holding: list[str] = []
