"""Admin for linked instances: actions and edits through services, pairing."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from agents.models import Agent, AgentMessage
from core import secrets_at_rest
from peers.models import OutboxMessage, PairingOffer, Peer


@pytest.fixture
def admin_client(db: None) -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", password="x"))
    return client


def test_the_peer_list_shows_prefixes_never_the_encrypted_token(
    admin_client: Client, owner: Any, make_peer: Any
) -> None:
    fake = make_peer(owner, label="Cloud")
    listing = admin_client.get("/admin/peers/peer/")
    assert listing.status_code == 200 and "Cloud" in listing.content.decode()
    change = admin_client.get(f"/admin/peers/peer/{fake.peer.pk}/change/").content.decode()
    assert fake.peer.inbound_prefix in change
    assert fake.peer.outbound_token_encrypted not in change and fake.outbound_token not in change
    assert admin_client.get("/admin/peers/peer/?live=yes&q=cloud").status_code == 200


def test_editing_a_peer_goes_through_the_label_rules(admin_client: Client, owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud")
    form = {"label": "Big box", "allow_launch": "on", "allow_full_access": "on"}
    assert admin_client.post(f"/admin/peers/peer/{fake.peer.pk}/change/", form).status_code == 302
    peer = Peer.objects.get()
    assert (peer.label, peer.allow_launch, peer.allow_message, peer.allow_full_access) == ("Big box", True, False, True)
    refused = admin_client.post(f"/admin/peers/peer/{fake.peer.pk}/change/", {"label": "a:b"})
    assert refused.status_code == 200 and "no colon" in refused.content.decode()
    assert Peer.objects.get().label == "Big box"


def test_the_revoke_action_unlinks(admin_client: Client, owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud")
    response = admin_client.post(
        "/admin/peers/peer/", {"action": "revoke", "_selected_action": [fake.peer.pk]}, follow=True
    )
    assert "Revoked 1 peer(s)." in response.content.decode()
    peer = Peer.objects.get()
    assert peer.revoked_at is not None and peer.revoked_reason.startswith("revoked by root")


def test_the_rotate_action_re_encrypts_the_token_it_presents(admin_client: Client, owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud")
    before = fake.peer.outbound_token_encrypted
    admin_client.post("/admin/peers/peer/", {"action": "rotate_credentials", "_selected_action": [fake.peer.pk]})
    after = Peer.objects.get().outbound_token_encrypted
    assert after != before
    assert secrets_at_rest.decrypt(after).decode() == fake.outbound_token


def test_the_pairing_page_makes_an_offer_and_shows_its_code(admin_client: Client, member: Any) -> None:
    assert 'href="/admin/peers/peer/pairing/"' in admin_client.get("/admin/peers/peer/").content.decode()
    page = admin_client.get("/admin/peers/peer/pairing/")
    assert page.status_code == 200 and 'action="/peers/link"' in page.content.decode()
    made = admin_client.post("/admin/peers/peer/pairing/", {"as_user": "bob", "allow_launch": "on"})
    assert re.search(r'id="pairing-code"[^>]*>[A-Z]{4}-[A-Z]{4}<', made.content.decode())
    offer = PairingOffer.objects.get()
    assert offer.link_user == member and (offer.allow_launch, offer.allow_message) == (True, False)


@pytest.mark.django_db(transaction=True)
def test_the_admin_link_form_comes_back_to_the_admin_with_the_error(admin_client: Client) -> None:
    response = admin_client.post(
        "/peers/link", {"url": "http://127.0.0.1:9", "code": "BBBB-BBBB", "next": "/admin/peers/peer/"}, follow=True
    )
    assert response.redirect_chain[-1][0] == "/admin/peers/peer/"
    assert "Link failed: could not reach http://127.0.0.1:9" in response.content.decode()


def test_outbox_rows_can_be_discarded_and_retried_from_the_admin(
    admin_client: Client, owner: Any, make_peer: Any
) -> None:
    fake = make_peer(owner, label="Cloud")
    shadow = Agent.objects.create(owner=owner, name="r", type="shell", cwd="/", peer=fake.peer, peer_agent_id="x")
    message = AgentMessage.objects.create(recipient_agent=shadow, sender_user=owner, content="hi", peer=fake.peer)
    row = OutboxMessage.objects.create(peer=fake.peer, message=message, to_agent_id="x", payload={})
    admin_client.post("/admin/peers/outboxmessage/", {"action": "discard", "_selected_action": [row.pk]})
    row.refresh_from_db()
    assert row.status == OutboxMessage.Status.DISCARDED
    admin_client.post("/admin/peers/outboxmessage/", {"action": "retry", "_selected_action": [row.pk]})
    row.refresh_from_db()
    assert row.status == OutboxMessage.Status.QUEUED


def test_offers_receipts_and_leases_are_listed_read_only(admin_client: Client) -> None:
    for model in ("pairingoffer", "peerreceipt", "peerlease", "outboxmessage"):
        assert admin_client.get(f"/admin/peers/{model}/").status_code == 200
        assert admin_client.get(f"/admin/peers/{model}/add/").status_code == 403
