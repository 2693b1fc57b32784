"""The batch form of the peer message API and the feature announcement that enables it
(docs/peers.md#message-batches, docs/peers.md#features): ``POST
/api/v1/peers/messages/batch`` answers a receipt per message with the single route's
idempotency rules, and every peer route carries ``Dispatch-Peer-Features``; the pairing
claim and its answer carry ``features``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern

from agents import services as agent_services
from agents.models import Agent, AgentMessage, Run
from core.services import generate_token
from peers import peer_api
from peers.keys import FEATURES_HEADER
from peers.models import Peer, PeerReceipt, new_idempotency_key
from peers.services import incoming as peer_services
from peers.services.pairing import offer_create
from peers.urls import api_urlpatterns
from tests.agents.conftest import force_status
from tests.peers.conftest import FakePeer, new_key_pair
from tests.peers.signing import json_body, peer_get, peer_post, signed_headers

pytestmark = pytest.mark.django_db

BATCH = "/api/v1/peers/messages/batch"
MESSAGES = "/api/v1/peers/messages"


@pytest.fixture
def cloud(make_peer: Callable[..., FakePeer], owner: Any) -> FakePeer:
    return make_peer(owner, label="Cloud")


@pytest.fixture
def client() -> Client:
    return Client()


def expert(owner: Any, tmp_path: Path, name: str = "helper") -> Agent:
    return agent_services.agent_create(owner=owner, type="expert", name=name, cwd=str(tmp_path))


def entry(fake: FakePeer, agent_id: str, content: str, key: str | None = None) -> dict[str, Any]:
    return {
        "idempotency_key": key or new_idempotency_key(),
        "to_agent_id": agent_id,
        "content": content,
        "from": {"instance_id": fake.instance_id, "agent_id": "agt_planner1", "name": "planner"},
    }


def single_body(batch_entry: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in batch_entry.items() if name != "idempotency_key"}


def receipts_of(response: Any) -> list[tuple[str, int]]:
    assert response.status_code == 200, response.content
    return [(receipt["idempotency_key"], receipt["status"]) for receipt in response.json()["receipts"]]


def test_a_batch_delivers_every_message_in_order_with_a_receipt_each(client, cloud, owner, tmp_path):
    helper = expert(owner, tmp_path)
    entries = [entry(cloud, helper.pk, f"message {n}") for n in range(5)]

    response = peer_post(client, cloud, BATCH, {"messages": entries})

    assert receipts_of(response) == [(e["idempotency_key"], 200) for e in entries]
    stored = list(AgentMessage.objects.order_by("id"))
    assert [m.content for m in stored] == [f"message {n}" for n in range(5)]
    assert [m.idempotency_key for m in stored] == [e["idempotency_key"] for e in entries]
    assert [r["body"] for r in response.json()["receipts"]] == [{"delivered": True, "message_id": m.pk} for m in stored]
    assert PeerReceipt.objects.filter(peer=cloud.peer, route="messages").count() == 5
    assert Run.objects.filter(agent=helper).count() == 5


def test_a_replayed_batch_is_answered_from_the_receipts_without_delivering_again(client, cloud, owner, tmp_path):
    helper = expert(owner, tmp_path)
    entries = [entry(cloud, helper.pk, f"message {n}") for n in range(3)]
    key = new_idempotency_key()
    peer_post(client, cloud, BATCH, {"messages": entries}, idempotency_key=key)

    again = peer_post(client, cloud, BATCH, {"messages": entries}, idempotency_key=key)
    fresh_key = peer_post(client, cloud, BATCH, {"messages": entries})

    for response in (again, fresh_key):
        assert receipts_of(response) == [(e["idempotency_key"], 200) for e in entries]
        assert [r["body"] for r in response.json()["receipts"]] == [{"delivered": True, "duplicate": True}] * 3
    assert AgentMessage.objects.count() == 3
    assert Run.objects.filter(agent=helper).count() == 3


def test_a_message_sent_alone_then_in_a_batch_is_delivered_once(client, cloud, owner, tmp_path):
    helper = expert(owner, tmp_path)
    first = entry(cloud, helper.pk, "sent alone first")
    peer_post(client, cloud, MESSAGES, single_body(first), idempotency_key=first["idempotency_key"])

    response = peer_post(client, cloud, BATCH, {"messages": [first, entry(cloud, helper.pk, "new one")]})

    assert [r["body"].get("duplicate", False) for r in response.json()["receipts"]] == [True, False]
    assert list(AgentMessage.objects.order_by("id").values_list("content", flat=True)) == [
        "sent alone first",
        "new one",
    ]


def test_a_refused_message_is_answered_alone_and_the_rest_are_delivered(client, cloud, owner, tmp_path):
    helper = expert(owner, tmp_path)
    stopped = force_status(expert(owner, tmp_path, name="sleeper"), "stopped")
    reused = entry(cloud, helper.pk, "original")
    peer_post(client, cloud, MESSAGES, single_body(reused), idempotency_key=reused["idempotency_key"])
    entries = [
        entry(cloud, helper.pk, "one"),
        entry(cloud, stopped.pk, "to a stopped agent"),
        {**reused, "content": "another body under a used key"},
        entry(cloud, "agt_nosuchagent0", "to nobody"),
        {**entry(cloud, helper.pk, "x"), "content": ""},
        entry(cloud, helper.pk, "two"),
    ]

    response = peer_post(client, cloud, BATCH, {"messages": entries})

    assert [status for _, status in receipts_of(response)] == [200, 409, 422, 409, 400, 200]
    assert response.json()["receipts"][1]["body"]["error"]["code"] == "CONFLICT"
    assert list(AgentMessage.objects.order_by("id").values_list("content", flat=True)) == ["original", "one", "two"]
    # A refused message keeps no receipt: a retry under its key is judged afresh.
    refused_keys = [entries[1]["idempotency_key"], entries[3]["idempotency_key"]]
    assert not PeerReceipt.objects.filter(idempotency_key__in=refused_keys).exists()


def test_a_transient_failure_stops_the_batch_there_keeping_what_came_before(
    client, cloud, owner, tmp_path, monkeypatch
):
    helper = expert(owner, tmp_path)
    real = peer_services.peer_message_here

    def flaky(*, peer: Peer, message: Any, idempotency_key: str) -> AgentMessage:
        if message.content == "three":
            raise RuntimeError("database went away")
        return real(peer=peer, message=message, idempotency_key=idempotency_key)

    monkeypatch.setattr(peer_services, "peer_message_here", flaky)
    entries = [entry(cloud, helper.pk, word) for word in ("one", "two", "three", "four")]

    response = peer_post(client, cloud, BATCH, {"messages": entries})

    assert receipts_of(response) == [(e["idempotency_key"], s) for e, s in zip(entries, (200, 200, 503), strict=False)]
    assert response.json()["receipts"][2]["body"]["error"]["code"] == "TEMPORARILY_UNAVAILABLE"
    assert list(AgentMessage.objects.order_by("id").values_list("content", flat=True)) == ["one", "two"]
    assert not PeerReceipt.objects.filter(idempotency_key=entries[2]["idempotency_key"]).exists()
    assert not PeerReceipt.objects.filter(idempotency_key=entries[3]["idempotency_key"]).exists()


@pytest.mark.parametrize(
    "body",
    [{}, {"messages": []}, {"messages": "no"}, {"messages": [1]}, {"messages": [{"idempotency_key": "has space"}]}],
)
def test_a_malformed_batch_is_400_and_delivers_nothing(client, cloud, owner, tmp_path, body):
    response = peer_post(client, cloud, BATCH, body)

    assert response.status_code == 400, response.content
    assert not AgentMessage.objects.exists()


def test_a_batch_needs_allow_message_and_a_signature(client, make_peer, owner, tmp_path):
    helper = expert(owner, tmp_path)
    muted = make_peer(owner, label="Muted", allow_message=False)
    refused = peer_post(client, muted, BATCH, {"messages": [entry(muted, helper.pk, "hi")]})
    content = json_body({"messages": [entry(muted, helper.pk, "hi")]})
    unsigned = client.post(BATCH, data=content, content_type="application/json")

    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "CAPABILITY_NOT_GRANTED"
    assert unsigned.status_code == 401
    assert not AgentMessage.objects.exists()


# --- features ----------------------------------------------------------------------------------------


def _peer_paths() -> list[str]:
    paths = []
    for pattern in api_urlpatterns:
        assert isinstance(pattern, URLPattern)
        route = str(pattern.pattern)
        if route.startswith("peers/") and pattern.callback.__module__ in ("peers.peer_api", "peers.stream"):
            paths.append("/api/v1/" + route.replace("<str:agent_id>", "agt_0123456789ab"))
    return paths


@pytest.mark.django_db(transaction=True)  # the event stream's view is async
def test_every_peer_route_announces_the_features_in_every_answer(cloud):
    client = Client()
    paths = _peer_paths()
    assert {"/api/v1/peers/messages/batch", "/api/v1/peers/events", "/api/v1/peers/unlink"} <= set(paths)
    for path in paths:
        for response in (client.post(path, data=b"{}", content_type="application/json"), client.get(path)):
            assert response.status_code in (401, 405), (path, response.status_code)
            assert response[FEATURES_HEADER] == "messages.batch", path
    answered = peer_get(client, cloud, "/api/v1/peers/repos")
    assert answered.status_code == 200
    assert answered[FEATURES_HEADER] == "messages.batch"
    claim = client.post("/api/v1/peers/claim", data=b"{}", content_type="application/json")
    assert claim.status_code == 400 and claim[FEATURES_HEADER] == "messages.batch"
    claim = client.get("/api/v1/peers/claim")
    assert claim.status_code == 405 and claim[FEATURES_HEADER] == "messages.batch"


def test_a_peer_request_keeps_what_its_header_announces(client, cloud):
    def get_with(features: str | None) -> None:
        headers = signed_headers(cloud, "GET", "/api/v1/peers/repos")
        if features is not None:
            headers[FEATURES_HEADER] = features
        assert client.get("/api/v1/peers/repos", headers=headers).status_code == 200

    get_with("messages.batch, something.new, Not A Name")
    assert Peer.objects.get(pk=cloud.peer.pk).features == ["messages.batch", "something.new"]
    get_with(None)  # an older instance (or a downgrade) announces nothing
    assert Peer.objects.get(pk=cloud.peer.pk).features == []


def _claim(code: str, **extra: Any) -> dict[str, Any]:
    _, public = new_key_pair()
    return {
        "code": code,
        "protocol_version": 2,
        "instance_id": "inst_0123456789ab",
        "name": "laptop",
        "url": "http://127.0.0.1:9",
        "public_key": public,
        "token_for_you": generate_token(),
        **extra,
    }


@pytest.mark.django_db(transaction=True)  # the claim view is async
@pytest.mark.parametrize(("sent", "kept"), [(["messages.batch"], ["messages.batch"]), (None, [])])
def test_the_claim_carries_features_both_ways(owner, sent, kept):
    body = _claim(offer_create(user=owner).code, **({"features": sent} if sent is not None else {}))

    response = Client().post("/api/v1/peers/claim", body, content_type="application/json")

    assert response.status_code == 200, response.content
    assert response.json()["features"] == ["messages.batch"]
    assert response.json()["protocol_version"] == 2  # a feature, never a protocol bump
    assert Peer.objects.get(instance_id="inst_0123456789ab").features == kept


def test_the_batch_route_is_in_the_peer_api(cloud):
    assert peer_api.messages_batch in [pattern.callback for pattern in peer_api.api_urlpatterns]
