"""Web Push: a notification reaches a local push endpoint (an HTTP server of the test)
whose subscription keys the test generated; the test decrypts the body itself per
RFC 8291 / RFC 8188 (aes128gcm) and verifies the VAPID JWT per RFC 8292. An expired
subscription (404/410) is deleted."""

from __future__ import annotations

import base64
import json
import os
import re
import time
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from agents import approvals
from agents.models import Agent
from attention import services
from attention.models import Delivery, Notification, PushSubscription
from attention.vapid import vapid_public_key
from attention.worker import deliver_due_once
from tests.attention.conftest import Receiver

pytestmark = pytest.mark.django_db


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Browser:
    """What a browser keeps for one push subscription: an ECDH P-256 key pair and a
    16-byte auth secret (RFC 8291 §2)."""

    def __init__(self) -> None:
        self.private_key = ec.generate_private_key(ec.SECP256R1())
        self.public_raw = self.private_key.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
        self.auth = os.urandom(16)

    def decrypt(self, body: bytes) -> bytes:
        """RFC 8188 §2.1 header (salt, rs, idlen, keyid = the sender's public key), then
        RFC 8291 §3.3-3.4 keys, then the single record with its 0x02 delimiter."""
        salt, record_size, id_length = body[:16], int.from_bytes(body[16:20], "big"), body[20]
        sender_raw = body[21 : 21 + id_length]
        ciphertext = body[21 + id_length :]
        assert id_length == 65 and len(ciphertext) <= record_size
        sender = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), sender_raw)
        shared = self.private_key.exchange(ec.ECDH(), sender)
        key_info = b"WebPush: info\x00" + self.public_raw + sender_raw
        ikm = HKDF(hashes.SHA256(), 32, salt=self.auth, info=key_info).derive(shared)
        cek = HKDF(hashes.SHA256(), 16, salt=salt, info=b"Content-Encoding: aes128gcm\x00").derive(ikm)
        nonce = HKDF(hashes.SHA256(), 12, salt=salt, info=b"Content-Encoding: nonce\x00").derive(ikm)
        padded = AESGCM(cek).decrypt(nonce, ciphertext, None)
        unpadded = padded.rstrip(b"\x00")
        assert unpadded.endswith(b"\x02"), "the last record ends with the 0x02 delimiter"
        return unpadded[:-1]


def subscribe(owner: Any, receiver: Receiver, browser: Browser, path: str = "/push/device-1") -> PushSubscription:
    return services.push_subscription_save(
        user=owner, endpoint=receiver.origin + path, p256dh=b64url(browser.public_raw), auth=b64url(browser.auth)
    )


def approval_waiting(agent: Agent, capture: Any) -> Any:
    """The agent's CLI asks to run a command (its PermissionRequest hook's service); the
    ``approval_requested`` receivers run on commit."""
    with capture(execute=True):
        return approvals.approval_request(
            agent=agent, tool_name="Bash", tool_input={"command": "rm -rf build && make test"}
        )


def test_a_push_is_encrypted_for_the_subscription_and_signed_with_the_instances_vapid_key(
    owner: Any, cli_agent: Agent, receiver: Receiver, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.PUBLIC_URL = "https://dispatch.example.org"
    settings.VAPID_SUBJECT = "mailto:admin@example.org"
    browser = Browser()
    subscribe(owner, receiver, browser)

    approval = approval_waiting(cli_agent, django_capture_on_commit_callbacks)
    assert deliver_due_once() == 1
    request = receiver.wait()

    assert request.path == "/push/device-1"
    assert request.headers["content-encoding"] == "aes128gcm"
    assert request.headers["urgency"] == "high"  # an approval waits for a person
    assert int(request.headers["ttl"]) > 0
    payload = json.loads(browser.decrypt(request.body))
    notification = Notification.objects.get()
    assert payload == {
        "id": notification.pk,
        "kind": "approval",
        "title": "builder asks to use Bash",
        "body": "Bash: rm -rf build && make test",
        "url": f"https://dispatch.example.org/approvals/{approval.pk}/",
        "agent_id": cli_agent.pk,
    }

    # RFC 8292 §3: Authorization: vapid t=<JWT>, k=<the server's public key>
    found = re.fullmatch(r"vapid t=([^,\s]+),\s*k=([A-Za-z0-9_-]+)", request.headers["authorization"])
    assert found, request.headers["authorization"]
    token, key = found.groups()
    assert key == vapid_public_key()
    public_key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), unb64url(key))
    assert jwt.get_unverified_header(token)["alg"] == "ES256"
    claims = jwt.decode(
        token,
        key=public_key,
        algorithms=["ES256"],
        audience=receiver.origin,
        options={"require": ["exp", "sub", "aud"]},
    )
    assert claims["sub"] == "mailto:admin@example.org"
    assert time.time() < claims["exp"] <= time.time() + 24 * 3600
    with pytest.raises(jwt.InvalidSignatureError):  # signed by that key, not any key
        other = ec.generate_private_key(ec.SECP256R1()).public_key()
        jwt.decode(token, key=other, algorithms=["ES256"], audience=receiver.origin)

    assert Delivery.objects.get().status == Delivery.Status.SENT
    assert PushSubscription.objects.get().last_sent_at is not None


@pytest.mark.parametrize("answer", [404, 410])
def test_an_expired_subscription_is_deleted(
    owner: Any, cli_agent: Agent, receiver: Receiver, answer: int, django_capture_on_commit_callbacks: Any
) -> None:
    receiver.status = answer
    subscribe(owner, receiver, Browser())
    approval_waiting(cli_agent, django_capture_on_commit_callbacks)
    assert deliver_due_once() == 1
    assert PushSubscription.objects.count() == 0
    delivery = Delivery.objects.get()
    assert delivery.status == Delivery.Status.GONE
    assert str(answer) in delivery.last_error
    assert Notification.objects.get().status == Notification.Status.FAILED


def test_the_vapid_key_is_made_once_with_mode_0600_and_kept(settings: Any, tmp_path: Any) -> None:
    from attention import vapid

    settings.VAPID_PRIVATE_KEY = ""
    settings.VAPID_KEY_FILE = tmp_path / "vapid_private_key.pem"
    vapid.vapid_key.cache_clear()
    try:
        first = vapid.vapid_public_key()
        assert settings.VAPID_KEY_FILE.stat().st_mode & 0o777 == 0o600
        vapid.vapid_key.cache_clear()
        assert vapid.vapid_public_key() == first  # read back, not made again
        assert len(unb64url(first)) == 65 and unb64url(first)[0] == 4
    finally:
        vapid.vapid_key.cache_clear()


def test_an_approval_answered_before_its_push_went_out_is_not_pushed(
    owner: Any, cli_agent: Agent, receiver: Receiver, django_capture_on_commit_callbacks: Any
) -> None:
    subscribe(owner, receiver, Browser())
    approval = approval_waiting(cli_agent, django_capture_on_commit_callbacks)
    approvals.approval_answer(approval_id=approval.pk, decision="allow_once", user=owner)
    assert deliver_due_once() == 1
    assert receiver.requests == []
    assert Delivery.objects.get().status == Delivery.Status.OBSOLETE
    notification = Notification.objects.get()
    assert (notification.status, notification.suppressed_reason) == ("suppressed", "answered")
