"""Typed bodies of the peer API and the pairing routes (docs/peers.md#the-peer-api).

One model per route body, used to validate the body and, named in its view's
``core.openapi.documented`` operation, to produce the route's OpenAPI entry
(``model_json_schema(mode="validation")``); one model per answer, for the schema.
A validator raises the very sentence the route answers (``core.validation.parse_plain``),
in the order the route checks the fields, so a model only names the rules the wire
already had:

| route | body | validated by the model at |
|---|---|---|
| ``POST /api/v1/peers/launch`` | ``LaunchBody`` | ``peer_api.launch``, after the receipt |
| ``POST /api/v1/peers/messages`` | ``MessageBody`` | ``services.incoming.peer_message_deliver``, after the receipt |
| ``POST /api/v1/peers/messages/batch`` | ``MessageBatchBody`` | ``peer_api.messages_batch``; each message as above |
| ``POST /api/v1/peers/agents/{id}/stop``, ``archive``, ``POST /api/v1/peers/unlink`` | ``EmptyBody`` | the edge |
| ``POST /api/v1/peers/claim`` | ``ClaimBody`` | ``pairing_api.claim_api``, after the rate limit |
| ``POST /api/v1/peers/offers`` | ``OfferBody`` | ``pairing_api.offers_api`` |
| ``POST /api/v1/peers/link`` | ``LinkBody`` | ``pairing_api.link_api`` |
| ``PATCH /api/v1/peers/{id}`` | ``PeerUpdateBody`` | ``pairing_api.peer_api`` |

Each body is judged where the route's documented order puts its check: a launch's and a message's after the
Idempotency-Key receipt (a reused key answers 422 whatever the body; the message's
receipt is opened in the message's transaction, so that service validates it), a claim's
after the claim rate limit (429 first) and before its code (401); the services then take
the validated model. ``ClaimAnswer`` also validates the claim's answer on the claiming side
(``pairing.peer_link``). Fields whose rules need this instance's state (a launch's ``cwd``
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
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from agents.messages import MAX_MESSAGE_LENGTH, message_content
from core.errors import InvalidRequest
from core.protocol import ChannelMessage
from core.validation import WireModel, refusal
from peers.keys import PEER_PROTOCOL_VERSION, features_parse, public_key_from

NAME_MAX = 100  # characters of an agent name and of a sender's name
AGENT_ID_MAX = 64
CAPABILITY_FIELDS = ("allow_launch", "allow_message", "allow_full_access", "allow_events")
PEER_INSTANCE_ID = "peer_instance_id"  # the validation context key: the calling peer's instance id
OUR_INSTANCE_ID = "our_instance_id"  # the validation context key of a claim or its answer: this instance's id
INSTANCE_ID_PATTERN = re.compile(r"inst_[0-9a-f]{12}")

_FLAG = WithJsonSchema({"type": "boolean"})


def _no_default(schema: dict[str, Any]) -> None:
    """Leave a field's ``default: null`` out of the schema (absent means "unchanged")."""
    schema.pop("default", None)


