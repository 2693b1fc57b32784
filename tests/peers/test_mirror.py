"""The mirroring subscriber (docs/peers.md#shadow-agents): leases, backoff, doorbell, and a real peer's stream.

The last test runs the subscriber of this (test) instance against a peer that is a real
``manage.py serve`` subprocess which has this instance linked (our public key, a token).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agents.models import Agent, AgentEvent
from core import secrets_at_rest
from peers import mirror
from peers.models import Peer, PeerLease
from peers.services import leases
from peers.services.identity import identity_get
from tests.infra import eventually, instance


def test_reconnect_delays_double_from_5_seconds_up_to_60_with_jitter(monkeypatch):
    monkeypatch.setattr(settings, "PEER_BACKOFF_SCALE", 1.0)
    for failures, nominal in [(0, 5), (1, 10), (2, 20), (3, 40)]:
        delays = [mirror.reconnect_delay(failures) for _ in range(200)]
        assert all(0.8 * nominal <= d <= 1.2 * nominal for d in delays)
        assert len(set(delays)) > 1  # jittered
    assert all(48 <= mirror.reconnect_delay(n) <= 60 for n in (4, 5, 30) for _ in range(50))


@pytest.mark.django_db
def test_one_process_at_a_time_holds_a_peers_subscribe_lease(owner, make_peer):
    peer = make_peer(owner).peer
    assert leases.subscribe_lease_claim(peer_id=peer.pk, holder="proc_a")
    assert leases.subscribe_lease_claim(peer_id=peer.pk, holder="proc_a")  # renewal
    assert not leases.subscribe_lease_claim(peer_id=peer.pk, holder="proc_b")
    PeerLease.objects.filter(peer=peer).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert leases.subscribe_lease_claim(peer_id=peer.pk, holder="proc_b")  # the holder died: taken over
    assert not leases.subscribe_lease_claim(peer_id=peer.pk, holder="proc_a")
    leases.subscribe_lease_release(peer_id=peer.pk, holder="proc_a")  # not its lease: nothing happens
    assert PeerLease.objects.get(peer=peer).holder == "proc_b"
    leases.subscribe_lease_release(peer_id=peer.pk, holder="proc_b")
    assert leases.subscribe_lease_claim(peer_id=peer.pk, holder="proc_a")


@pytest.mark.django_db(transaction=True)
async def test_resnapshot_and_rescan_ring_the_doorbell_after_commit():
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(mirror.DOORBELL_GROUP, channel)

    def ring_in_a_transaction(rolled_back: bool) -> None:
        try:
            with transaction.atomic():
                mirror.mirror_resnapshot(7)
                if rolled_back:
                    raise RuntimeError("rolled back")
        except RuntimeError:
            pass

    await database_sync_to_async(ring_in_a_transaction)(True)
    await database_sync_to_async(ring_in_a_transaction)(False)
    assert await asyncio.wait_for(layer.receive(channel), 2) == {"type": "mirror.resnapshot", "peer_id": 7}
    await database_sync_to_async(mirror.mirror_rescan)()
    assert await asyncio.wait_for(layer.receive(channel), 2) == {"type": "mirror.rescan"}


def test_frames_that_are_not_json_or_not_agents_are_skipped(owner, make_peer):
    peer = make_peer(owner).peer
    assert mirror.apply_event(peer, "snapshot", "{not json") is False
    assert mirror.apply_event(peer, "snapshot", '{"agents": 3}') is False
    assert mirror.apply_event(peer, "agent.upsert", '{"id": "ag_1", "status": "flying"}') is False
    assert mirror.apply_event(peer, "snapshot", '{"agents": []}') is True
    assert not Agent.objects.filter(peer=peer).exists()


# --- against a real peer -----------------------------------------------------------------------


def _link_us_on(inst: Any, *, token: str) -> None:
    """On the served instance, link this test instance (its public key) for ``admin`` with ``token``."""
    us = identity_get()
    inst.manage(
        "shell",
        "-c",
        "from django.contrib.auth import get_user_model; from core.services import token_digest; "
        "from peers.keys import fingerprint_of; from peers.models import Peer; "
        "admin = get_user_model().objects.get(username='admin'); "
        f"Peer.objects.create(owner=admin, instance_id={us.instance_id!r}, label='Tests', url='http://127.0.0.1:9', "
        f"public_key={us.public_key!r}, fingerprint=fingerprint_of({us.public_key!r}), "
        f"inbound_digest=token_digest({token!r}), inbound_prefix={token[:8]!r}, outbound_token_encrypted='x')",
    )


def _shadows(peer: Peer) -> list[Agent]:
    return list(Agent.objects.filter(peer=peer).order_by("created_at"))


def _timeline(agent: Agent) -> list[tuple[str, str, bool]]:
    return [(e.type, e.message, e.mirrored) for e in AgentEvent.objects.filter(agent=agent).order_by("created_at")]


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
async def test_the_subscriber_mirrors_a_real_peer_goes_stale_when_it_stops_and_recovers(owner, make_peer, monkeypatch):
    monkeypatch.setattr(settings, "PEER_BACKOFF_SCALE", 0.02)
    token = "peer-token-" + "m" * 30
    with instance() as inst:
        server = await asyncio.to_thread(inst.serve)
        await asyncio.to_thread(_link_us_on, inst, token=token)
        fake = await database_sync_to_async(make_peer)(owner, label="Bee", url=server.url)
        peer = fake.peer
        peer.outbound_token_encrypted = secrets_at_rest.encrypt(token.encode())
        await database_sync_to_async(peer.save)()
        headers = {"Authorization": f"Bearer {inst.admin_token}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=10) as b:
            first = (await b.post("/api/v1/agents", json={"type": "expert", "name": "one", "cwd": "/tmp"})).json()
            task = asyncio.create_task(mirror.subscribe_peer(peer.pk))
            try:
                shadows = await eventually(
                    lambda: database_sync_to_async(_shadows)(peer), timeout=15, what="the first shadow"
                )
                assert [(s.name, s.status, s.peer_agent_id, s.owner_id) for s in shadows] == [
                    ("one", "running", first["id"], owner.pk)
                ]
                seen = await database_sync_to_async(Peer.objects.get)(pk=peer.pk)
                assert seen.last_seen_at is not None

                # Live: B stops its agent; the shadow follows with B's event and its original time.
                assert (await b.post(f"/api/v1/agents/{first['id']}/stop")).status_code == 200

                async def stopped_with_event() -> bool:
                    (shadow,) = await database_sync_to_async(_shadows)(peer)
                    return shadow.status == "stopped" and bool(await database_sync_to_async(_timeline)(shadow))

                await eventually(stopped_with_event, timeout=15, what="the shadow to stop")
                (shadow,) = await database_sync_to_async(_shadows)(peer)
                assert await database_sync_to_async(_timeline)(shadow) == [("system", "stopped by its user", True)]
                b_events = (await b.get(f"/api/v1/agents/{first['id']}/events")).json()["events"]
                assert shadow.latest_event_at.isoformat().replace("+00:00", "Z") == b_events[0]["created_at"]
                # B goes away: the shadow goes stale with one lost-contact event.
                await asyncio.to_thread(server.stop)

                async def stale() -> bool:
                    (shadow,) = await database_sync_to_async(_shadows)(peer)
                    return shadow.stale

                await eventually(stale, timeout=15, what="the shadow to go stale")
                await asyncio.sleep(0.5)  # several failed reconnects
                (shadow,) = await database_sync_to_async(_shadows)(peer)
                assert await database_sync_to_async(_timeline)(shadow) == [
                    ("system", "stopped by its user", True),
                    ("system", "lost contact with Bee", False),
                ]

                # B comes back (a new port: the subscriber re-reads the peer's url on every attempt).
                server = await asyncio.to_thread(inst.serve)
                await database_sync_to_async(Peer.objects.filter(pk=peer.pk).update)(url=server.url)

                async def fresh() -> bool:
                    (shadow,) = await database_sync_to_async(_shadows)(peer)
                    return not shadow.stale

                await eventually(fresh, timeout=30, what="the shadow to be fresh again")
                (shadow,) = await database_sync_to_async(_shadows)(peer)
                assert shadow.status == "stopped"
                # The replay added nothing; contact is noted back once.
                assert await database_sync_to_async(_timeline)(shadow) == [
                    ("system", "stopped by its user", True),
                    ("system", "lost contact with Bee", False),
                    ("system", "contact restored with Bee", False),
                ]
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


@pytest.mark.django_db(transaction=True)
async def test_the_loop_subscribes_only_with_the_lease_and_lets_go_of_a_revoked_peer(owner, make_peer, monkeypatch):
    from core.presence import current_process_id

    monkeypatch.setattr(settings, "PEER_BACKOFF_SCALE", 0.02)
    fake = await database_sync_to_async(make_peer)(owner, label="Gone", url="http://127.0.0.1:9")  # nothing listens
    peer = fake.peer
    await database_sync_to_async(Agent.objects.create)(
        owner=owner, name="shadow", type="shell", status="running", cwd="", peer=peer, peer_agent_id="ag_x"
    )
    lease = await database_sync_to_async(PeerLease.objects.create)(
        peer=peer, kind="subscribe", holder="proc_other", expires_at=timezone.now() + timedelta(minutes=5)
    )
    loop_task = asyncio.create_task(mirror.mirror_loop())
    try:
        await asyncio.sleep(0.5)
        assert (await database_sync_to_async(PeerLease.objects.get)(pk=lease.pk)).holder == "proc_other"
        assert not await database_sync_to_async(Agent.objects.filter(peer=peer, stale=True).exists)()

        # The other holder's lease lapses; a rescan takes it and the subscriber runs (B is down: stale).
        await database_sync_to_async(PeerLease.objects.filter(pk=lease.pk).update)(expires_at=timezone.now())
        await database_sync_to_async(mirror.mirror_rescan)()

        async def ours_and_stale() -> bool:
            held = await database_sync_to_async(
                PeerLease.objects.filter(peer=peer, holder=current_process_id()).exists
            )()
            return held and await database_sync_to_async(Agent.objects.filter(peer=peer, stale=True).exists)()

        await eventually(ours_and_stale, timeout=10, what="the lease taken and the shadow stale")

        # Revoked: the subscription stops and the lease is released.
        await database_sync_to_async(Peer.objects.filter(pk=peer.pk).update)(revoked_at=timezone.now())
        await database_sync_to_async(mirror.mirror_rescan)()
        await eventually(
            lambda: database_sync_to_async(lambda: not PeerLease.objects.filter(peer=peer).exists())(),
            timeout=10,
            what="the lease released",
        )
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)


def _refusing_client(status: int, challenge: str | None, identity: Any) -> Any:
    from peers.client import PeerClient

    def handler(request: httpx.Request) -> httpx.Response:
        headers = {"WWW-Authenticate": challenge} if challenge else {}
        return httpx.Response(
            status, json={"error": {"code": "AUTHENTICATION_FAILED", "message": "no"}}, headers=headers
        )

    return lambda peer: PeerClient(peer, identity=identity, transport=httpx.MockTransport(handler))


@pytest.mark.django_db(transaction=True)
async def test_a_peer_that_no_longer_knows_our_token_shows_as_unlinked_by_the_other_side(owner, make_peer, monkeypatch):
    fake = await database_sync_to_async(make_peer)(owner)
    identity = await database_sync_to_async(identity_get)()
    monkeypatch.setattr(mirror, "_client_for", _refusing_client(401, 'Bearer error="invalid_token"', identity))

    await asyncio.wait_for(mirror.subscribe_peer(fake.peer.pk), 10)  # returns: the link is gone

    peer = await database_sync_to_async(Peer.objects.get)(pk=fake.peer.pk)
    assert peer.revoked_at is not None and peer.unlinked_by_peer is True


@pytest.mark.django_db(transaction=True)
async def test_a_signature_refusal_is_retried_and_does_not_unlink(owner, make_peer, monkeypatch):
    monkeypatch.setattr(settings, "PEER_BACKOFF_SCALE", 0.01)
    fake = await database_sync_to_async(make_peer)(owner)
    identity = await database_sync_to_async(identity_get)()
    monkeypatch.setattr(mirror, "_client_for", _refusing_client(401, "Bearer", identity))

    task = asyncio.ensure_future(mirror.subscribe_peer(fake.peer.pk))
    await asyncio.sleep(0.5)
    assert not task.done()  # still retrying (a clock or signature problem can pass)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    peer = await database_sync_to_async(Peer.objects.get)(pk=fake.peer.pk)
    assert peer.revoked_at is None and peer.unlinked_by_peer is False


@pytest.mark.django_db(transaction=True)
async def test_a_link_made_without_a_doorbell_is_picked_up_without_waiting_for_the_rescan(
    owner, make_peer, monkeypatch
):
    subscribed: list[int] = []

    async def fake_subscribe(peer_id: int) -> None:
        subscribed.append(peer_id)
        await asyncio.sleep(3600)

    monkeypatch.setattr(mirror, "subscribe_peer", fake_subscribe)
    monkeypatch.setattr(mirror, "RESCAN_SECONDS", 3600.0)
    monkeypatch.setattr(mirror, "PEEK_SECONDS", 0.1)
    loop_task = asyncio.ensure_future(mirror.mirror_loop())
    try:
        await asyncio.sleep(0.3)
        assert subscribed == []
        # As `manage.py peer_link` in another process would: a row, and a doorbell this
        # process never hears (the in-memory channel layer is per process).
        fake = await database_sync_to_async(make_peer)(owner)
        for _ in range(50):
            if subscribed:
                break
            await asyncio.sleep(0.1)
        assert subscribed == [fake.peer.pk]
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
