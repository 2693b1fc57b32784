"""Peer authentication (docs/peers.md#authentication): bearer token + RFC 9421 signature, every refusal."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import AsyncClient, AsyncRequestFactory, Client, RequestFactory, override_settings
from django.urls import path as url_path
from django.utils import timezone
from http_message_signatures import HTTPMessageSigner, algorithms

from peers.auth import (
    SIGNATURE_LABEL,
    SIGNATURE_TAG,
    PeerAuthError,
    peer_authenticate,
    peer_authenticate_sync,
    peer_error_response,
)
from peers.models import Peer
from tests.peers.conftest import FakePeer, new_key_pair
from tests.peers.signing import apeer_get, apeer_post, json_body, peer_get, peer_post, signed_headers

MESSAGES = "/api/v1/peers/messages"
BODY = json_body({"to_agent_id": "a1", "content": "hello", "from": {"instance_id": "inst_x", "agent_id": None}})
KEY = "7b0c3f5e-8d1f-4a0e-9f51-3f2e1c7a9b10"


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def post_request(path: str, body: bytes, headers: dict[str, str]) -> HttpRequest:
    return RequestFactory().post(path, data=body, content_type="application/json", headers=headers)


def get_request(path: str, headers: dict[str, str]) -> HttpRequest:
    return RequestFactory().get(path, headers=headers)


def refusal(request: HttpRequest) -> PeerAuthError:
    with pytest.raises(PeerAuthError) as caught:
        peer_authenticate_sync(request)
    return caught.value


@pytest.fixture
def cloud(make_peer: Callable[..., FakePeer], owner: Any) -> FakePeer:
    return make_peer(owner, label="Cloud")


# --- accepted ---------------------------------------------------------------------------------


def test_it_accepts_a_signed_post_and_returns_the_peer_with_its_user(cloud: FakePeer, owner: Any) -> None:
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY)
    peer = peer_authenticate_sync(post_request(MESSAGES, BODY, headers))
    assert peer.pk == cloud.peer.pk
    assert peer.owner == owner
    assert headers["Content-Digest"] == "sha-256=:" + base64.b64encode(hashlib.sha256(BODY).digest()).decode() + ":"


def test_it_accepts_a_signed_get_with_a_query(cloud: FakePeer) -> None:
    path = "/api/v1/peers/repos?limit=5&x=a%20b"
    peer = peer_authenticate_sync(get_request(path, signed_headers(cloud, "GET", path)))
    assert peer.pk == cloud.peer.pk


def test_it_accepts_a_signature_created_four_minutes_ago_or_ahead(cloud: FakePeer) -> None:
    for offset in (-240, 240):
        created = now() + datetime.timedelta(seconds=offset)
        headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY, created=created)
        assert peer_authenticate_sync(post_request(MESSAGES, BODY, headers)).pk == cloud.peer.pk


@pytest.mark.django_db(transaction=True)
async def test_async_views_authenticate_the_same_way(make_peer: Callable[..., FakePeer]) -> None:
    from channels.db import database_sync_to_async
    from django.contrib.auth import get_user_model

    user = await database_sync_to_async(get_user_model().objects.create_user)("dora")
    fake = await database_sync_to_async(make_peer)(user, label="Async")
    headers = signed_headers(fake, "POST", MESSAGES, BODY, idempotency_key=KEY)
    request = AsyncRequestFactory().post(MESSAGES, data=BODY, content_type="application/json", headers=headers)
    peer = await peer_authenticate(request)
    assert peer.pk == fake.peer.pk and peer.owner.username == "dora"

    tampered = AsyncRequestFactory().post(MESSAGES, data=BODY + b" ", content_type="application/json", headers=headers)
    with pytest.raises(PeerAuthError) as caught:
        await peer_authenticate(tampered)
    assert caught.value.status == 401


def test_a_hand_built_rfc9421_signature_verifies(cloud: FakePeer) -> None:
    """Interoperability: a signature base written out by hand per RFC 9421 §2.5 is accepted."""
    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(BODY).digest()).decode() + ":"
    created = int(now().timestamp())
    params = (
        '("@method" "@path" "@query" "authorization" "content-digest" "idempotency-key")'
        f';created={created};keyid="{cloud.fingerprint}";tag="{SIGNATURE_TAG}"'
    )
    base = "\n".join(
        [
            '"@method": POST',
            f'"@path": {MESSAGES}',
            '"@query": ?',
            f'"authorization": Bearer {cloud.inbound_token}',
            f'"content-digest": {digest}',
            f'"idempotency-key": {KEY}',
            f'"@signature-params": {params}',
        ]
    )
    signature = base64.b64encode(cloud.private_key.sign(base.encode())).decode()
    headers = {
        "Authorization": f"Bearer {cloud.inbound_token}",
        "Idempotency-Key": KEY,
        "Content-Digest": digest,
        "Signature-Input": f"sig1={params}",
        "Signature": f"sig1=:{signature}:",
    }
    assert peer_authenticate_sync(post_request(MESSAGES, BODY, headers)).pk == cloud.peer.pk


# --- the token --------------------------------------------------------------------------------


def test_it_refuses_a_request_without_authorization_with_the_invalid_token_challenge(cloud: FakePeer) -> None:
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY, token="")
    assert "Authorization" not in headers
    error = refusal(post_request(MESSAGES, BODY, headers))
    assert error.status == 401
    response = peer_error_response(error)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer error="invalid_token"'
    assert json.loads(response.content)["error"]["code"] == error.code


def test_it_refuses_an_unknown_token(cloud: FakePeer) -> None:
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY, token="not-a-token-we-issued")
    error = refusal(post_request(MESSAGES, BODY, headers))
    assert (error.status, error.www_authenticate) == (401, 'Bearer error="invalid_token"')


def test_it_refuses_the_token_of_a_revoked_peer(cloud: FakePeer) -> None:
    Peer.objects.filter(pk=cloud.peer.pk).update(revoked_at=timezone.now())
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY)
    error = refusal(post_request(MESSAGES, BODY, headers))
    assert (error.status, error.www_authenticate) == (401, 'Bearer error="invalid_token"')
    assert "unknown or revoked" in error.message


def test_it_refuses_the_outbound_token_presented_back_to_us(cloud: FakePeer) -> None:
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY, token=cloud.outbound_token)
    assert refusal(post_request(MESSAGES, BODY, headers)).status == 401


# --- the signature ----------------------------------------------------------------------------


def test_it_refuses_a_request_without_a_signature(cloud: FakePeer) -> None:
    headers = {"Authorization": f"Bearer {cloud.inbound_token}", "Idempotency-Key": KEY}
    error = refusal(post_request(MESSAGES, BODY, headers))
    assert error.status == 401
    assert error.www_authenticate == "Bearer"  # the token was fine: not invalid_token
    assert "signature" in error.message


def test_it_refuses_a_signature_by_another_key_under_the_peers_keyid(cloud: FakePeer) -> None:
    impostor, _ = new_key_pair()
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY, private_key=impostor)
    assert refusal(post_request(MESSAGES, BODY, headers)).status == 401


def test_it_refuses_a_tampered_body(cloud: FakePeer) -> None:
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY)
    tampered = BODY.replace(b"hello", b"rm -rf")
    error = refusal(post_request(MESSAGES, tampered, headers))
    assert error.status == 401 and "Content-Digest" in error.message


def test_it_refuses_a_tampered_path(cloud: FakePeer) -> None:
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY)
    assert refusal(post_request("/api/v1/peers/launch", BODY, headers)).status == 401


def test_it_refuses_a_tampered_query(cloud: FakePeer) -> None:
    headers = signed_headers(cloud, "GET", "/api/v1/peers/repos?limit=5")
    assert refusal(get_request("/api/v1/peers/repos?limit=500", headers)).status == 401
    assert refusal(get_request("/api/v1/peers/repos", headers)).status == 401


def test_it_refuses_a_tampered_idempotency_key(cloud: FakePeer) -> None:
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY)
    headers["Idempotency-Key"] = "another-key"
    assert refusal(post_request(MESSAGES, BODY, headers)).status == 401


def test_it_refuses_an_idempotency_key_added_after_signing(cloud: FakePeer) -> None:
    headers = signed_headers(cloud, "POST", MESSAGES, BODY)
    headers["Idempotency-Key"] = KEY
    assert refusal(post_request(MESSAGES, BODY, headers)).status == 401


def test_it_refuses_a_signature_that_does_not_cover_the_token(cloud: FakePeer) -> None:
    request = httpx.Request(
        "POST",
        f"http://testserver{MESSAGES}",
        content=BODY,
        headers={"Authorization": f"Bearer {cloud.inbound_token}", "Idempotency-Key": KEY},
    )
    signer = HTTPMessageSigner(signature_algorithm=algorithms.ED25519, key_resolver=_OneKey(cloud))
    signer.sign(
        request,
        key_id=cloud.fingerprint,
        label=SIGNATURE_LABEL,
        tag=SIGNATURE_TAG,
        covered_component_ids=("@method", "@path", "@query", "idempotency-key"),
        body=BODY,
    )
    headers = {name: request.headers[name] for name in request.headers if name.lower() not in ("content-length",)}
    error = refusal(post_request(MESSAGES, BODY, headers))
    assert error.status == 401 and "authorization" in error.message


def test_it_refuses_a_signature_created_more_than_five_minutes_ago(cloud: FakePeer) -> None:
    created = now() - datetime.timedelta(seconds=400)
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY, created=created)
    assert refusal(post_request(MESSAGES, BODY, headers)).status == 401


def test_it_refuses_a_signature_created_more_than_five_minutes_ahead(cloud: FakePeer) -> None:
    created = now() + datetime.timedelta(seconds=400)
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY, created=created)
    assert refusal(post_request(MESSAGES, BODY, headers)).status == 401


def test_it_refuses_a_signature_without_created(cloud: FakePeer) -> None:
    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(BODY).digest()).decode() + ":"
    params = (
        '("@method" "@path" "@query" "authorization" "content-digest")'
        f';keyid="{cloud.fingerprint}";tag="{SIGNATURE_TAG}"'
    )
    base = "\n".join(
        [
            '"@method": POST',
            f'"@path": {MESSAGES}',
            '"@query": ?',
            f'"authorization": Bearer {cloud.inbound_token}',
            f'"content-digest": {digest}',
            f'"@signature-params": {params}',
        ]
    )
    signature = base64.b64encode(cloud.private_key.sign(base.encode())).decode()
    headers = {
        "Authorization": f"Bearer {cloud.inbound_token}",
        "Content-Digest": digest,
        "Signature-Input": f"sig1={params}",
        "Signature": f"sig1=:{signature}:",
    }
    error = refusal(post_request(MESSAGES, BODY, headers))
    assert error.status == 401 and "created" in error.message


def test_it_refuses_with_403_a_keyid_that_is_not_the_peers_pinned_key(
    cloud: FakePeer, make_peer: Callable[..., FakePeer], owner: Any
) -> None:
    other = make_peer(owner, label="Other")
    # A valid token of Cloud, signed by another linked instance with its own key and keyid.
    headers = signed_headers(
        cloud, "POST", MESSAGES, BODY, idempotency_key=KEY, private_key=other.private_key, keyid=other.fingerprint
    )
    error = refusal(post_request(MESSAGES, BODY, headers))
    assert (error.status, error.code) == (403, "PERMISSION_DENIED")
    response = peer_error_response(error)
    assert response.status_code == 403 and not response.has_header("WWW-Authenticate")


def test_a_bad_token_is_refused_before_the_keyid_is_looked_at(cloud: FakePeer) -> None:
    stranger, _ = new_key_pair()
    headers = signed_headers(
        cloud, "POST", MESSAGES, BODY, idempotency_key=KEY, token="unknown", private_key=stranger, keyid="ffff"
    )
    assert refusal(post_request(MESSAGES, BODY, headers)).status == 401


# --- last_seen_at -----------------------------------------------------------------------------


def test_success_stamps_last_seen_at_at_most_once_a_minute(cloud: FakePeer) -> None:
    def authenticate() -> None:
        headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY)
        peer_authenticate_sync(post_request(MESSAGES, BODY, headers))

    assert Peer.objects.get(pk=cloud.peer.pk).last_seen_at is None
    authenticate()
    first = Peer.objects.get(pk=cloud.peer.pk).last_seen_at
    assert first is not None

    recent = timezone.now() - datetime.timedelta(seconds=30)
    Peer.objects.filter(pk=cloud.peer.pk).update(last_seen_at=recent)
    authenticate()
    assert Peer.objects.get(pk=cloud.peer.pk).last_seen_at == recent

    old = timezone.now() - datetime.timedelta(seconds=61)
    Peer.objects.filter(pk=cloud.peer.pk).update(last_seen_at=old)
    authenticate()
    assert Peer.objects.get(pk=cloud.peer.pk).last_seen_at > old


def test_a_refused_request_does_not_stamp_last_seen_at(cloud: FakePeer) -> None:
    headers = signed_headers(cloud, "POST", MESSAGES, BODY, idempotency_key=KEY)
    refusal(post_request(MESSAGES, BODY + b"x", headers))
    assert Peer.objects.get(pk=cloud.peer.pk).last_seen_at is None


class _OneKey:
    def __init__(self, fake: FakePeer) -> None:
        self.fake = fake

    def resolve_private_key(self, key_id: str) -> Any:
        return self.fake.private_key

    def resolve_public_key(self, key_id: str) -> Any:
        return self.fake.private_key.public_key()


# --- through Django's real request handlers (ASGI and WSGI), with this module as the URLconf ----


@login_not_required
async def _async_whoami(request: HttpRequest, rest: str) -> HttpResponse:
    try:
        peer = await peer_authenticate(request)
    except PeerAuthError as exc:
        return peer_error_response(exc)
    return JsonResponse({"peer": peer.label})


@login_not_required
def _sync_whoami(request: HttpRequest, rest: str) -> HttpResponse:
    try:
        peer = peer_authenticate_sync(request)
    except PeerAuthError as exc:
        return peer_error_response(exc)
    return JsonResponse({"peer": peer.label})


urlpatterns = [
    url_path("async/<path:rest>", _async_whoami),
    url_path("sync/<path:rest>", _sync_whoami),
]

AWKWARD = "/agents/a%20b~c/stop?q=a%20b&r=%7E&s=1+2&empty="


@pytest.mark.django_db(transaction=True)
@override_settings(ROOT_URLCONF="tests.peers.test_auth")
async def test_an_async_view_behind_the_asgi_handler_sees_path_and_query_as_signed(
    make_peer: Callable[..., FakePeer],
) -> None:
    from channels.db import database_sync_to_async
    from django.contrib.auth import get_user_model

    user = await database_sync_to_async(get_user_model().objects.create_user)("erin")
    fake = await database_sync_to_async(make_peer)(user, label="Asgi")
    client = AsyncClient()
    response = await apeer_get(client, fake, "/async" + AWKWARD)
    assert (response.status_code, response.json()) == (200, {"peer": "Asgi"})
    response = await apeer_post(client, fake, "/async/messages", {"content": "ünïcode"})
    assert (response.status_code, response.json()) == (200, {"peer": "Asgi"})
    response = await client.get("/async/messages", headers={"Authorization": f"Bearer {fake.inbound_token}"})
    assert response.status_code == 401 and response["WWW-Authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "AUTHENTICATION_FAILED"


@override_settings(ROOT_URLCONF="tests.peers.test_auth")
def test_a_sync_view_behind_the_wsgi_handler_sees_path_and_query_as_signed(cloud: FakePeer) -> None:
    client = Client()
    response = peer_get(client, cloud, "/sync" + AWKWARD)
    assert (response.status_code, response.json()) == (200, {"peer": "Cloud"})
    assert peer_post(client, cloud, "/sync/launch", {"name": "w"}).status_code == 200
    response = client.get("/sync/messages")
    assert response.status_code == 401 and response["WWW-Authenticate"] == 'Bearer error="invalid_token"'
