"""Typed bodies of pairing and of the staff routes that manage links (docs/peers.md#pairing,
docs/peers.md#permissions), split from ``peers.protocol`` (the peer API's), whose conventions they
follow: one model per route body, validated where the route's documented order puts the check
and named in the view's ``core.openapi.documented`` operation; one model per answer, for the schema.

| route | body | validated by the model at |
|---|---|---|
| ``POST /api/v1/peers/claim`` | ``ClaimBody`` | ``pairing_api.claim_api``, after the rate limit |
| ``POST /api/v1/peers/offers`` | ``OfferBody`` | ``pairing_api.offers_api`` |
| ``POST /api/v1/peers/link`` | ``LinkBody`` | ``pairing_api.link_api`` |
| ``PATCH /api/v1/peers/{id}`` | ``PeerUpdateBody`` | ``pairing_api.peer_api`` |

A claim is judged after the claim rate limit (429 first) and before its code (401).
``ClaimAnswer`` also validates the claim's answer on the claiming side
(``pairing_exchange.peer_link``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from core.validation import Omittable, WireModel, refusal
from peers.keys import PEER_PROTOCOL_VERSION, features_parse, public_key_from
from peers.protocol import CAPABILITY_FIELDS, NAME_MAX

OUR_INSTANCE_ID = "our_instance_id"  # the validation context key of a claim or its answer: this instance's id
INSTANCE_ID_PATTERN = re.compile(r"inst_[0-9a-f]{12}")


def _no_default(schema: dict[str, Any]) -> None:
    """Leave a field's ``default: null`` out of the schema (absent means "unchanged")."""
    schema.pop("default", None)


# --- pairing and the staff routes (docs/peers.md#pairing, docs/peers.md#permissions) -----------


# A flag the body may leave out (absent: the offer's default, or unchanged), not send as null.
_Flag = Annotated[Omittable[StrictBool], Field(json_schema_extra=_no_default)]


class CapabilityFlags(WireModel):
    """The four ``allow_*`` flags (docs/peers.md#permissions), each optional, each a boolean
    (``core.validation.PLAIN_SENTENCES``: ``allow_launch must be true or false``), judged
    with the body, before the route's own checks (``as_user``, the label)."""

    allow_launch: _Flag = None
    allow_message: _Flag = None
    allow_full_access: _Flag = None
    allow_events: _Flag = None

    def flags(self) -> dict[str, Any]:
        """The flags the body names, ``{allow_*: bool}``."""
        return {name: getattr(self, name) for name in CAPABILITY_FIELDS if name in self.model_fields_set}


class OfferBody(CapabilityFlags):
    """``POST /api/v1/peers/offers``: ``{allow_*?, as_user?}``; ``as_user``
    is a username (empty or null: the caller)."""

    as_user: StrictStr | None = None

    @field_validator("as_user")
    @classmethod
    def _caller(cls, value: str | None) -> str | None:
        return value or None  # "": the caller, as absent


class LinkBody(CapabilityFlags):
    """``POST /api/v1/peers/link``: ``{url, code, label?, allow_*?, as_user?}``. ``url`` and
    ``code`` are text (absent or null: empty, which the link refuses); an empty ``label``
    is none; the label's rules are ``peers.services.links.label_validate``'s (which answers
    a label that is not text with ``details.label``, so its type is checked there)."""

    null_as_absent = ("url", "code")

    url: StrictStr = ""
    code: StrictStr = ""
    label: Annotated[Any, WithJsonSchema({"type": "string"})] = Field(default=None, json_schema_extra=_no_default)
    as_user: StrictStr | None = None

    @field_validator("label")
    @classmethod
    def _label(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("as_user")
    @classmethod
    def _caller(cls, value: str | None) -> str | None:
        return value or None


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


def _claimant_instance_id(value: str, info: ValidationInfo) -> str:
    if not INSTANCE_ID_PATTERN.fullmatch(value):
        raise ValueError("instance_id must be 'inst_' and 12 lowercase hex digits")
    if value == (info.context or {}).get(OUR_INSTANCE_ID):
        raise ValueError("an instance cannot be linked to itself")
    return value


def _claimant_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError("url must start with http:// or https://")
    return value.rstrip("/")


def _claimant_public_key(value: str) -> str:
    try:
        public_key_from(value)
    except ValueError:
        raise ValueError("public_key must be a raw Ed25519 public key in base64url") from None
    return value


def _granted(value: Any) -> dict[str, bool] | None:
    """The ``allow_*`` flags of a claim's ``capabilities`` that are booleans; anything else
    there is left out (what the other side grants is informative)."""
    if not isinstance(value, dict):
        return None
    return {name: value[name] for name in CAPABILITY_FIELDS if isinstance(value.get(name), bool)}


# The fields a claim and its answer share: who the other instance is (docs/peers.md#claim).
# Each is a string, stripped, of bounded length (core.validation.PLAIN_SENTENCES answers
# for those), then its own rule; validate with the context {OUR_INSTANCE_ID: this
# instance's id}.
ClaimantInstanceId = Annotated[
    StrictStr,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=17),
    AfterValidator(_claimant_instance_id),
]
ClaimantName = Annotated[StrictStr, StringConstraints(strip_whitespace=True, max_length=NAME_MAX)]
ClaimantUrl = Annotated[
    StrictStr, StringConstraints(strip_whitespace=True, min_length=1, max_length=2048), AfterValidator(_claimant_url)
]
ClaimantPublicKey = Annotated[
    StrictStr,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=64),
    AfterValidator(_claimant_public_key),
]
ClaimantToken = Annotated[StrictStr, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]


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

    absent_as_null = ("code", "protocol_version")

    code: Annotated[
        Any, WithJsonSchema({"type": "string", "description": "the pairing code shown on this instance, XXXX-XXXX"})
    ]
    protocol_version: int = Field(
        description="PEER_PROTOCOL_VERSION, 2", json_schema_extra={"const": PEER_PROTOCOL_VERSION}
    )
    instance_id: ClaimantInstanceId = Field(json_schema_extra={"pattern": r"^inst_[0-9a-f]{12}$"})
    name: ClaimantName = Field(default="", max_length=NAME_MAX)
    # The schemas say what the validators refuse of the value as sent (stripped, the url
    # without its trailing slashes, the key decoded to 32 bytes).
    url: ClaimantUrl = Field(max_length=2048, json_schema_extra={"pattern": r"^https?://[^/\s]"})
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
        description='what the claimant can do beyond the protocol version (e.g. "messages.batch"); absent: nothing',
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

    absent_as_null = ("capabilities",)

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
