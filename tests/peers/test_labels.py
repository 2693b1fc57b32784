"""Labels and locations (docs/peers.md#labels): what this instance calls a peer."""

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


# --- two instances with the same name (both default to the host name) --------------------------


def _name_this_instance(owner: Any, name: str) -> None:
    from peers.services.identity import instance_rename

    instance_rename(user=owner, name=name)


def _claim(code: str, *, instance_id: str, name: str, url: str) -> Any:
    _, public = new_key_pair()
    body = {
        "code": code,
        "protocol_version": 2,
        "instance_id": instance_id,
        "name": name,
        "url": url,
        "public_key": public,
        "token_for_you": generate_token(),
    }
    return Client().post("/api/v1/peers/claim", body, content_type="application/json")


@pytest.mark.django_db(transaction=True)
def test_a_claimant_with_this_instances_own_name_is_labelled_by_its_address(owner: Any) -> None:
    _name_this_instance(owner, "devbox")
    response = _claim(
        offer_create(user=owner).code, instance_id="inst_00000000abc1", name="DevBox", url="http://127.0.0.1:8001"
    )
    assert response.status_code == 200, response.content
    peer = Peer.objects.get()
    assert (peer.label, peer.reported_name) == ("DevBox at 127.0.0.1 port 8001", "DevBox")


@pytest.mark.django_db(transaction=True)
def test_a_claimant_with_another_name_keeps_its_name_as_label(owner: Any) -> None:
    _name_this_instance(owner, "devbox")
    response = _claim(
        offer_create(user=owner).code, instance_id="inst_00000000abc2", name="cloud", url="http://127.0.0.1:8001"
    )
    assert response.status_code == 200, response.content
    assert Peer.objects.get().label == "cloud"


def _store(
    owner: Any,
    *,
    name: str,
    url: str,
    label: str | None = None,
    instance_id: str = "inst_00000000abc3",
    public_key: str | None = None,
) -> Peer:
    from peers.services.links import DEFAULT_CAPABILITIES
    from peers.services.pairing import peer_link_store

    public = public_key or new_key_pair()[1]
    return peer_link_store(
        owner=owner,
        inbound=generate_token(),
        instance_id=instance_id,
        name=name,
        url=url,
        public_key=public,
        token_for_you=generate_token(),
        granted_by_peer={},
        label=label,
        flags=dict(DEFAULT_CAPABILITIES),
    )


@pytest.mark.django_db(transaction=True)
def test_the_linking_side_labels_a_peer_with_its_own_name_by_the_peers_address(owner: Any) -> None:
    _name_this_instance(owner, "devbox")
    assert _store(owner, name="devbox", url="https://cloud.example.org").label == "devbox at cloud.example.org"


@pytest.mark.django_db(transaction=True)
def test_a_typed_label_that_is_this_instances_name_is_made_distinct_too(owner: Any) -> None:
    _name_this_instance(owner, "devbox")
    assert (
        _store(owner, name="other", url="http://10.0.0.5:8000", label="DEVBOX").label == "DEVBOX at 10.0.0.5 port 8000"
    )


@pytest.mark.django_db(transaction=True)
def test_a_distinct_label_that_is_taken_gets_a_suffix(owner: Any, make_peer: Any) -> None:
    _name_this_instance(owner, "devbox")
    make_peer(owner, label="devbox at 127.0.0.1 port 8001")
    assert _store(owner, name="devbox", url="http://127.0.0.1:8001").label == "devbox at 127.0.0.1 port 8001-2"


@pytest.mark.django_db(transaction=True)
def test_a_long_name_and_address_still_make_a_valid_label(owner: Any) -> None:
    name = "x" * 100
    _name_this_instance(owner, name)
    label = _store(owner, name=name, url=f"http://{'h' * 80}.example.org:8001").label
    assert label_validate(label) == label and len(label) <= 64
    assert label.startswith("xxxxxxxx at hhhh")


@pytest.mark.django_db(transaction=True)
def test_re_pairing_a_link_labelled_with_this_instances_own_name_relabels_it(owner: Any, make_peer: Any) -> None:
    _name_this_instance(owner, "devbox")
    fake = make_peer(owner, label="devbox", url="http://127.0.0.1:8001")
    peer = _store(
        owner, name="devbox", url="http://127.0.0.1:8001", instance_id=fake.instance_id, public_key=fake.public_key
    )
    assert Peer.objects.get(pk=fake.peer.pk).label == peer.label == "devbox at 127.0.0.1 port 8001"


def test_renaming_a_peer_to_this_instances_own_name_is_409(owner: Any, make_peer: Any) -> None:
    _name_this_instance(owner, "devbox")
    fake = make_peer(owner, label="Cloud")
    with pytest.raises(DispatchError) as refused:
        peer_rename(user=owner, peer_id=fake.peer.pk, label="DevBox")
    assert refused.value.http_status == 409
    assert refused.value.message == "'DevBox' is this instance's own name; give the linked instance a label of its own"
    assert Peer.objects.get(pk=fake.peer.pk).label == "Cloud"


def test_naming_this_instance_like_a_linked_one_is_409(owner: Any, make_peer: Any) -> None:
    from peers.services.identity import identity_get

    make_peer(owner, label="Cloud")
    with pytest.raises(DispatchError) as refused:
        _name_this_instance(owner, "cloud")
    assert refused.value.http_status == 409
    assert "a linked instance is called 'cloud' here" in refused.value.message
    assert identity_get().name != "cloud"