def _text(value: Any, what: str, *, max_length: int, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise ValueError(f"{what} must be a non-empty string")
    if len(value) > max_length:
        raise ValueError(f"{what} must be at most {max_length} characters")
    return value


def _flag(value: Any, what: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false")
    return value


class SenderAddress(BaseModel):
    """Who acts on the peer: ``{instance_id, agent_id | null, name}`` (``agent_id``
    null for a person there)."""

    model_config = ConfigDict(extra="ignore")

    instance_id: str = Field(description="the calling peer's own instance id")
    agent_id: str | None = Field(max_length=AGENT_ID_MAX, description="an agent id there (no colon), or null")
    name: str = Field(min_length=1, max_length=NAME_MAX)

    @classmethod
    def check(cls, value: Any, *, what: str, peer_instance_id: str | None) -> SenderAddress:
        """``value`` as an address of the peer ``peer_instance_id``; ``ValueError`` naming
        ``what`` (``launched_by`` / ``from``) and the first wrong part: an object, the
        peer's own instance id (never another's: permissions are never passed on), an
        agent id of at most 64 characters without a colon or null, a name of 1–100."""
        if not isinstance(value, dict):
            raise ValueError(f"{what} must be an object {{instance_id, agent_id, name}}")
        if value.get("instance_id") != peer_instance_id:
            raise ValueError(f"{what}.instance_id must be the calling peer's instance id ({peer_instance_id})")
        agent_id = value.get("agent_id")
        if agent_id is not None and (
            not isinstance(agent_id, str) or not 0 < len(agent_id) <= AGENT_ID_MAX or ":" in agent_id
        ):
            raise ValueError(f"{what}.agent_id must be an agent id (at most 64 characters, no colon) or null")
        name = _text(value.get("name"), f"{what}.name", max_length=NAME_MAX)
        return cls.model_construct(instance_id=peer_instance_id, agent_id=agent_id, name=name)

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

    Checked in this order, as the route answers: ``name`` (1–100 characters), ``prompt``
    (text, at most 200,000 characters; null means none), ``type`` (a string; empty or
    absent: the default launch type), ``full_access`` / ``child`` (booleans),
    ``launched_by`` (``SenderAddress.check``). ``cwd`` is typed only: the service resolves
    it against ``DISPATCH_REPO_ROOTS`` after the ``allow_full_access`` check.
    """

    absent_as_null = ("name", "launched_by", "cwd")

    name: str = Field(min_length=1, max_length=NAME_MAX)
    prompt: str = Field(default="", max_length=MAX_MESSAGE_LENGTH)
    type: str | None = Field(default=None, description="an agent type; absent: what a local launch would pick")
    full_access: bool = False
    child: bool = Field(default=False, description="accepted; the parent is the launcher, on the peer")
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

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: Any) -> str:
        return _text(value, "name", max_length=NAME_MAX)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> str:
        return _text(value, "prompt", max_length=MAX_MESSAGE_LENGTH, required=False)

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, value: Any) -> str | None:
        if not value:
            return None
        if not isinstance(value, str):
            raise ValueError("type must be a string")
        return value

    @field_validator("full_access", "child", mode="before")
    @classmethod
    def _flags(cls, value: Any, info: ValidationInfo) -> bool:
        return _flag(value, str(info.field_name))

    @field_validator("launched_by", mode="before")
    @classmethod
    def _launched_by(cls, value: Any, info: ValidationInfo) -> SenderAddress:
        return SenderAddress.check(value, what="launched_by", peer_instance_id=_peer_instance_id(info))


class MessageBody(WireModel):
    """``POST /api/v1/peers/messages``: ``{to_agent_id, content, from}`` (docs/peers.md#messages),
    checked in the order ``to_agent_id`` (an agent id, 1–64 characters), ``from``
    (``SenderAddress.check``), ``content`` (``agents.messages.message_content``: 1–200,000
    characters, storable). Validate with the context ``{"peer_instance_id": …}``."""

    absent_as_null = ("to_agent_id", "from", "content")

    to_agent_id: str = Field(min_length=1, max_length=AGENT_ID_MAX)
    sender: SenderAddress = Field(alias="from")
    content: str = Field(min_length=1, max_length=MAX_MESSAGE_LENGTH)

    @field_validator("to_agent_id", mode="before")
    @classmethod
    def _to_agent_id(cls, value: Any) -> str:
        if not isinstance(value, str) or not 0 < len(value) <= AGENT_ID_MAX:
            raise ValueError("to_agent_id must be an agent id")
        return value

    @field_validator("sender", mode="before")
    @classmethod
    def _sender(cls, value: Any, info: ValidationInfo) -> SenderAddress:
        return SenderAddress.check(value, what="from", peer_instance_id=_peer_instance_id(info))

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str:
        try:
            return message_content(value)
        except InvalidRequest as exc:
            raise ValueError(exc.message) from None


BATCH_MAX_MESSAGES = 500  # messages one POST /api/v1/peers/messages/batch may carry (a receiver's bound)
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,100}")  # as the Idempotency-Key header (peers.services.receipts)


def _batch_entries(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not 0 < len(value) <= BATCH_MAX_MESSAGES:
        raise ValueError(f"messages must be a list of 1 to {BATCH_MAX_MESSAGES} messages")
    for index, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise ValueError(f"messages[{index}] must be an object {{idempotency_key, to_agent_id, content, from}}")
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

    absent_as_null = ("messages",)

    messages: Annotated[list[dict[str, Any]], WithJsonSchema(_BATCH_MESSAGES_SCHEMA)]

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> list[dict[str, Any]]:
        return _batch_entries(value)


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


# --- pairing and the staff routes (docs/peers.md#pairing, docs/peers.md#permissions) -----------


class CapabilityFlags(WireModel):
    """The four ``allow_*`` flags (docs/peers.md#permissions), each optional. Their values are checked by
    ``peers.pairing_exchange`` (``"<flag> must be true or false"``), after the routes' own checks."""

    allow_launch: Annotated[Any, _FLAG] = Field(default=None, json_schema_extra=_no_default)
    allow_message: Annotated[Any, _FLAG] = Field(default=None, json_schema_extra=_no_default)
    allow_full_access: Annotated[Any, _FLAG] = Field(default=None, json_schema_extra=_no_default)
    allow_events: Annotated[Any, _FLAG] = Field(default=None, json_schema_extra=_no_default)

    def flags(self) -> dict[str, Any]:
        """The flags the body names, as sent (``peers.pairing_exchange`` checks their values)."""
        return {name: getattr(self, name) for name in CAPABILITY_FIELDS if name in self.model_fields_set}


def _as_user(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError("as_user must be a username")
    return value


class OfferBody(CapabilityFlags):
    """``POST /api/v1/peers/offers``: ``{allow_*?, as_user?}``; ``as_user``
    is a username (empty or null: the caller)."""

    as_user: str | None = None

    @field_validator("as_user", mode="before")
    @classmethod
    def _username(cls, value: Any) -> str | None:
        return _as_user(value)


class LinkBody(CapabilityFlags):
    """``POST /api/v1/peers/link``: ``{url, code, label?, allow_*?, as_user?}``. ``url`` and
    ``code`` are taken as text (absent: empty, which the link refuses); an empty ``label``
    is none; the label's rules and the flags are ``peers.pairing_exchange``'s."""

    url: str = ""
    code: str = ""
    label: Annotated[Any, WithJsonSchema({"type": "string"})] = Field(default=None, json_schema_extra=_no_default)
    as_user: str | None = None

    @field_validator("url", "code", mode="before")
    @classmethod
    def _text(cls, value: Any) -> str:
        return str(value or "")

    @field_validator("label", mode="before")
    @classmethod
    def _label(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("as_user", mode="before")
    @classmethod
    def _username(cls, value: Any) -> str | None:
        return _as_user(value)


class PeerUpdateBody(CapabilityFlags):
    """``PATCH /api/v1/peers/{id}``: ``{label?, allow_*?}``; any other field is
    refused, naming it. The label's rules and the flags' values are ``peers.pairing_exchange``'s."""

    model_config = ConfigDict(extra="forbid")

    label: Annotated[Any, WithJsonSchema({"type": "string"})] = Field(default=None, json_schema_extra=_no_default)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, value: Any) -> Any:
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"label", *CAPABILITY_FIELDS})
            if unknown:
                raise ValueError(
                    f"unknown field {', '.join(unknown)}; you can change label and {', '.join(CAPABILITY_FIELDS)}"
                )
        return value


def _claim_text(value: Any, what: str, *, max_length: int, required: bool = True) -> str:
    if not isinstance(value, str) or len(value) > max_length or (required and not value.strip()):
        raise ValueError(f"{what} must be text of 1 to {max_length} characters")
    return value.strip()


def _claimant_instance_id(value: Any, info: ValidationInfo) -> str:
    instance_id = _claim_text(value, "instance_id", max_length=17)
    if not INSTANCE_ID_PATTERN.fullmatch(instance_id):
        raise ValueError("instance_id must be 'inst_' and 12 lowercase hex digits")
    if instance_id == (info.context or {}).get(OUR_INSTANCE_ID):
        raise ValueError("an instance cannot be linked to itself")
    return instance_id


def _claimant_url(value: Any) -> str:
    url = _claim_text(value, "url", max_length=2048)
    if not url.startswith(("http://", "https://")):
        raise ValueError("url must start with http:// or https://")
    return url.rstrip("/")


def _claimant_public_key(value: Any) -> str:
    public_key = _claim_text(value, "public_key", max_length=64)
    try:
        public_key_from(public_key)
    except ValueError:
        raise ValueError("public_key must be a raw Ed25519 public key in base64url") from None
    return public_key


def _claimant_name(value: Any) -> str:
    return _claim_text(value, "name", max_length=NAME_MAX, required=False)


def _claimant_token(value: Any) -> str:
    return _claim_text(value, "token_for_you", max_length=200)


def _granted(value: Any) -> dict[str, bool] | None:
    """The ``allow_*`` flags of a claim's ``capabilities`` that are booleans; anything else
    there is left out (what the other side grants is informative)."""
    if not isinstance(value, dict):
        return None
    return {name: value[name] for name in CAPABILITY_FIELDS if isinstance(value.get(name), bool)}


# The fields a claim and its answer share: who the other instance is (docs/peers.md#claim).
# Each is stripped; validate with the context {OUR_INSTANCE_ID: this instance's id}.
ClaimantInstanceId = Annotated[str, BeforeValidator(_claimant_instance_id)]
ClaimantName = Annotated[str, BeforeValidator(_claimant_name)]
ClaimantUrl = Annotated[str, BeforeValidator(_claimant_url)]
ClaimantPublicKey = Annotated[str, BeforeValidator(_claimant_public_key)]
ClaimantToken = Annotated[str, BeforeValidator(_claimant_token)]


class ClaimBody(WireModel):
    """``POST /api/v1/peers/claim``: ``{code, protocol_version, instance_id, name, url,
    public_key, token_for_you, capabilities?, features?}`` (docs/peers.md#claim), judged after the claim
    rate limit and before the code: ``protocol_version`` first (refused
    with ``details.protocol_version``), then the fields in this order, each text of bounded
    length, stripped (``url`` without a trailing slash). A ``code`` that cannot be one is a
    wrong code (401), never a bad body; ``capabilities`` keeps its boolean ``allow_*``
    flags; ``features`` keeps the well-formed names (``peers.keys.features_parse``).
    Validate with the context ``{"our_instance_id": …}``.
    """

    absent_as_null = ("code", "protocol_version", "instance_id", "url", "public_key", "token_for_you")

    code: Annotated[
        Any, WithJsonSchema({"type": "string", "description": "the pairing code shown on this instance, XXXX-XXXX"})
    ]
    protocol_version: int = Field(
        description="PEER_PROTOCOL_VERSION, 2", json_schema_extra={"const": PEER_PROTOCOL_VERSION}
    )
    instance_id: ClaimantInstanceId = Field(pattern=r"^inst_[0-9a-f]{12}$")
    name: ClaimantName = Field(default="", max_length=NAME_MAX)
    # The schemas say what the validators refuse of the value as sent (stripped, the url
    # without its trailing slashes, the key decoded to 32 bytes).
    url: ClaimantUrl = Field(max_length=2048, pattern=r"^https?://", json_schema_extra={"pattern": r"^https?://[^/\s]"})
    public_key: ClaimantPublicKey = Field(
        max_length=64,
        description="raw Ed25519 public key, base64url",
        json_schema_extra={"pattern": "^[A-Za-z0-9_-]{43}=?$"},
    )
    token_for_you: ClaimantToken = Field(min_length=1, max_length=200, json_schema_extra={"pattern": r"\S"})
    capabilities: Annotated[dict[str, bool] | None, BeforeValidator(_granted)] = Field(
        default=None, description="what the claimant lets this instance do there (recorded as granted_by_peer)"
    )
    features: Annotated[list[str], BeforeValidator(features_parse)] = Field(
        default_factory=list,
        description="what the claimant can do beyond the protocol version (peers.keys.PEER_FEATURES, "
        'e.g. "messages.batch"); absent: nothing',
    )

    @field_validator("protocol_version", mode="before")
    @classmethod
    def _protocol_version(cls, value: Any) -> int:
        details = {"protocol_version": PEER_PROTOCOL_VERSION}
        if not isinstance(value, int) or isinstance(value, bool):
            raise refusal(
                f"protocol_version must be an integer (this instance speaks {PEER_PROTOCOL_VERSION})", details
            )
        if value != PEER_PROTOCOL_VERSION:
            raise refusal(f"peer speaks protocol {value}, this instance speaks {PEER_PROTOCOL_VERSION}", details)
        return value


class ClaimAnswer(WireModel):
    """The claim's answer: this instance and the token it issued to the claimant, with the
    capabilities the offer grants. The claimant checks ``protocol_version``, then the fields
    as a claim's (context ``{"our_instance_id": …}``); an absent ``name`` is empty, absent
    ``capabilities`` none."""

    absent_as_null = ("instance_id", "url", "public_key", "token_for_you", "capabilities")

    protocol_version: int
    instance_id: ClaimantInstanceId
    name: ClaimantName
    url: ClaimantUrl
    public_key: ClaimantPublicKey
    token_for_you: ClaimantToken
    capabilities: Annotated[dict[str, bool], BeforeValidator(lambda value: _granted(value) or {})]
    features: Annotated[list[str], BeforeValidator(features_parse)] = Field(
        default_factory=list, description="what this instance can do beyond the protocol version; absent: nothing"
    )

    @model_validator(mode="before")
    @classmethod
    def _unnamed(cls, value: Any) -> Any:
        return {"name": "", **value} if isinstance(value, dict) else value


class OfferAnswer(BaseModel):
    """A pairing offer: ``{code, expires_at, address, fingerprint}``."""

    code: str
    expires_at: str
    address: str
    fingerprint: str


class PeerAnswer(BaseModel):
    """A link as the staff API shows it (``pairing_api.peer_data``; never a token: the
    inbound token's prefix only). Times are ISO 8601."""

    id: int
    label: str
    reported_name: str
    instance_id: str
    url: str
    fingerprint: str
    owner: str
    capabilities: dict[str, bool]
    granted_by_peer: dict[str, Any]
    inbound_prefix: str
    created_at: str
    last_seen_at: str | None
    revoked_at: str | None
    unlinked_by_peer: bool
    outbox: dict[str, int] = Field(description="{queued, dead} rows of the outbox")


class LinkAnswer(BaseModel):
    """A link just made: ``{peer, our_fingerprint, their_fingerprint}``."""

    peer: PeerAnswer
    our_fingerprint: str
    their_fingerprint: str


class PeerListAnswer(BaseModel):
    """``{"peers": [...]}``: the caller's live links with their outbox counts."""

    peers: list[PeerAnswer]


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


# --- approvals over the link (docs/peers.md "Approvals") --------------------------------------

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

    absent_as_null = ("decision", "answered_by")

    decision: Literal["allow_once", "allow_always", "deny"]
    message: str = Field(default="", max_length=APPROVAL_MESSAGE_MAX)
    answered_by: SenderAddress

    @field_validator("decision", mode="before")
    @classmethod
    def _decision(cls, value: Any) -> str:
        if value not in APPROVAL_DECISIONS:
            raise ValueError(f"decision must be one of: {', '.join(APPROVAL_DECISIONS)}")
        return str(value)

    @field_validator("message", mode="before")
    @classmethod
    def _message(cls, value: Any) -> str:
        if value is None:
            return ""
        return _text(value, "message", max_length=APPROVAL_MESSAGE_MAX, required=False)

    @field_validator("answered_by", mode="before")
    @classmethod
    def _answered_by(cls, value: Any, info: ValidationInfo) -> SenderAddress:
        return SenderAddress.check(value, what="answered_by", peer_instance_id=_peer_instance_id(info))


class PeerApprovalAnswer(BaseModel):
    """The answered approval: ``{id, agent_id, status, decision, answered_by, answered_at}``."""

    id: str
    agent_id: str
    status: str
    decision: str
    answered_by: str
    answered_at: str | None
