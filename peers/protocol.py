"""Typed bodies of the peer API (docs/peers.md#the-peer-api), its approvals and the peers app's channel messages.

One model per route body, used to validate the body and, named in its view's
``core.openapi.documented`` operation, to produce the route's OpenAPI entry
(``model_json_schema(mode="validation")``); one model per answer, for the schema.
Fields are typed and checked in the order the route checks them; a wrong type or
length is answered with ``core.validation.PLAIN_SENTENCES``'s sentence (``name must be
a string``), a validator of a rule of its own raises its own sentence
(``core.validation.parse_plain``):

| route | body | validated by the model at |
|---|---|---|
| ``POST /api/v1/peers/launch`` | ``LaunchBody`` | ``peer_api.launch``, after the receipt |
| ``POST /api/v1/peers/messages`` | ``MessageBody`` | ``services.incoming.peer_message_deliver``, after the receipt |
| ``POST /api/v1/peers/messages/batch`` | ``MessageBatchBody`` | ``peer_api.messages_batch``; each message as above |
| ``POST /api/v1/peers/agents/{id}/stop``, ``archive``, ``POST /api/v1/peers/unlink`` | ``EmptyBody`` | the edge |

Each body is judged where the route's documented order puts its check: a launch's and a message's after the
Idempotency-Key receipt (a reused key answers 422 whatever the body; the message's
receipt is opened in the message's transaction, so that service validates it), a claim's
after the claim rate limit (429 first) and before its code (401); the services then take
the validated model. The bodies of ``POST /api/v1/peers/claim``, ``offers``, ``link`` and
``PATCH /api/v1/peers/{id}``, and the claim's answer, are ``peers.pairing_protocol``'s.
Fields whose rules need this instance's state (a launch's ``cwd``
against ``DISPATCH_REPO_ROOTS``, the capability flags' defaults) are typed for the schema
and checked by the service.

The peers app's channel-layer messages (``core.protocol.ChannelMessage``) are at the end:
the outbox doorbell (``OutboxDoorbellMessage``) and the mirroring loop's
(``MirrorRescanMessage``, ``MirrorResnapshotMessage``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from agents.messages import MAX_MESSAGE_LENGTH, message_content
from core.errors import InvalidRequest
from core.protocol import ChannelMessage
from core.validation import NonBlank, WireModel, rule

NAME_MAX = 100  # characters of an agent name and of a sender's name
AGENT_ID_MAX = 64
CAPABILITY_FIELDS = ("allow_launch", "allow_message", "allow_full_access", "allow_events")
PEER_INSTANCE_ID = "peer_instance_id"  # the validation context key: the calling peer's instance id


class SenderAddress(BaseModel):
    """Who acts on the peer: ``{instance_id, agent_id | null, name}`` (``agent_id``
    null for a person there). Validate with the context ``{"peer_instance_id": …}``: the
    address must be the calling peer's own (never another's: permissions are never passed
    on); a refusal names the field it sits in (``launched_by.instance_id must be …``)."""

    model_config = ConfigDict(extra="ignore")

    instance_id: StrictStr = Field(description="the calling peer's own instance id")
    agent_id: StrictStr | None = Field(
        default=None,  # absent: null, as the address check before this model took it
        json_schema_extra={"maxLength": AGENT_ID_MAX},
        description="an agent id there (no colon), or null",
    )
    name: NonBlank = Field(max_length=NAME_MAX)

    @field_validator("instance_id")
    @classmethod
    def _the_callers(cls, value: str, info: ValidationInfo) -> str:
        peer_instance_id = _peer_instance_id(info)
        if value != peer_instance_id:
            raise rule(f"must be the calling peer's instance id ({peer_instance_id})")
        return value

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, value: str | None) -> str | None:
        if value is not None and (not 0 < len(value) <= AGENT_ID_MAX or ":" in value):
            raise rule(f"must be an agent id (at most {AGENT_ID_MAX} characters, no colon) or null")
        return value

    def wire(self) -> dict[str, Any]:
        """``{instance_id, agent_id, name}`` as stored and sent."""
        return {"instance_id": self.instance_id, "agent_id": self.agent_id, "name": self.name}


def _peer_instance_id(info: ValidationInfo) -> str | None:
    context = info.context or {}
    return context.get(PEER_INSTANCE_ID)


# --- the peer API (docs/peers.md#the-peer-api) ----------------------------------------------


class LaunchBody(WireModel):
    """``POST /api/v1/peers/launch``: ``{name, prompt, type?, cwd, full_access?, child?,
    launched_by}`` (docs/peers.md#launch). Validate with the context ``{"peer_instance_id": …}``.

    Checked in this order, as the route answers (``core.validation.PLAIN_SENTENCES``):
    ``name`` (1–100 characters, not blank), ``prompt`` (text, at most 200,000 characters;
    null means none), ``type`` (a string; empty, null or absent: the default launch type),
    ``full_access`` / ``child`` (booleans; null: false), ``launched_by``
    (``SenderAddress``). ``cwd`` is typed for the schema only: the service resolves
    it against ``DISPATCH_REPO_ROOTS`` after the ``allow_full_access`` check, and answers
    a malformed one with the roots in ``details``.
    """

    absent_as_null = ("cwd",)
    null_as_absent = ("prompt", "full_access", "child")

    name: NonBlank = Field(max_length=NAME_MAX)
    prompt: StrictStr = Field(default="", max_length=MAX_MESSAGE_LENGTH)
    type: StrictStr | None = Field(default=None, description="an agent type; absent: what a local launch would pick")
    full_access: StrictBool = False
    child: StrictBool = Field(default=False, description="accepted; the parent is the launcher, on the peer")
    launched_by: SenderAddress
    cwd: Annotated[
        Any,
        WithJsonSchema(
            {
                "type": "string",
                "description": "a directory inside one of GET /api/v1/peers/repos (a leading ~ is the home here)",
            }
        ),
    ]

    @field_validator("type")
    @classmethod
    def _type(cls, value: str | None) -> str | None:
        return value or None  # "": the default type, as absent


class MessageBody(WireModel):
    """``POST /api/v1/peers/messages``: ``{to_agent_id, content, from}`` (docs/peers.md#messages),
    checked in the order ``to_agent_id`` (an agent id, 1–64 characters), ``from``
    (``SenderAddress``), ``content`` (1–200,000 characters, not blank, made storable
    by ``agents.messages.message_content``), each refused with
    ``core.validation.PLAIN_SENTENCES``'s sentence or its check's own. Validate with the
    context ``{"peer_instance_id": …}``."""

    # The wire names it ``from`` only: the Python name (``sender``) is not another spelling.
    model_config = ConfigDict(populate_by_name=False)

    to_agent_id: StrictStr = Field(min_length=1, max_length=AGENT_ID_MAX)
    sender: SenderAddress = Field(alias="from")
    content: NonBlank = Field(max_length=MAX_MESSAGE_LENGTH)

    @field_validator("content")
    @classmethod
    def _content(cls, value: str) -> str:
        # storable: no NUL, no lone surrogate (its own sentence)
        try:
            return message_content(value)
        except InvalidRequest as exc:
            raise ValueError(exc.message) from None


BATCH_MAX_MESSAGES = 500  # messages one POST /api/v1/peers/messages/batch may carry (a receiver's bound)
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,100}")  # as the Idempotency-Key header (peers.services.receipts)


def _batch_keys(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for index, entry in enumerate(value):
        key = entry.get("idempotency_key")
        if not isinstance(key, str) or not _IDEMPOTENCY_KEY.fullmatch(key):
            raise ValueError(
                f"messages[{index}].idempotency_key must be 1 to 100 printable ASCII characters without spaces"
            )
    return value


# One message of a batch: a ``MessageBody`` plus the ``idempotency_key`` it would carry as
# its own ``POST /api/v1/peers/messages`` (its receipt's key, docs/peers.md#message-batches).
_BATCH_MESSAGES_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "maxItems": BATCH_MAX_MESSAGES,
    "items": {
        "type": "object",
        "required": ["idempotency_key", "to_agent_id", "content", "from"],
        "properties": {
            "idempotency_key": {"type": "string", "minLength": 1, "maxLength": 100},
            "to_agent_id": {"type": "string", "minLength": 1, "maxLength": AGENT_ID_MAX},
            "content": {"type": "string", "minLength": 1, "maxLength": MAX_MESSAGE_LENGTH},
            "from": {
                "type": "object",
                "required": ["instance_id", "agent_id", "name"],
                "properties": {
                    "instance_id": {"type": "string"},
                    "agent_id": {"type": ["string", "null"], "maxLength": AGENT_ID_MAX},
                    "name": {"type": "string", "minLength": 1, "maxLength": NAME_MAX},
                },
            },
        },
    },
}


class MessageBatchBody(WireModel):
    """``POST /api/v1/peers/messages/batch`` (feature ``messages.batch``): ``{"messages":
    [{idempotency_key, to_agent_id, content, from}, …]}``, 1 to ``BATCH_MAX_MESSAGES``, in
    the sender's outbox order. Only the envelope is judged here (a list of objects, each
    with a well-formed key): each message's own body is judged after its receipt, as the
    single route does, so a bad one is refused alone (400 in its receipt)."""

    messages: Annotated[
        list[dict[str, Any]],
        Field(min_length=1, max_length=BATCH_MAX_MESSAGES),
        AfterValidator(_batch_keys),
        WithJsonSchema(_BATCH_MESSAGES_SCHEMA),
    ]


class BatchReceipt(BaseModel):
    """The answer to one message of a batch: its ``idempotency_key``, the HTTP ``status`` and
    ``body`` its own ``POST /api/v1/peers/messages`` would have had (200 ``{"delivered":
    true, "message_id"}`` or ``{"delivered": true, "duplicate": true}``; 409, 400, 422
    ``{"error": …}``: refused for good; 503: not now)."""

    idempotency_key: str
    status: int
    body: dict[str, Any]


class MessageBatchAnswer(BaseModel):
    """``{"receipts": [...]}``: one ``BatchReceipt`` per message, in the batch's order, up to
    and including the first transient failure (503); messages after it have none (not
    attempted: the sender sends them again later, after that one)."""

    receipts: list[BatchReceipt]


class EmptyBody(BaseModel):
    """The body of a peer POST that takes none (stop, archive, unlink): any JSON object,
    ignored (the ``Idempotency-Key`` is what matters)."""

    model_config = ConfigDict(extra="allow")


class PeerAgentAnswer(BaseModel):
    """A launched, stopped or archived agent: ``{agent_id, name, status}``."""

    agent_id: str
    name: str
    status: str


class MessageAnswer(BaseModel):
    """``{"delivered": true, "message_id"}``, or ``{"delivered": true, "duplicate": true}``
    for a repeated Idempotency-Key."""

    delivered: bool
    message_id: int | None = None
    duplicate: bool | None = None


class ReposAnswer(BaseModel):
    """``{"roots": [absolute paths]}``: the ``DISPATCH_REPO_ROOTS`` a launch's ``cwd`` must be in."""

    roots: list[str]


class UnlinkAnswer(BaseModel):
    """``{"unlinked": true}``."""

    unlinked: bool


# --- channel-layer messages (doorbells of the peers app's background loops) ---------------------


class OutboxDoorbellMessage(ChannelMessage):
    """``outbox.doorbell``: outbox rows are due; every process's drain loop passes now
    (``peers.services.outbox.DOORBELL_GROUP``)."""

    type: Literal["outbox.doorbell"] = "outbox.doorbell"


class MirrorRescanMessage(ChannelMessage):
    """``mirror.rescan``: a link was made, changed or revoked; every process's mirroring loop
    rescans the links now (``core.realtime.PEERS_MIRROR_GROUP``)."""

    type: Literal["mirror.rescan"] = "mirror.rescan"


class MirrorResnapshotMessage(ChannelMessage):
    """``mirror.resnapshot``: the process subscribed to peer ``peer_id`` reconnects its stream
    now, which brings a fresh snapshot (after a launch on that peer)."""

    type: Literal["mirror.resnapshot"] = "mirror.resnapshot"
    peer_id: int


# --- approvals over the link (docs/peers.md#approvals) --------------------------------------

APPROVAL_DECISIONS = ("allow_once", "allow_always", "deny")
APPROVAL_MESSAGE_MAX = 2000  # characters of a deny message the CLI shows the model (agents.approvals.MAX_MESSAGE)


class PeerApproval(BaseModel):
    """One pending approval of an agent here, as a linked peer sees it
    (``GET /api/v1/peers/approvals``): ids are ours, times ISO 8601 UTC."""

    id: str
    agent_id: str
    agent_name: str
    tool_name: str
    tool_summary: str = Field(description="the exact command, file or URL the tool would act on")
    tool_input: dict[str, Any]
    suggestions: list[Any] = Field(description="the CLI's own suggested permission rules")
    status: str
    asked_at: str
    expires_at: str | None


class PeerApprovalList(BaseModel):
    """``{"approvals": [PeerApproval, …]}``: oldest first."""

    approvals: list[PeerApproval]


class ApprovalAnswerBody(WireModel):
    """``POST /api/v1/peers/approvals/{id}/answer``: ``{decision, message?, answered_by}``.

    ``decision``: ``allow_once``, ``allow_always`` or ``deny``; ``message``: the text the
    CLI shows the model with a deny (at most 2000 characters); ``answered_by``: the
    person on the peer who answered, ``{instance_id, agent_id: null, name}`` (as a
    launch's ``launched_by``). Validate with the context ``{"peer_instance_id": …}``."""

    null_as_absent = ("message",)

    decision: Literal["allow_once", "allow_always", "deny"]
    message: StrictStr = Field(default="", max_length=APPROVAL_MESSAGE_MAX)
    answered_by: SenderAddress


class PeerApprovalAnswer(BaseModel):
    """The answered approval: ``{id, agent_id, status, decision, answered_by, answered_at}``."""

    id: str
    agent_id: str
    status: str
    decision: str
    answered_by: str
    answered_at: str | None
