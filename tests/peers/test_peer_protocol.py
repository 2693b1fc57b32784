"""The peer API's body models (peers/protocol.py) are what the routes validate with
(docs/peers.md#the-peer-api): a malformed body is refused by the route with the model's
sentence, at the point the route's documented order puts it (a launch's and a message's
after the Idempotency-Key receipt), and the bodies this instance sends are bodies the
models accept. The claim's order is in tests/peers/test_pairing.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from pydantic import ValidationError

from agents import services as agent_services
from agents.messages import MAX_MESSAGE_LENGTH
from agents.models import Agent, AgentMessage
from core.errors import InvalidRequest
from core.validation import parse_plain
from peers.models import PeerReceipt, new_idempotency_key
from peers.pairing_protocol import ClaimBody, LinkBody, OfferBody, PeerUpdateBody
from peers.protocol import PEER_INSTANCE_ID, ApprovalAnswerBody, LaunchBody, MessageBatchBody, MessageBody
from tests.peers.conftest import FakePeer
from tests.peers.signing import peer_post

pytestmark = pytest.mark.django_db

LAUNCH_ROUTE = "/api/v1/peers/launch"
MESSAGES_ROUTE = "/api/v1/peers/messages"
INSTANCE = "inst_0123456789ab"
PERSON = {"instance_id": INSTANCE, "agent_id": None, "name": "Ann"}
LAUNCH = {"name": "worker", "prompt": "go", "cwd": "/srv/repo", "launched_by": PERSON}
MESSAGE = {"to_agent_id": "agt_0123456789ab", "content": "hello", "from": PERSON}

ABSENT = object()  # a field left out of a body
NOT_AN_ADDRESS = "must be an object"
NOT_THE_PEER = f"must be the calling peer's instance id ({INSTANCE})"
NOT_AN_AGENT_ID = "must be an agent id (at most 64 characters, no colon) or null"

# (body, the sentence the route answers with 400)
BAD_LAUNCHES: list[tuple[dict[str, Any], str]] = [
    ({k: v for k, v in LAUNCH.items() if k != "name"}, "name is required"),
    ({**LAUNCH, "name": "  "}, "name must be a non-empty string"),
    ({**LAUNCH, "name": 7}, "name must be a string"),
    ({**LAUNCH, "name": "n" * 101}, "name must be at most 100 characters"),
    ({**LAUNCH, "prompt": 5}, "prompt must be a string"),
    ({**LAUNCH, "prompt": "p" * (MAX_MESSAGE_LENGTH + 1)}, f"prompt must be at most {MAX_MESSAGE_LENGTH} characters"),
    ({**LAUNCH, "type": ["expert"]}, "type must be a string"),
    ({**LAUNCH, "full_access": "yes"}, "full_access must be true or false"),
    ({**LAUNCH, "child": 1}, "child must be true or false"),
    ({**LAUNCH, "type": 0}, "type must be a string"),
    ({k: v for k, v in LAUNCH.items() if k != "launched_by"}, "launched_by is required"),
    ({**LAUNCH, "launched_by": "Ann"}, f"launched_by {NOT_AN_ADDRESS}"),
    ({**LAUNCH, "launched_by": {**PERSON, "instance_id": 5}}, "launched_by.instance_id must be a string"),
    (
        {**LAUNCH, "launched_by": {**PERSON, "instance_id": "inst_ffffffffffff"}},
        f"launched_by.instance_id {NOT_THE_PEER}",
    ),
    ({**LAUNCH, "launched_by": {**PERSON, "agent_id": "a:b"}}, f"launched_by.agent_id {NOT_AN_AGENT_ID}"),
    ({**LAUNCH, "launched_by": {**PERSON, "agent_id": ""}}, f"launched_by.agent_id {NOT_AN_AGENT_ID}"),
    ({**LAUNCH, "launched_by": {**PERSON, "name": ""}}, "launched_by.name must be a non-empty string"),
    # Two faults: the first one in the route's order is named.
    ({**LAUNCH, "name": None, "full_access": "x"}, "name must be a string"),
    ({**LAUNCH, "child": "x", "launched_by": None}, "child must be true or false"),
]

BAD_MESSAGES: list[tuple[dict[str, Any], str]] = [
    ({k: v for k, v in MESSAGE.items() if k != "to_agent_id"}, "to_agent_id is required"),
    ({**MESSAGE, "to_agent_id": "a" * 65}, "to_agent_id must be at most 64 characters"),
    ({**MESSAGE, "from": None}, f"from {NOT_AN_ADDRESS}"),
    ({**MESSAGE, "from": {**PERSON, "instance_id": "inst_ffffffffffff"}}, f"from.instance_id {NOT_THE_PEER}"),
    ({**MESSAGE, "from": {**PERSON, "agent_id": 5}}, "from.agent_id must be a string"),
    ({k: v for k, v in MESSAGE.items() if k != "content"}, "content is required"),
    ({**MESSAGE, "content": "   "}, "content must be a non-empty string"),
    ({**MESSAGE, "content": 5}, "content must be a string"),
    (
        {**MESSAGE, "content": "c" * (MAX_MESSAGE_LENGTH + 1)},
        f"content must be at most {MAX_MESSAGE_LENGTH} characters",
    ),
    ({**MESSAGE, "content": "nul \x00 inside"}, "content holds a NUL character or a lone surrogate"),
    ({**MESSAGE, "to_agent_id": 3, "content": None}, "to_agent_id must be a string"),
]


def _verdict(check: Callable[[], Any]) -> str:
    with pytest.raises(InvalidRequest) as refused:
        check()
    return refused.value.message


@pytest.fixture
def cloud(make_peer: Callable[..., FakePeer], owner: Any) -> FakePeer:
    return make_peer(owner, instance_id=INSTANCE)


@pytest.fixture
def client() -> Client:
    return Client()


@pytest.mark.parametrize(("body", "sentence"), BAD_LAUNCHES, ids=range(len(BAD_LAUNCHES)))
def test_a_bad_launch_is_refused_by_the_route_with_the_models_sentence(
    client: Client, cloud: FakePeer, body: dict[str, Any], sentence: str
) -> None:
    assert _verdict(lambda: parse_plain(LaunchBody, body, context={PEER_INSTANCE_ID: INSTANCE})) == sentence

    response = peer_post(client, cloud, LAUNCH_ROUTE, body)

    assert response.status_code == 400
    assert response.json()["error"] == {"code": "INVALID_REQUEST", "message": sentence, "details": {}}
    assert not Agent.objects.exists()
    assert not PeerReceipt.objects.exists()  # a retry under the key is judged afresh


@pytest.mark.parametrize(("body", "sentence"), BAD_MESSAGES, ids=range(len(BAD_MESSAGES)))
def test_a_bad_message_is_refused_by_the_route_with_the_models_sentence(
    client: Client, cloud: FakePeer, body: dict[str, Any], sentence: str
) -> None:
    assert _verdict(lambda: parse_plain(MessageBody, body, context={PEER_INSTANCE_ID: INSTANCE})) == sentence

    response = peer_post(client, cloud, MESSAGES_ROUTE, body)

    assert response.status_code == 400
    assert response.json()["error"] == {"code": "INVALID_REQUEST", "message": sentence, "details": {}}
    assert not AgentMessage.objects.exists()
    assert not PeerReceipt.objects.exists()


def test_a_reused_message_key_is_422_before_the_body_is_judged(
    client: Client, cloud: FakePeer, owner: Any, tmp_path: Path
) -> None:
    # The receipt comes first, so another body under a used key is 422 even when
    # that body is malformed; a malformed first body leaves no receipt behind.
    helper = agent_services.agent_create(owner=owner, type="expert", name="helper", cwd=str(tmp_path))
    good = {**MESSAGE, "to_agent_id": helper.pk}
    key = new_idempotency_key()
    refused = peer_post(client, cloud, MESSAGES_ROUTE, {**good, "content": ""}, idempotency_key=key)
    delivered = peer_post(client, cloud, MESSAGES_ROUTE, good, idempotency_key=key)
    reused = peer_post(client, cloud, MESSAGES_ROUTE, {**good, "from": None}, idempotency_key=key)

    assert (refused.status_code, delivered.status_code, reused.status_code) == (400, 200, 422)
    assert reused.json()["error"]["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert AgentMessage.objects.count() == 1


def test_a_reused_launch_key_is_422_before_the_body_is_judged(
    client: Client, cloud: FakePeer, tmp_path: Path, settings: Any
) -> None:
    settings.REPO_ROOTS = [os.path.realpath(tmp_path)]
    key = new_idempotency_key()
    launched = peer_post(
        client, cloud, LAUNCH_ROUTE, {**LAUNCH, "type": "expert", "cwd": str(tmp_path)}, idempotency_key=key
    )
    reused = peer_post(client, cloud, LAUNCH_ROUTE, {**LAUNCH, "name": ""}, idempotency_key=key)

    assert (launched.status_code, reused.status_code) == (201, 422)
    assert reused.json()["error"]["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert Agent.objects.count() == 1


def test_a_good_launch_and_message_pass_the_models() -> None:
    context = {PEER_INSTANCE_ID: INSTANCE}
    launch = parse_plain(LaunchBody, {**LAUNCH, "type": "", "full_access": None}, context=context)
    assert (launch.type, launch.full_access, launch.child, launch.cwd) == (None, False, False, "/srv/repo")
    assert launch.launched_by.wire() == PERSON
    message = parse_plain(MessageBody, MESSAGE, context=context)
    assert (message.to_agent_id, message.sender.name, message.content) == ("agt_0123456789ab", "Ann", "hello")


def test_a_message_names_its_sender_from_only() -> None:
    """``from`` is the wire's one name for the sender; the model's Python name is not another."""
    context = {PEER_INSTANCE_ID: INSTANCE}
    renamed = {"to_agent_id": MESSAGE["to_agent_id"], "sender": MESSAGE["from"], "content": "hello"}
    assert _verdict(lambda: parse_plain(MessageBody, renamed, context=context)) == "from is required"


def test_the_staff_bodies_refuse_what_the_routes_refused() -> None:
    assert _verdict(lambda: parse_plain(OfferBody, {"as_user": 5})) == "as_user must be a string"
    assert parse_plain(OfferBody, {"as_user": "", "allow_launch": False}).flags() == {"allow_launch": False}
    link = parse_plain(LinkBody, {"url": None, "code": "BCDF-GHJK", "label": "", "allow_events": True})
    assert (link.url, link.code, link.label, link.as_user, link.flags()) == (
        "",
        "BCDF-GHJK",
        None,
        None,
        {"allow_events": True},
    )
    assert _verdict(lambda: parse_plain(PeerUpdateBody, {"label": "x", "owner": 1, "id": 2})) == (
        "unknown field id, owner; you can change label and allow_launch, allow_message, allow_full_access, allow_events"
    )
    update = parse_plain(PeerUpdateBody, {"label": None})
    assert "label" in update.model_fields_set and update.flags() == {}


@pytest.mark.parametrize(
    ("model", "body", "sentence"),
    [
        (LinkBody, {"code": 12345678}, "code must be a string"),
        (LinkBody, {"url": ["http://x"]}, "url must be a string"),
        (LinkBody, {"allow_events": "x"}, "allow_events must be true or false"),
        (OfferBody, {"allow_launch": 1}, "allow_launch must be true or false"),
        (OfferBody, {"allow_launch": None}, "allow_launch must not be null"),
        (PeerUpdateBody, {"label": "x", "allow_message": "yes"}, "allow_message must be true or false"),
    ],
)
def test_the_staff_bodies_type_their_fields(model: Any, body: dict[str, Any], sentence: str) -> None:
    assert _verdict(lambda: parse_plain(model, body)) == sentence


def test_the_claim_this_instance_sends_is_a_claim_body() -> None:
    # The fields peers.pairing_exchange.peer_link posts to /api/v1/peers/claim.
    claim = {
        "code": "BCDF-GHJK",
        "protocol_version": 2,
        "instance_id": INSTANCE,
        "name": "laptop",
        "url": "http://127.0.0.1:8000",
        "public_key": "A" * 43,
        "token_for_you": "t" * 43,
        "capabilities": {"allow_launch": True, "allow_message": True, "allow_full_access": False, "allow_events": True},
    }
    assert ClaimBody.model_validate(claim).capabilities == claim["capabilities"]
    with pytest.raises(ValidationError):
        ClaimBody.model_validate({**claim, "instance_id": "inst_X"})


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        ({"decision": "yes"}, "decision must be one of: allow_once, allow_always, deny"),
        ({"decision": None}, "decision must be one of: allow_once, allow_always, deny"),
        ({"decision": ABSENT}, "decision is required"),
        ({"message": 5}, "message must be a string"),
        ({"message": "m" * 2001}, "message must be at most 2000 characters"),
        ({"answered_by": ABSENT}, "answered_by is required"),
        ({"answered_by": {**PERSON, "name": 5}}, "answered_by.name must be a string"),
    ],
)
def test_a_bad_approval_answer_is_refused_with_its_sentence(overrides: dict[str, Any], sentence: str) -> None:
    body = {k: v for k, v in {"decision": "deny", "answered_by": PERSON, **overrides}.items() if v is not ABSENT}
    assert _verdict(lambda: parse_plain(ApprovalAnswerBody, body, context={PEER_INSTANCE_ID: INSTANCE})) == sentence


def test_an_approval_answer_without_a_message_has_an_empty_one() -> None:
    for body in (
        {"decision": "deny", "answered_by": PERSON},
        {"decision": "deny", "answered_by": PERSON, "message": None},
    ):
        assert parse_plain(ApprovalAnswerBody, body, context={PEER_INSTANCE_ID: INSTANCE}).message == ""


@pytest.mark.parametrize(
    ("body", "sentence"),
    [
        ({}, "messages is required"),
        ({"messages": []}, "messages must not be empty"),
        ({"messages": "no"}, "messages must be a list"),
        ({"messages": [{"idempotency_key": "k"}] * 501}, "messages must have at most 500 items"),
        ({"messages": [{"idempotency_key": "k"}, 1]}, "messages[1] must be an object"),
        (
            {"messages": [{"idempotency_key": "has space"}]},
            "messages[0].idempotency_key must be 1 to 100 printable ASCII characters without spaces",
        ),
    ],
)
def test_a_bad_batch_envelope_is_refused_with_its_sentence(body: dict[str, Any], sentence: str) -> None:
    assert _verdict(lambda: parse_plain(MessageBatchBody, body)) == sentence
