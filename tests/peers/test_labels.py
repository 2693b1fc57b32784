"""Labels and locations (spec/peers.md §6): what this instance calls a peer."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from core.errors import DispatchError
from core.services import generate_token
from peers.models import Peer
from peers.selectors import peer_resolve_location
from peers.services.links import label_validate, peer_rename
from peers.services.pairing import offer_create
from tests.peers.conftest import new_key_pair


@pytest.mark.parametrize("label", ["Cloud", "my box 2", "a.b_c-d", "x" * 64, "Über"])
def test_a_label_is_letters_digits_spaces_and_dot_underscore_dash(label: str) -> None:
    assert label_validate(f"  {label} ") == label


@pytest.mark.parametrize("label", ["", "   ", "x" * 65, "cloud:1", "a/b", "tab\there", None, 7])
def test_a_label_with_a_colon_or_other_characters_is_refused(label: Any) -> None:
    with pytest.raises(DispatchError) as refused:
        label_validate(label)
    assert refused.value.http_status == 400


@pytest.mark.django_db(transaction=True)
def test_a_label_collision_at_link_time_gets_a_suffix(owner: Any, make_peer: Any) -> None:
    make_peer(owner, label="Cloud")
    make_peer(owner, label="cloud-2")
    issued = offer_create(user=owner)
    _, public = new_key_pair()
    body = {
        "code": issued.code,
        "protocol_version": 2,
        "instance_id": "inst_00000000abcd",
        "name": "cloud",
        "url": "http://127.0.0.1:9",
        "public_key": public,
        "token_for_you": generate_token(),
    }
    response = Client().post("/api/v1/peers/claim", body, content_type="application/json")
    assert response.status_code == 200, response.content
    assert Peer.objects.get(instance_id="inst_00000000abcd").label == "cloud-3"


@pytest.mark.django_db(transaction=True)
def test_a_reported_name_with_bad_characters_becomes_a_valid_label(owner: Any) -> None:
    issued = offer_create(user=owner)
    _, public = new_key_pair()
    body = {
        "code": issued.code,
        "protocol_version": 2,
        "instance_id": "inst_00000000abce",
        "name": "box:one/two",
        "url": "http://127.0.0.1:9",
        "public_key": public,
        "token_for_you": generate_token(),
    }
    assert Client().post("/api/v1/peers/claim", body, content_type="application/json").status_code == 200
    assert Peer.objects.get().label == "box-one-two"


def test_renaming_to_a_taken_label_is_409_ignoring_case(owner: Any, make_peer: Any) -> None:
    make_peer(owner, label="Cloud")
    other = make_peer(owner, label="Laptop")
    with pytest.raises(DispatchError) as refused:
        peer_rename(user=owner, peer_id=other.peer.pk, label="CLOUD")
    assert refused.value.http_status == 409
    assert refused.value.message == "the label 'CLOUD' is already used by another linked instance (labels ignore case)"
    other.peer.refresh_from_db()
    assert other.peer.label == "Laptop"


def test_a_revoked_peers_label_is_free_again(owner: Any, make_peer: Any) -> None:
    from django.utils import timezone

    make_peer(owner, label="Cloud", revoked_at=timezone.now())
    other = make_peer(owner, label="Laptop")
    assert peer_rename(user=owner, peer_id=other.peer.pk, label="cloud").label == "cloud"


def test_a_local_rename_leaves_the_reported_name_alone(owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud", reported_name="gpu-box")
    renamed = peer_rename(user=owner, peer_id=fake.peer.pk, label="Big GPU")
    fresh = Peer.objects.get(pk=fake.peer.pk)
    assert (renamed.label, fresh.label, fresh.reported_name) == ("Big GPU", "Big GPU", "gpu-box")


def test_renaming_to_its_own_label_in_another_case_is_allowed(owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud")
    assert peer_rename(user=owner, peer_id=fake.peer.pk, label="CLOUD").label == "CLOUD"


def test_another_users_peer_cannot_be_renamed(owner: Any, member: Any, make_peer: Any) -> None:
    fake = make_peer(member, label="Cloud")
    with pytest.raises(DispatchError) as refused:
        peer_rename(user=owner, peer_id=fake.peer.pk, label="Mine")
    assert refused.value.http_status == 404


def test_a_location_is_a_label_or_an_instance_id_ignoring_case(owner: Any, make_peer: Any) -> None:
    fake = make_peer(owner, label="Cloud")
    assert peer_resolve_location(user=owner, location="cLOUD") == fake.peer
    assert peer_resolve_location(user=owner, location=fake.instance_id.upper()) == fake.peer


def test_an_unknown_location_is_404_listing_the_users_labels(owner: Any, member: Any, make_peer: Any) -> None:
    make_peer(owner, label="Cloud")
    make_peer(owner, label="Laptop")
    theirs = make_peer(member, label="Secret")
    with pytest.raises(DispatchError) as refused:
        peer_resolve_location(user=owner, location="Secret")
    assert refused.value.http_status == 404
    assert refused.value.message == "no linked instance 'Secret'; your linked instances: Cloud, Laptop"
    with pytest.raises(DispatchError):
        peer_resolve_location(user=owner, location=theirs.instance_id)


def test_an_ambiguous_location_lists_the_matches(owner: Any, make_peer: Any) -> None:
    first = make_peer(owner, label="Cloud")
    second = make_peer(owner, label=first.instance_id.upper())
    with pytest.raises(DispatchError) as refused:
        peer_resolve_location(user=owner, location=first.instance_id)
    assert refused.value.http_status == 400
    assert "ambiguous" in refused.value.message
    assert {match["label"] for match in refused.value.details["matches"]} == {"Cloud", second.peer.label}
