"""Pairing (docs/peers.md#pairing, docs/peers.md#claim): offers, the open claim route and its checks in order."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from core import secrets_at_rest
from core.errors import DispatchError
from core.services import generate_token, token_digest
from peers.models import PairingOffer, Peer
from peers.pairing_exchange import BAD_CODE
from peers.services.identity import identity_get
from peers.services.pairing import CODE_ALPHABET, offer_create
from tests.peers.conftest import new_key_pair

# The claim route is an async view: its queries run on another thread, so the database is real.
pytestmark = pytest.mark.django_db(transaction=True)

CLAIM = "/api/v1/peers/claim"


def claim_body(code: str, **overrides: Any) -> dict[str, Any]:
    """A claim as instance A's server sends it, from a fresh instance unless overridden."""
    _, public = new_key_pair()
    body = {
        "code": code,
        "protocol_version": 2,
        "instance_id": "inst_" + secrets.token_hex(6),
        "name": "laptop",
        "url": "http://127.0.0.1:9",
        "public_key": public,
        "token_for_you": generate_token(),
    }
    body.update(overrides)
    return body


def claim(client: Client, body: dict[str, Any], address: str = "10.0.0.1") -> Any:
    return client.post(CLAIM, body, content_type="application/json", REMOTE_ADDR=address)


@pytest.fixture
def client() -> Client:
    return Client()


def test_an_offer_has_an_eight_letter_code_stored_hashed_for_ten_minutes(owner: Any) -> None:
    issued = offer_create(user=owner)
    letters = issued.code.replace("-", "")
    assert len(issued.code) == 9 and issued.code[4] == "-"
    assert len(letters) == 8 and set(letters) <= set(CODE_ALPHABET)
    offer = PairingOffer.objects.get()
    assert offer.code_digest == hashlib.sha256(letters.encode()).hexdigest()
    assert letters not in offer.code_digest
    assert timedelta(minutes=9, seconds=59) < offer.expires_at - offer.created_at <= timedelta(minutes=10)
    assert issued.fingerprint == identity_get().fingerprint
    assert (offer.allow_launch, offer.allow_message, offer.allow_full_access, offer.allow_events) == (
        True,
        True,
        False,
        True,
    )


def test_a_sixth_live_offer_is_refused_with_409(owner: Any) -> None:
    for _ in range(5):
        offer_create(user=owner)
    with pytest.raises(DispatchError) as refused:
        offer_create(user=owner)
    assert refused.value.http_status == 409
    assert "at most 5" in refused.value.message
    # An expired offer no longer counts.
    PairingOffer.objects.filter(pk=PairingOffer.objects.first().pk).update(expires_at=timezone.now())  # type: ignore[union-attr]
    offer_create(user=owner)


def test_only_staff_can_make_an_offer(member: Any) -> None:
    with pytest.raises(DispatchError) as refused:
        offer_create(user=member)
    assert refused.value.http_status == 403


def test_a_claim_links_the_claimant_with_the_offers_user_and_capabilities(
    client: Client, owner: Any, member: Any
) -> None:
    issued = offer_create(user=owner, link_user=member, allow_launch=False, allow_full_access=True)
    body = claim_body(issued.code)
    response = claim(client, body)
    assert response.status_code == 200, response.content
    answer = response.json()
    identity = identity_get()
    assert {k: answer[k] for k in ("protocol_version", "instance_id", "name", "url", "public_key")} == {
        "protocol_version": 2,
        "instance_id": identity.instance_id,
        "name": identity.name,
        "url": identity.url,
        "public_key": identity.public_key,
    }
    peer = Peer.objects.get(instance_id=body["instance_id"])
    assert peer.owner == member
    assert peer.label == "laptop" and peer.reported_name == "laptop"
    assert peer.public_key == body["public_key"]
    # The token we issued is stored only as its hash; the token A issued us, encrypted.
    assert peer.inbound_digest == token_digest(answer["token_for_you"])
    assert secrets_at_rest.decrypt(peer.outbound_token_encrypted).decode() == body["token_for_you"]
    assert body["token_for_you"] not in peer.outbound_token_encrypted
    assert (peer.allow_launch, peer.allow_message, peer.allow_full_access, peer.allow_events) == (
        False,
        True,
        True,
        True,
    )
    assert PairingOffer.objects.get().used_at is not None


