"""The peer API's body models (peers/protocol.py) say what the routes say (spec/peers.md §2,
§5, §6): for every malformed body, the model's verdict is the route's — the sentence
``peers.services`` and ``peers.pairing`` answer — and the bodies this instance sends are
bodies the models accept."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from agents.messages import MAX_MESSAGE_LENGTH
from core.errors import InvalidRequest
from core.validation import parse_plain
from peers.protocol import (
    PEER_INSTANCE_ID,
    ClaimBody,
    LaunchBody,
    LinkBody,
    MessageBody,
    OfferBody,
    PeerUpdateBody,
)
from peers.services import incoming as services

pytestmark = pytest.mark.django_db

INSTANCE = "inst_0123456789ab"
PERSON = {"instance_id": INSTANCE, "agent_id": None, "name": "Ann"}
LAUNCH = {"name": "worker", "prompt": "go", "cwd": "/srv/repo", "launched_by": PERSON}
MESSAGE = {"to_agent_id": "agt_0123456789ab", "content": "hello", "from": PERSON}

BAD_LAUNCHES: list[dict[str, Any]] = [
    {k: v for k, v in LAUNCH.items() if k != "name"},
    {**LAUNCH, "name": "  "},
    {**LAUNCH, "name": 7},
    {**LAUNCH, "name": "n" * 101},
    {**LAUNCH, "prompt": 5},
    {**LAUNCH, "prompt": "p" * (MAX_MESSAGE_LENGTH + 1)},
    {**LAUNCH, "type": ["expert"]},
    {**LAUNCH, "full_access": "yes"},
    {**LAUNCH, "child": 1},
    {k: v for k, v in LAUNCH.items() if k != "launched_by"},
    {**LAUNCH, "launched_by": "Ann"},
    {**LAUNCH, "launched_by": {**PERSON, "instance_id": "inst_ffffffffffff"}},
    {**LAUNCH, "launched_by": {**PERSON, "agent_id": "a:b"}},
    {**LAUNCH, "launched_by": {**PERSON, "agent_id": ""}},
    {**LAUNCH, "launched_by": {**PERSON, "name": ""}},
    # Two faults: the first one in the route's order is named.
    {**LAUNCH, "name": None, "full_access": "x"},
    {**LAUNCH, "child": "x", "launched_by": None},
]

BAD_MESSAGES: list[dict[str, Any]] = [
    {k: v for k, v in MESSAGE.items() if k != "to_agent_id"},
    {**MESSAGE, "to_agent_id": "a" * 65},
    {**MESSAGE, "from": None},
    {**MESSAGE, "from": {**PERSON, "instance_id": "inst_ffffffffffff"}},
    {**MESSAGE, "from": {**PERSON, "agent_id": 5}},
    {k: v for k, v in MESSAGE.items() if k != "content"},
    {**MESSAGE, "content": "   "},
    {**MESSAGE, "content": "c" * (MAX_MESSAGE_LENGTH + 1)},
    {**MESSAGE, "content": "nul \x00 inside"},
    {**MESSAGE, "to_agent_id": 3, "content": None},
]


def _verdict(check: Any) -> str:
    with pytest.raises(InvalidRequest) as refused:
        check()
    return refused.value.message


@pytest.fixture
def cloud(make_peer: Any, owner: Any) -> Any:
    return make_peer(owner, instance_id=INSTANCE).peer


@pytest.mark.parametrize("body", BAD_LAUNCHES, ids=range(len(BAD_LAUNCHES)))
def test_a_bad_launch_is_refused_by_the_model_as_the_route_refuses_it(cloud: Any, body: dict[str, Any]) -> None:
    model = _verdict(lambda: parse_plain(LaunchBody, body, context={PEER_INSTANCE_ID: cloud.instance_id}))
    route = _verdict(lambda: services.peer_launch_here(peer=cloud, body=body))
    assert model == route


@pytest.mark.parametrize("body", BAD_MESSAGES, ids=range(len(BAD_MESSAGES)))
def test_a_bad_message_is_refused_by_the_model_as_the_route_refuses_it(cloud: Any, body: dict[str, Any]) -> None:
    model = _verdict(lambda: parse_plain(MessageBody, body, context={PEER_INSTANCE_ID: cloud.instance_id}))
    route = _verdict(lambda: services.peer_message_here(peer=cloud, body=body, idempotency_key="k"))
    assert model == route


def test_a_good_launch_and_message_pass_the_models() -> None:
    context = {PEER_INSTANCE_ID: INSTANCE}
    launch = parse_plain(LaunchBody, {**LAUNCH, "type": "", "full_access": None}, context=context)
    assert (launch.type, launch.full_access, launch.child, launch.cwd) == (None, False, False, "/srv/repo")
    assert launch.launched_by.wire() == PERSON
    message = parse_plain(MessageBody, MESSAGE, context=context)
    assert (message.to_agent_id, message.sender.name, message.content) == ("agt_0123456789ab", "Ann", "hello")


def test_the_staff_bodies_refuse_what_the_routes_refused() -> None:
    assert _verdict(lambda: parse_plain(OfferBody, {"as_user": 5})) == "as_user must be a username"
    assert parse_plain(OfferBody, {"as_user": "", "allow_launch": False}).flags() == {"allow_launch": False}
    link = parse_plain(LinkBody, {"url": None, "code": 12345678, "label": "", "allow_events": "x"})
    assert (link.url, link.code, link.label, link.as_user, link.flags()) == (
        "",
        "12345678",
        None,
        None,
        {"allow_events": "x"},
    )
    assert _verdict(lambda: parse_plain(PeerUpdateBody, {"label": "x", "owner": 1, "id": 2})) == (
        "unknown field id, owner; you can change label and allow_launch, allow_message, allow_full_access, allow_events"
    )
    update = parse_plain(PeerUpdateBody, {"label": None})
    assert "label" in update.model_fields_set and update.flags() == {}


def test_the_claim_this_instance_sends_is_a_claim_body() -> None:
    # The fields peers.pairing.peer_link posts to /api/v1/peers/claim.
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
