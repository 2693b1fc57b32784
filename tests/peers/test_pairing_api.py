"""The staff-only peer management API (/api/v1/peers…) and unlinking
(docs/peers.md#permissions, docs/peers.md#unlinking)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from agents.models import Agent, AgentEvent, AgentMessage
from peers.models import OutboxMessage, PairingOffer, Peer
from peers.pairing_exchange import peer_unlink
from peers.services.pairing import peer_mark_unlinked_by_peer

pytestmark = pytest.mark.django_db(transaction=True)  # async views: their queries run on another thread


def api(token: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def test_non_staff_users_get_403_on_every_pairing_route(member: Any, token_for: Any, make_peer: Any) -> None:
    client = api(token_for(member))
    fake = make_peer(member, label="Cloud")
    answers = [
        client.post("/api/v1/peers/offers", {}, content_type="application/json"),
        client.post("/api/v1/peers/link", {"url": "http://x", "code": "BBBB-BBBB"}, content_type="application/json"),
        client.get("/api/v1/peers"),
        client.patch(f"/api/v1/peers/{fake.peer.pk}", {"label": "x"}, content_type="application/json"),
        client.delete(f"/api/v1/peers/{fake.peer.pk}"),
    ]
    assert [answer.status_code for answer in answers] == [403] * 5
    assert answers[0].json()["error"]["code"] == "PERMISSION_DENIED"
    assert PairingOffer.objects.count() == 0
    assert Peer.objects.get().label == "Cloud" and Peer.objects.get().revoked_at is None


def test_the_pairing_routes_need_a_caller() -> None:
    assert Client().post("/api/v1/peers/offers", {}, content_type="application/json").status_code == 401
    assert Client().get("/api/v1/peers").status_code == 401


def test_a_staff_user_makes_an_offer_for_another_user(owner: Any, member: Any, owner_token: str) -> None:
    response = api(owner_token).post(
        "/api/v1/peers/offers", {"as_user": "bob", "allow_events": False}, content_type="application/json"
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert set(body) == {"code", "expires_at", "address", "fingerprint"}
    offer = PairingOffer.objects.get()
    assert offer.link_user == member and offer.created_by == owner and offer.allow_events is False


def test_a_sixth_offer_is_409_over_the_api(owner_token: str) -> None:
    client = api(owner_token)
    for _ in range(5):
        assert client.post("/api/v1/peers/offers", {}, content_type="application/json").status_code == 200
    refused = client.post("/api/v1/peers/offers", {}, content_type="application/json")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "CONFLICT"


def test_the_list_shows_only_the_callers_live_links(owner: Any, member: Any, owner_token: str, make_peer: Any) -> None:
    from django.utils import timezone

    make_peer(owner, label="Cloud", reported_name="gpu")
    make_peer(owner, label="Old", revoked_at=timezone.now())
    make_peer(member, label="Bobs")
    peers = api(owner_token).get("/api/v1/peers").json()["peers"]
    assert [(p["label"], p["reported_name"]) for p in peers] == [("Cloud", "gpu")]
    assert peers[0]["capabilities"] == {
        "allow_launch": True,
        "allow_message": True,
        "allow_full_access": False,
        "allow_events": True,
    }
    assert peers[0]["outbox"] == {"queued": 0, "dead": 0}
    assert "outbound_token_encrypted" not in peers[0] and "inbound_digest" not in peers[0]


def test_patch_renames_and_sets_flags_and_a_taken_label_is_409(owner: Any, owner_token: str, make_peer: Any) -> None:
    make_peer(owner, label="Cloud")
    fake = make_peer(owner, label="Laptop")
    client = api(owner_token)
    changed = client.patch(
        f"/api/v1/peers/{fake.peer.pk}",
        {"label": "Travel", "allow_launch": False, "allow_full_access": True},
        content_type="application/json",
    )
    assert changed.status_code == 200, changed.content
    peer = Peer.objects.get(pk=fake.peer.pk)
    assert (peer.label, peer.allow_launch, peer.allow_full_access, peer.allow_message) == ("Travel", False, True, True)
    clash = client.patch(
        f"/api/v1/peers/{fake.peer.pk}", {"label": "cloud", "allow_launch": True}, content_type="application/json"
    )
    assert clash.status_code == 409
    assert "already used" in clash.json()["error"]["message"]
    peer.refresh_from_db()
    assert (peer.label, peer.allow_launch) == ("Travel", False)  # nothing of the refused change was kept


def test_delete_unlinks_and_another_users_peer_is_404(
    owner: Any, member: Any, owner_token: str, make_peer: Any
) -> None:
    mine = make_peer(owner, label="Cloud")
    theirs = make_peer(member, label="Bobs")
    client = api(owner_token)
    assert client.delete(f"/api/v1/peers/{theirs.peer.pk}").status_code == 404
    response = client.delete(f"/api/v1/peers/{mine.peer.pk}")
    assert response.status_code == 200
    assert response.json()["revoked_at"] is not None
    assert Peer.objects.get(pk=mine.peer.pk).revoked_at is not None
    assert Peer.objects.get(pk=theirs.peer.pk).revoked_at is None
    assert client.delete(f"/api/v1/peers/{mine.peer.pk}").status_code == 404


def _shadow(owner: Any, peer: Peer, status: str) -> Agent:
    return Agent.objects.create(
        owner=owner, name="remote", type="shell", cwd="/", status=status, peer=peer, peer_agent_id="ag_x"
    )


def _queued_outbox(owner: Any, peer: Peer, shadow: Agent) -> OutboxMessage:
    message = AgentMessage.objects.create(recipient_agent=shadow, sender_user=owner, content="hi", peer=peer)
    return OutboxMessage.objects.create(peer=peer, message=message, to_agent_id="ag_x", payload={"content": "hi"})


def test_unlinking_revokes_closes_the_outbox_and_stops_shadows(owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud", url="http://127.0.0.1:9")
    running = _shadow(owner, fake.peer, Agent.Status.RUNNING)
    row = _queued_outbox(owner, fake.peer, running)
    peer_unlink(user=owner, peer_id=fake.peer.pk)
    peer = Peer.objects.get()
    assert peer.revoked_at is not None and peer.unlinked_by_peer is False
    row.refresh_from_db()
    assert (row.status, row.last_error) == (OutboxMessage.Status.DEAD, "peer revoked")
    assert AgentMessage.objects.get().status == AgentMessage.Status.DEAD
    running.refresh_from_db()
    assert running.status == Agent.Status.STOPPED
    assert AgentEvent.objects.filter(agent=running, type=AgentEvent.Type.SYSTEM, message__contains="Cloud").exists()


def test_unlinked_by_the_peer_has_the_same_effects_and_is_shown_as_such(owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud")
    running = _shadow(owner, fake.peer, Agent.Status.RUNNING)
    row = _queued_outbox(owner, fake.peer, running)
    peer_mark_unlinked_by_peer(peer=fake.peer)
    peer = Peer.objects.get()
    assert peer.revoked_at is not None and peer.unlinked_by_peer is True
    row.refresh_from_db()
    running.refresh_from_db()
    assert (row.status, running.status) == (OutboxMessage.Status.DEAD, Agent.Status.STOPPED)
    # Idempotent: a second notice changes nothing.
    revoked_at = peer.revoked_at
    assert peer_mark_unlinked_by_peer(peer=peer).revoked_at == revoked_at
