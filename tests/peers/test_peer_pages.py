"""The Linked instances page /peers/ (docs/peers.md#pairing, docs/peers.md#permissions)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agents.models import Agent, AgentMessage
from peers.models import OutboxMessage, PairingOffer, Peer
from peers.services.identity import identity_get
from tests.infra import instance

pytestmark = pytest.mark.django_db(transaction=True)  # the link view is async


def logged_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_staff_see_the_four_cards_with_this_instances_identity(owner: Any) -> None:
    page = logged_in(owner).get("/peers/")
    assert page.status_code == 200
    html = page.content.decode()
    identity = identity_get()
    for heading in ("This instance", "Accept a connection", "Connect to another instance", "Linked"):
        assert f">{heading}</h2>" in html
    assert identity.instance_id in html and identity.fingerprint in html and identity.url in html
    assert "Show pairing code" in html and "Call it…" in html and "Act as" in html


def test_other_users_see_no_pairing_cards_and_only_their_own_links(member: Any, owner: Any, make_peer: Any) -> None:
    make_peer(member, label="BobsBox")
    make_peer(owner, label="AlicesBox")
    html = logged_in(member).get("/peers/").content.decode()
    assert "Accept a connection" not in html and "Connect to another instance" not in html
    assert "BobsBox" in html and "AlicesBox" not in html


def test_show_pairing_code_shows_the_code_the_address_the_fingerprint_and_a_countdown(owner: Any) -> None:
    page = logged_in(owner).post("/peers/offer", {"allow_launch": "on", "allow_events": "on"})
    assert page.status_code == 200
    html = page.content.decode()
    code = re.search(r'id="pairing-code"[^>]*>([A-Z]{4}-[A-Z]{4})<', html)
    assert code, html
    assert "monospace" in html
    assert identity_get().fingerprint in html and 'id="offer-countdown"' in html
    made = PairingOffer.objects.get()
    # Unchecked switches are off: message was not ticked.
    assert (made.allow_launch, made.allow_message, made.allow_full_access, made.allow_events) == (
        True,
        False,
        False,
        True,
    )


def test_non_staff_cannot_make_an_offer(member: Any) -> None:
    page = logged_in(member).post("/peers/offer", {})
    assert page.status_code == 403
    assert PairingOffer.objects.count() == 0


def test_a_peer_shows_its_names_badges_last_seen_and_outbox(owner: Any, make_peer: Any) -> None:
    fake = make_peer(
        owner,
        label="Cloud",
        reported_name="gpu-box",
        last_seen_at=timezone.now() - timedelta(minutes=6),
        granted_by_peer={"allow_launch": True, "allow_message": False},
    )
    shadow = Agent.objects.create(owner=owner, name="r", type="shell", cwd="/", peer=fake.peer, peer_agent_id="x")
    message = AgentMessage.objects.create(recipient_agent=shadow, sender_user=owner, content="hi", peer=fake.peer)
    row = OutboxMessage.objects.create(
        peer=fake.peer, message=message, to_agent_id="x", payload={}, status=OutboxMessage.Status.DEAD
    )
    html = logged_in(owner).get("/peers/").content.decode()
    assert "calls itself gpu-box" in html
    assert "not responding recently" in html
    assert "Outbox: 0 queued, 1 dead" in html
    assert f"/peers/outbox/{row.pk}/retry" in html and f"/peers/outbox/{row.pk}/discard" in html


def test_a_recently_seen_peer_is_not_flagged(owner: Any, make_peer: Any) -> None:
    make_peer(owner, label="Cloud", last_seen_at=timezone.now() - timedelta(minutes=1))
    assert "not responding recently" not in logged_in(owner).get("/peers/").content.decode()


def test_renaming_to_a_taken_label_shows_the_servers_409_message(owner: Any, make_peer: Any) -> None:
    make_peer(owner, label="Cloud")
    other = make_peer(owner, label="Laptop")
    page = logged_in(owner).post(f"/peers/{other.peer.pk}/rename", {"label": "cloud"})
    assert page.status_code == 409
    assert "the label &#x27;cloud&#x27; is already used by another linked instance" in page.content.decode()
    assert Peer.objects.get(pk=other.peer.pk).label == "Laptop"
    assert logged_in(owner).post(f"/peers/{other.peer.pk}/rename", {"label": "Travel"}).status_code == 302
    assert Peer.objects.get(pk=other.peer.pk).label == "Travel"


def test_unlink_revokes_the_link(owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud")
    assert logged_in(owner).post(f"/peers/{fake.peer.pk}/unlink").status_code == 302
    assert Peer.objects.get().revoked_at is not None
    assert "No linked instances yet" in logged_in(owner).get("/peers/").content.decode()


def test_a_malformed_code_is_refused_on_the_page_without_calling_anyone(owner: Any) -> None:
    page = logged_in(owner).post("/peers/link", {"url": "http://127.0.0.1:9", "code": "nope"})
    assert page.status_code == 400
    assert "a pairing code is 8 letters" in page.content.decode()
    assert Peer.objects.count() == 0


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_linking_through_the_page_to_a_real_instance_shows_both_fingerprints(owner: Any) -> None:
    with instance() as b:
        server = b.serve()
        printed = b.manage("peer_offer", "--no-launch").stdout
        code = re.search(r"^code: (\S+)$", printed, re.MULTILINE).group(1)  # type: ignore[union-attr]
        b_fingerprint = re.search(r"^fingerprint: (.+)$", printed, re.MULTILINE).group(1)  # type: ignore[union-attr]
        page = logged_in(owner).post(
            "/peers/link",
            {"url": server.url, "code": code, "label": "Bee", "allow_launch": "on", "allow_message": "on"},
        )
        assert page.status_code == 200, page.content.decode()[-2000:]
        html = page.content.decode()
        assert b_fingerprint in html and identity_get().fingerprint in html
        peer = Peer.objects.get()
        assert (peer.label, peer.fingerprint, peer.owner) == ("Bee", b_fingerprint, owner)
        assert (peer.allow_launch, peer.allow_events) == (True, False)
        assert peer.granted_by_peer["allow_launch"] is False
        there = server.get("/api/v1/peers", b.admin_token).json()["peers"]
        assert [p["fingerprint"] for p in there] == [identity_get().fingerprint]


def test_staff_rename_this_instance_and_others_cannot(owner: Any, member: Any) -> None:
    assert logged_in(owner).post("/peers/name", {"name": "Studio Mac"}).status_code == 302
    assert identity_get().name == "Studio Mac"
    logged_in(member).post("/peers/name", {"name": "Hijacked"})
    assert identity_get().name == "Studio Mac"
    assert 'value="Studio Mac"' in logged_in(owner).get("/peers/").content.decode()


def test_the_outbox_buttons_discard_and_retry_a_row(owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud")
    shadow = Agent.objects.create(owner=owner, name="r", type="shell", cwd="/", peer=fake.peer, peer_agent_id="x")
    message = AgentMessage.objects.create(recipient_agent=shadow, sender_user=owner, content="hi", peer=fake.peer)
    row = OutboxMessage.objects.create(peer=fake.peer, message=message, to_agent_id="x", payload={})
    client = logged_in(owner)
    assert client.post(f"/peers/outbox/{row.pk}/discard").status_code == 302
    row.refresh_from_db()
    assert row.status == OutboxMessage.Status.DISCARDED
    client.post(f"/peers/outbox/{row.pk}/retry")
    row.refresh_from_db()
    assert row.status == OutboxMessage.Status.QUEUED


def test_linking_an_instance_with_this_instances_name_proposes_a_label_naming_its_address(
    owner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both instances default to the host name; the page must not call the other
    one by this instance's own name."""
    import httpx

    from tests.peers.conftest import new_key_pair

    assert logged_in(owner).post("/peers/name", {"name": "devbox"}).status_code == 302
    _, public = new_key_pair()
    answer = {
        "protocol_version": 2,
        "instance_id": "inst_0000000000b2",
        "name": "devbox",
        "url": "http://127.0.0.1:8001",
        "public_key": public,
        "token_for_you": "t" * 40,
        "capabilities": {"allow_launch": True},
    }
    claims: list[httpx.Request] = []

    def other_instance(request: httpx.Request) -> httpx.Response:
        claims.append(request)
        return httpx.Response(200, json=answer)

    real_client = httpx.AsyncClient
    monkeypatch.setattr(
        httpx, "AsyncClient", lambda **kwargs: real_client(transport=httpx.MockTransport(other_instance), **kwargs)
    )
    page = logged_in(owner).post("/peers/link", {"url": "http://127.0.0.1:8001", "code": "BCDF-GHJK"})
    assert page.status_code == 200, page.content.decode()[-2000:]
    assert [str(claim.url) for claim in claims] == ["http://127.0.0.1:8001/api/v1/peers/claim"]
    html = page.content.decode()
    assert "Linked to <strong>devbox at 127.0.0.1 port 8001</strong>" in html
    assert 'id="link-same-name"' in html and "the same name as this instance" in html
    assert Peer.objects.get().label == "devbox at 127.0.0.1 port 8001"
    listed = logged_in(owner).get("/peers/").content.decode()
    assert 'data-label="devbox at 127.0.0.1 port 8001"' in listed
    assert "calls itself devbox (the same name as this instance)" in listed