def test_a_code_is_accepted_in_lower_case_and_without_the_dash(client: Client, owner: Any) -> None:
    issued = offer_create(user=owner)
    response = claim(client, claim_body(issued.code.replace("-", "").lower()))
    assert response.status_code == 200, response.content


def test_a_code_works_once_and_a_replay_is_401(client: Client, owner: Any) -> None:
    issued = offer_create(user=owner)
    body = claim_body(issued.code)
    assert claim(client, body).status_code == 200
    replay = claim(client, claim_body(issued.code))
    assert replay.status_code == 401
    assert replay.json()["error"] == {"code": "AUTHENTICATION_FAILED", "message": BAD_CODE, "details": {}}
    assert Peer.objects.count() == 1


def test_unknown_and_expired_codes_get_the_same_401(client: Client, owner: Any) -> None:
    issued = offer_create(user=owner)
    PairingOffer.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    expired = claim(client, claim_body(issued.code))
    unknown = claim(client, claim_body("BBBB-BBBB" if issued.code != "BBBB-BBBB" else "CCCC-CCCC"))
    malformed = claim(client, claim_body("not a code"))
    assert expired.status_code == unknown.status_code == malformed.status_code == 401
    assert expired.json() == unknown.json() == malformed.json()
    assert Peer.objects.count() == 0


def test_the_sixth_claim_in_a_minute_from_one_address_is_429(client: Client, owner: Any) -> None:
    issued = offer_create(user=owner)
    for _ in range(4):  # (a fifth wrong code would burn the offer)
        assert claim(client, claim_body("BBBB-BBBB"), address="10.0.0.7").status_code == 401
    assert claim(client, claim_body(issued.code, protocol_version=1), address="10.0.0.7").status_code == 400
    limited = claim(client, claim_body(issued.code), address="10.0.0.7")
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "RATE_LIMITED"
    # The limit comes first: the good code was not even looked at, and still works elsewhere.
    assert PairingOffer.objects.get().used_at is None
    assert claim(client, claim_body(issued.code), address="10.0.0.8").status_code == 200


def test_five_wrong_codes_in_ten_minutes_burn_every_live_offer(client: Client, owner: Any) -> None:
    first, second = offer_create(user=owner), offer_create(user=owner)
    for n in range(4):
        assert claim(client, claim_body("BBBB-BBBB"), address=f"10.1.0.{n}").status_code == 401
    assert PairingOffer.objects.filter(burned_at__isnull=False).count() == 0
    assert claim(client, claim_body("BBBB-BBBB"), address="10.1.0.9").status_code == 401
    assert PairingOffer.objects.filter(burned_at__isnull=False).count() == 2
    for issued in (first, second):
        assert claim(client, claim_body(issued.code), address="10.2.0.1").status_code == 401
    assert Peer.objects.count() == 0


def test_a_protocol_mismatch_is_400_naming_both_versions(client: Client, owner: Any) -> None:
    issued = offer_create(user=owner)
    response = claim(client, claim_body(issued.code, protocol_version=1))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "peer speaks protocol 1, this instance speaks 2"
    # Checked before the code: the offer is still usable.
    assert PairingOffer.objects.get().used_at is None


ABSENT = object()
BAD_CLAIMS: list[tuple[dict[str, Any], str]] = [  # (fields changed, or ABSENT; the 400's message)
    ({"protocol_version": ABSENT}, "protocol_version must be an integer (this instance speaks 2)"),
    ({"protocol_version": 1, "instance_id": "x"}, "peer speaks protocol 1, this instance speaks 2"),
    ({"instance_id": ABSENT}, "instance_id is required"),
    ({"instance_id": "inst_0123456789AB"}, "instance_id must be 'inst_' and 12 lowercase hex digits"),
    ({"name": None}, "name must be a string"),
    ({"name": "n" * 101}, "name must be at most 100 characters"),
    ({"url": "ftp://example.org"}, "url must start with http:// or https://"),
    ({"url": ABSENT}, "url is required"),
    ({"url": None}, "url must be a string"),
    ({"public_key": "abc"}, "public_key must be a raw Ed25519 public key in base64url"),
    ({"token_for_you": " "}, "token_for_you must be a non-empty string"),
    # Two faults: the first one in the claim's order (docs/peers.md#claim) is named.
    ({"name": 7, "url": 5, "token_for_you": ""}, "name must be a string"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_CLAIMS, ids=range(len(BAD_CLAIMS)))
def test_a_malformed_claim_is_400_with_the_models_sentence_before_its_code(
    client: Client, owner: Any, changes: dict[str, Any], message: str
) -> None:
    issued = offer_create(user=owner)
    body = {key: value for key, value in claim_body(issued.code, **changes).items() if value is not ABSENT}
    response = claim(client, body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message
    assert PairingOffer.objects.get().used_at is None


def test_a_protocol_refusal_names_the_version_this_instance_speaks(client: Client, owner: Any) -> None:
    issued = offer_create(user=owner)
    for version in (1, "2"):
        response = claim(client, claim_body(issued.code, protocol_version=version))
        assert response.json()["error"]["details"] == {"protocol_version": 2}


def test_malformed_claims_with_wrong_codes_are_not_counted_as_wrong_codes(client: Client, owner: Any) -> None:
    issued = offer_create(user=owner)
    for n in range(5):  # the body is refused before the code is looked at
        response = claim(client, claim_body("BBBB-BBBB", url="ftp://x"), address=f"10.3.0.{n}")
        assert response.status_code == 400
    assert PairingOffer.objects.get().burned_at is None
    assert claim(client, claim_body(issued.code), address="10.3.1.1").status_code == 200


def test_the_rate_limit_comes_before_the_body(client: Client, owner: Any) -> None:
    for _ in range(5):
        assert claim(client, {"protocol_version": 1}, address="10.4.0.1").status_code == 400
    limited = claim(client, {"protocol_version": 1}, address="10.4.0.1")
    assert limited.status_code == 429 and limited["Retry-After"] == "60"


def test_a_slot_takeover_is_409_and_leaves_the_existing_link_intact(client: Client, owner: Any, make_peer: Any) -> None:
    existing = make_peer(owner, label="Cloud")
    before = Peer.objects.values().get(pk=existing.peer.pk)
    issued = offer_create(user=owner)
    response = claim(client, claim_body(issued.code, instance_id=existing.instance_id))  # another key
    assert response.status_code == 409
    assert existing.instance_id in response.json()["error"]["message"]
    assert Peer.objects.values().get(pk=existing.peer.pk) == before
    assert Peer.objects.count() == 1
    assert PairingOffer.objects.get().used_at is None


def test_re_pairing_the_same_id_and_key_rotates_both_tokens_in_place(
    client: Client, owner: Any, make_peer: Any
) -> None:
    existing = make_peer(owner, label="Cloud", allow_launch=False)
    old_digest = existing.peer.inbound_digest
    issued = offer_create(user=owner)
    body = claim_body(issued.code, instance_id=existing.instance_id, public_key=existing.public_key, name="cloud2")
    response = claim(client, body)
    assert response.status_code == 200, response.content
    peer = Peer.objects.get()
    assert peer.pk == existing.peer.pk
    assert peer.inbound_digest == token_digest(response.json()["token_for_you"])
    assert peer.inbound_digest != old_digest
    assert not Peer.objects.filter(inbound_digest=old_digest).exists()
    assert secrets_at_rest.decrypt(peer.outbound_token_encrypted).decode() == body["token_for_you"]
    assert peer.label == "Cloud" and peer.reported_name == "cloud2"
    assert peer.allow_launch is True  # the new offer's capabilities


def test_an_instance_cannot_claim_itself(client: Client, owner: Any) -> None:
    issued = offer_create(user=owner)
    identity = identity_get()
    response = claim(client, claim_body(issued.code, instance_id=identity.instance_id, public_key=identity.public_key))
    assert response.status_code == 400
    assert PairingOffer.objects.get().used_at is None


def test_re_pairing_for_another_user_is_refused_and_the_link_stays_with_its_user(
    client: Client, owner: Any, member: Any, make_peer: Any
) -> None:
    existing = make_peer(owner, label="Cloud")
    old_digest = existing.peer.inbound_digest
    member.is_staff = True
    member.save()
    issued = offer_create(user=member)  # the new offer acts for member
    body = claim_body(issued.code, instance_id=existing.instance_id, public_key=existing.public_key)
    response = claim(client, body)
    assert response.status_code == 409
    assert "already linked here for another user" in response.json()["error"]["message"]
    peer = Peer.objects.get()
    assert (peer.owner, peer.inbound_digest) == (owner, old_digest)
    assert PairingOffer.objects.get().used_at is None  # the code stays usable


@pytest.mark.django_db(transaction=True)
async def test_linking_an_address_another_user_has_linked_is_refused_before_any_claim(
    owner: Any, member: Any, make_peer: Any
) -> None:
    from channels.db import database_sync_to_async

    from peers.pairing_exchange import peer_link

    await database_sync_to_async(make_peer)(owner, label="Cloud", url="http://127.0.0.1:9")
    member.is_staff = True
    await database_sync_to_async(member.save)()
    with pytest.raises(DispatchError) as refused:  # port 9 would be unreachable: no request is made
        await peer_link(user=member, url="http://127.0.0.1:9/", code="BCDF-GHJK", label="Mine")
    assert refused.value.code == "CONFLICT" and "already linked here for another user" in refused.value.message


@pytest.mark.parametrize("version", ["2", 2.0, True, None])
def test_a_protocol_version_that_is_not_an_integer_is_named_as_such(client: Client, owner: Any, version: Any) -> None:
    issued = offer_create(user=owner)
    response = claim(client, claim_body(issued.code, protocol_version=version))
    assert response.status_code == 400
    assert "protocol_version must be an integer" in response.json()["error"]["message"]
    assert PairingOffer.objects.get().used_at is None


def _answering(monkeypatch: pytest.MonkeyPatch, answer: dict[str, Any]) -> None:
    """``peer_link``'s HTTP client reaches a fake B that answers every claim with ``answer``."""
    import functools

    import httpx

    from peers import pairing_exchange

    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    monkeypatch.setattr(
        pairing_exchange.httpx, "AsyncClient", functools.partial(httpx.AsyncClient, transport=transport)
    )


def _claim_answer(**overrides: Any) -> dict[str, Any]:
    _, public = new_key_pair()
    answer = {
        "protocol_version": 2,
        "instance_id": "inst_" + secrets.token_hex(6),
        "name": "cloud",
        "url": "http://127.0.0.1:9",
        "public_key": public,
        "token_for_you": generate_token(),
        "capabilities": {"allow_launch": True},
    }
    answer.update(overrides)
    return answer


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"protocol_version": 1}, "protocol 1"),
        ({"instance_id": "inst_nothex000000"}, "instance_id must be 'inst_' and 12 lowercase hex digits"),
        ({"public_key": "abc"}, "public_key must be a raw Ed25519 public key in base64url"),
        ({"token_for_you": None}, "token_for_you must be a string"),
    ],
)
async def test_a_claim_answer_that_is_not_one_is_refused_and_nothing_is_linked(
    owner: Any, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any], reason: str
) -> None:
    from channels.db import database_sync_to_async

    from peers.pairing_exchange import peer_link

    _answering(monkeypatch, _claim_answer(**overrides))
    with pytest.raises(DispatchError) as refused:
        await peer_link(user=owner, url="http://127.0.0.1:9", code="BCDF-GHJK")
    assert refused.value.code == "INVALID_RESPONSE"
    assert refused.value.message == f"http://127.0.0.1:9 gave an unusable pairing answer: {reason}"
    assert await database_sync_to_async(Peer.objects.count)() == 0


async def test_an_answer_from_ourselves_is_refused_and_one_without_name_or_capabilities_links(
    owner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from channels.db import database_sync_to_async

    from peers.pairing_exchange import peer_link

    ours = await database_sync_to_async(identity_get)()
    _answering(monkeypatch, _claim_answer(instance_id=ours.instance_id))
    with pytest.raises(DispatchError) as refused:
        await peer_link(user=owner, url="http://127.0.0.1:9", code="BCDF-GHJK")
    assert refused.value.message.endswith("an instance cannot be linked to itself")

    answer = {key: value for key, value in _claim_answer().items() if key not in ("name", "capabilities")}
    _answering(monkeypatch, answer)
    linked = await peer_link(user=owner, url="http://127.0.0.1:9/", code="BCDF-GHJK", label="Cloud")
    peer = linked.peer
    assert (peer.instance_id, peer.reported_name, peer.granted_by_peer) == (answer["instance_id"], "", {})
    assert peer.url == "http://127.0.0.1:9"
