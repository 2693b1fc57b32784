"""The durable outbox (docs/peers.md#the-outbox): messages to agents on peers are written with
their outbox row in one transaction and drained in order per peer, each peer on its own,
with backoff, dead letters and exactly-once delivery through the peer's receipts.

The peers are fakes behind ``httpx.MockTransport`` that behave like the receiving side of
``POST /api/v1/peers/messages``: a receipt per ``Idempotency-Key``, a repeated key answered
``{"delivered": true, "duplicate": true}`` without delivering again.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.utils import timezone

from agents.models import Agent, AgentEvent, AgentMessage
from agents.services import agent_create
from core.errors import DispatchError, NotFound
from peers import outbox_drain
from peers.client import PeerClient
from peers.models import OutboxMessage, PeerLease, PeerReceipt
from peers.outbox_drain import outbox_drain_once, outbox_drain_peer
from peers.services import outbox as outbox_services
from peers.services.outbox import backoff_delay, outbox_backoff_reset, outbox_discard, outbox_purge, outbox_retry
from peers.services.outgoing import peer_message_send
from peers.services.shadows import shadow_upsert

pytestmark = pytest.mark.django_db(transaction=True)

REMOTE_AGENT = "agt_0123456789ab"
OTHER_REMOTE_AGENT = "agt_ba9876543210"


@dataclass
class FakeRemotes:
    """The receiving side of every fake peer, by host: ``modes[host]`` is ``"ok"`` (default),
    ``"down"`` (connection refused) or an HTTP status to answer with."""

    modes: dict[str, Any] = field(default_factory=dict)
    received: list[tuple[str, str, str]] = field(default_factory=list)  # (host, key, content), every POST
    delivered: list[tuple[str, str, str]] = field(default_factory=list)  # first deliveries only
    keys: set[str] = field(default_factory=set)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.001)  # let concurrent drains interleave
        host = request.url.host
        key = request.headers["idempotency-key"]
        assert request.url.path == "/api/v1/peers/messages"
        assert request.headers["authorization"].startswith("Bearer ")
        assert "signature" in request.headers
        content = json.loads(request.content)["content"]
        self.received.append((host, key, content))
        mode = self.modes.get(host, "ok")
        if mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if isinstance(mode, int):
            return httpx.Response(mode, json={"error": {"code": "CONFLICT", "message": f"refused with {mode}"}})
        if key in self.keys:
            return httpx.Response(200, json={"delivered": True, "duplicate": True})
        self.keys.add(key)
        self.delivered.append((host, key, content))
        return httpx.Response(200, json={"delivered": True, "message_id": len(self.delivered)})


@pytest.fixture
def remotes(monkeypatch: pytest.MonkeyPatch) -> FakeRemotes:
    fake = FakeRemotes()
    monkeypatch.setattr(
        outbox_drain, "PeerClient", functools.partial(PeerClient, transport=httpx.MockTransport(fake.handler))
    )
    return fake


@pytest.fixture
def sender(owner: Any, tmp_path: Any) -> Agent:
    return agent_create(owner=owner, type="expert", name="lead", cwd=str(tmp_path))


@pytest.fixture
def cloud(owner: Any, make_peer: Any) -> Any:
    return make_peer(owner, label="Cloud", url="http://cloud.test").peer


@pytest.fixture
def laptop(owner: Any, make_peer: Any) -> Any:
    return make_peer(owner, label="Laptop", url="http://laptop.test").peer


def send(owner: Any, sender: Agent, peer: Any, content: str, to: str = REMOTE_AGENT) -> AgentMessage:
    """Send to agent ``to`` of ``peer``, which the mirror is made to have reported first."""
    if not Agent.objects.filter(peer=peer, peer_agent_id=to).exists():
        shadow_upsert(
            peer=peer, peer_agent_id=to, name=f"far-{to[-4:]}", type="shell", status="running", seen_at=timezone.now()
        )
    return peer_message_send(user=owner, sender_agent=sender, peer=peer, to_agent_id=to, content=content)


async def until(condition: Any, seconds: float) -> None:
    """Poll ``condition()`` every 20 ms for up to ``seconds``; the caller asserts the outcome."""
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)


def drain(holder: str = "worker-1", **kwargs: Any) -> list[outbox_drain.PeerDrain]:
    return async_to_sync(outbox_drain_once)(holder=holder, **kwargs)


def statuses(*messages: AgentMessage) -> list[str]:
    return [AgentMessage.objects.get(pk=message.pk).status for message in messages]


def make_due() -> None:
    OutboxMessage.objects.filter(status="queued").update(next_attempt_at=timezone.now())


def test_sending_writes_the_message_and_its_outbox_row_together(owner: Any, sender: Agent, cloud: Any) -> None:
    message = send(owner, sender, cloud, "hello there")
    row = OutboxMessage.objects.get(message=message)
    assert message.status == "queued"
    assert message.peer_id == cloud.pk
    assert row.idempotency_key == message.idempotency_key
    assert row.payload["to_agent_id"] == REMOTE_AGENT
    assert row.payload["content"] == "hello there"
    assert row.payload["from"]["agent_id"] == sender.pk
    assert row.payload["from"]["name"] == "lead"
    shadow = message.recipient_agent
    assert shadow.peer_id == cloud.pk and shadow.peer_agent_id == REMOTE_AGENT


def test_rows_are_delivered_in_order_and_messages_marked_delivered(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes
) -> None:
    sent = [send(owner, sender, cloud, f"message {n}") for n in range(5)]
    [report] = drain()
    assert [content for _, _, content in remotes.delivered] == [f"message {n}" for n in range(5)]
    assert len(report.delivered) == 5
    assert statuses(*sent) == ["delivered"] * 5
    assert all(AgentMessage.objects.get(pk=m.pk).delivered_at is not None for m in sent)


def test_at_most_fifty_rows_per_peer_per_pass(owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes) -> None:
    for n in range(53):
        send(owner, sender, cloud, f"m{n}")
    drain()
    assert len(remotes.delivered) == 50
    drain()
    assert [content for _, _, content in remotes.delivered] == [f"m{n}" for n in range(53)]


def test_a_transient_failure_stops_that_peer_only(
    owner: Any, sender: Agent, cloud: Any, laptop: Any, remotes: FakeRemotes
) -> None:
    remotes.modes["laptop.test"] = "down"
    to_laptop = [send(owner, sender, laptop, f"laptop {n}") for n in range(3)]
    to_cloud = [send(owner, sender, cloud, f"cloud {n}") for n in range(3)]
    reports = {report.peer_id: report for report in drain()}
    # The closed laptop was tried once (its first row) and holds nothing of the cloud's mail.
    assert [content for host, _, content in remotes.received if host == "laptop.test"] == ["laptop 0"]
    assert reports[laptop.pk].deferred == [OutboxMessage.objects.get(message=to_laptop[0]).pk]
    assert statuses(*to_laptop) == ["queued"] * 3
    assert statuses(*to_cloud) == ["delivered"] * 3
    first = OutboxMessage.objects.get(message=to_laptop[0])
    assert first.attempts == 1
    assert "could not be reached" in first.last_error
    assert first.next_attempt_at > timezone.now() + timedelta(seconds=20)


def test_a_row_waiting_for_its_retry_is_not_overtaken(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes
) -> None:
    remotes.modes["cloud.test"] = 503
    sent = [send(owner, sender, cloud, f"m{n}") for n in range(2)]
    drain()
    remotes.modes["cloud.test"] = "ok"
    drain()  # the first row is not due yet: nothing is sent, not even the second row
    assert remotes.delivered == []
    make_due()
    drain()
    assert [content for _, _, content in remotes.delivered] == ["m0", "m1"]
    assert statuses(*sent) == ["delivered", "delivered"]


def test_backoff_doubles_from_thirty_seconds_with_jitter_and_a_cap() -> None:
    assert [backoff_delay(n, rand=lambda: 0.5) for n in range(7)] == [30, 60, 120, 240, 480, 900, 900]
    assert backoff_delay(0, rand=lambda: 0.0) == pytest.approx(24)
    assert backoff_delay(0, rand=lambda: 0.999999) == pytest.approx(36, abs=0.001)
    assert backoff_delay(40, rand=lambda: 0.999999) == pytest.approx(1080, abs=0.01)


def test_retries_back_off_and_a_reconnect_resets_them(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outbox_services.random, "random", lambda: 0.5)
    remotes.modes["cloud.test"] = 429
    message = send(owner, sender, cloud, "hello")
    waits = []
    for _ in range(3):
        before = timezone.now()
        drain()
        row = OutboxMessage.objects.get(message=message)
        waits.append(round((row.next_attempt_at - before).total_seconds()))
        make_due()
    assert waits == [30, 60, 120]
    assert row.attempts == 3
    OutboxMessage.objects.filter(pk=row.pk).update(next_attempt_at=timezone.now() + timedelta(minutes=10))
    remotes.modes["cloud.test"] = "ok"
    assert outbox_backoff_reset(peer=cloud) == 1
    row.refresh_from_db()
    assert row.attempts == 0 and row.next_attempt_at <= timezone.now()
    drain()
    assert statuses(message) == ["delivered"]


def test_a_permanent_failure_dead_letters_at_once_and_tells_the_sender(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes
) -> None:
    doomed = send(owner, sender, cloud, "to a gone agent")
    fine = send(owner, sender, cloud, "next one")
    remotes.modes["cloud.test"] = 409
    drain()
    # 409 is permanent: dead at once; the drain went on and got 409 for the next row too.
    assert statuses(doomed, fine) == ["dead", "dead"]
    remotes.modes["cloud.test"] = "ok"
    third = send(owner, sender, cloud, "third")
    drain()
    assert statuses(third) == ["delivered"]
    row = OutboxMessage.objects.get(message=doomed)
    assert row.status == "dead" and row.dead_at is not None and row.attempts == 0
    assert "409" in row.last_error
    assert AgentMessage.objects.get(pk=doomed.pk).error.startswith("409")
    events = AgentEvent.objects.filter(agent=sender, type="system", message__contains="could not be delivered")
    assert events.count() == 2
    assert f"message {doomed.pk} to Cloud:{REMOTE_AGENT}" in events.order_by("id").first().message  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("status", "dead"), [(400, True), (403, True), (404, True), (408, False), (429, False), (500, False), (503, False)]
)
def test_which_answers_are_permanent(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes, status: int, dead: bool
) -> None:
    remotes.modes["cloud.test"] = status
    message = send(owner, sender, cloud, "hi")
    drain()
    assert statuses(message) == ["dead" if dead else "queued"]


def test_a_crash_between_sending_and_marking_delivers_exactly_once(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = send(owner, sender, cloud, "once only")
    real = outbox_drain.outbox_mark_delivered

    def crash(*, row: OutboxMessage) -> bool:
        raise RuntimeError("process died after the peer answered")

    monkeypatch.setattr(outbox_drain, "outbox_mark_delivered", crash)
    with pytest.raises(RuntimeError):
        async_to_sync(outbox_drain_peer)(cloud.pk, holder="worker-1")
    assert statuses(message) == ["queued"]
    monkeypatch.setattr(outbox_drain, "outbox_mark_delivered", real)
    drain(holder="worker-2")
    assert len(remotes.received) == 2  # sent twice with the same key ...
    assert len(remotes.delivered) == 1  # ... delivered once: the peer answered "duplicate"
    assert remotes.received[0][1] == remotes.received[1][1] == message.idempotency_key
    assert statuses(message) == ["delivered"]


def test_two_workers_draining_at_once_never_send_a_row_twice_or_out_of_order(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes
) -> None:
    for n in range(10):
        send(owner, sender, cloud, f"m{n}")

    async def both() -> list[outbox_drain.PeerDrain]:
        return list(
            await asyncio.gather(
                outbox_drain_peer(cloud.pk, holder="worker-1"), outbox_drain_peer(cloud.pk, holder="worker-2")
            )
        )

    reports = async_to_sync(both)()
    assert [content for _, _, content in remotes.received] == [f"m{n}" for n in range(10)]
    assert sorted(len(report.delivered) for report in reports) == [0, 10]
    assert "lease held elsewhere" in [report.skipped for report in reports]
    assert not PeerLease.objects.exists()  # released after the pass


def test_a_live_lease_of_another_worker_keeps_this_one_off(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes
) -> None:
    send(owner, sender, cloud, "waiting")
    PeerLease.objects.create(peer=cloud, kind="drain", holder="other", expires_at=timezone.now() + timedelta(minutes=1))
    [report] = drain()
    assert report.skipped == "lease held elsewhere" and remotes.received == []
    PeerLease.objects.filter(holder="other").update(expires_at=timezone.now() - timedelta(seconds=1))
    drain()
    assert len(remotes.delivered) == 1


def test_a_pass_that_loses_its_lease_stops_before_the_next_row(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lease expired while a send hung, and another worker took it: this pass must not
    # send another row (the other worker owns the order now).
    monkeypatch.setattr(outbox_drain, "LEASE_RENEW_AFTER", 0.0)  # renew before every row
    first, second, third = (send(owner, sender, cloud, f"m{n}") for n in range(3))
    real_handler = remotes.handler

    async def then_steal(request: httpx.Request) -> httpx.Response:
        response = await real_handler(request)
        await database_sync_to_async(
            lambda: PeerLease.objects.filter(peer=cloud, kind="drain").update(
                holder="other", expires_at=timezone.now() + timedelta(minutes=1)
            )
        )()
        return response

    monkeypatch.setattr(remotes, "handler", then_steal)
    monkeypatch.setattr(
        outbox_drain, "PeerClient", functools.partial(PeerClient, transport=httpx.MockTransport(then_steal))
    )
    report = async_to_sync(outbox_drain_peer)(cloud.pk, holder="worker-1")
    assert report.skipped == "lease lost"
    assert [content for _, _, content in remotes.received] == ["m0"]
    assert statuses(first, second, third) == ["delivered", "queued", "queued"]
    assert PeerLease.objects.get(peer=cloud, kind="drain").holder == "other"  # not released by the loser


def test_a_fast_pass_does_not_renew_its_lease_before_every_row(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims: list[str] = []
    real_claim = outbox_drain.drain_lease_claim

    def counting_claim(**kwargs: Any) -> bool:
        claims.append(kwargs["holder"])
        return real_claim(**kwargs)

    monkeypatch.setattr(outbox_drain, "drain_lease_claim", counting_claim)
    for n in range(5):
        send(owner, sender, cloud, f"m{n}")
    report = async_to_sync(outbox_drain_peer)(cloud.pk, holder="worker-1")
    assert len(report.delivered) == 5
    assert claims == ["worker-1"]  # the claim at the start of the pass covers 15 s of sends


def test_a_row_older_than_the_maximum_age_is_dead_lettered(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes, settings: Any
) -> None:
    old = send(owner, sender, cloud, "from last week")
    fresh = send(owner, sender, cloud, "from now")
    OutboxMessage.objects.filter(message=old).update(created_at=timezone.now() - timedelta(days=7, minutes=1))
    drain()
    assert statuses(old, fresh) == ["dead", "delivered"]
    assert [content for _, _, content in remotes.received] == ["from now"]
    assert "7 days" in OutboxMessage.objects.get(message=old).last_error
    settings.OUTBOX_MAX_AGE = 3600.0
    hour_old = send(owner, sender, cloud, "an hour ago")
    OutboxMessage.objects.filter(message=hour_old).update(created_at=timezone.now() - timedelta(minutes=61))
    drain()
    assert statuses(hour_old) == ["dead"]


def test_retry_and_discard(owner: Any, member: Any, sender: Agent, cloud: Any, remotes: FakeRemotes) -> None:
    remotes.modes["cloud.test"] = 409
    message = send(owner, sender, cloud, "retry me")
    drain()
    row = OutboxMessage.objects.get(message=message)
    with pytest.raises(NotFound):
        outbox_retry(user=member, outbox_id=row.pk)
    remotes.modes["cloud.test"] = "ok"
    outbox_retry(user=owner, outbox_id=row.pk)
    assert statuses(message) == ["queued"]
    with pytest.raises(DispatchError) as refused:
        outbox_retry(user=owner, outbox_id=row.pk)
    assert refused.value.code == "CONFLICT"
    drain()
    assert statuses(message) == ["delivered"]

    remotes.modes["cloud.test"] = "down"
    second = send(owner, sender, cloud, "discard me")
    with pytest.raises(NotFound):
        outbox_discard(user=member, outbox_id=OutboxMessage.objects.get(message=second).pk)
    discarded = outbox_discard(user=owner, outbox_id=OutboxMessage.objects.get(message=second).pk)
    assert discarded.status == "discarded"
    assert statuses(second) == ["dead"]
    assert AgentMessage.objects.get(pk=second.pk).error == "discarded by alice"
    drain()
    assert remotes.received == [r for r in remotes.received if r[2] != "discard me"]


def test_retention_purges_old_delivered_dead_rows_and_receipts(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes
) -> None:
    delivered = send(owner, sender, cloud, "delivered long ago")
    drain()
    remotes.modes["cloud.test"] = 409
    dead = send(owner, sender, cloud, "dead long ago")
    drain()
    now = timezone.now()
    PeerReceipt.objects.create(peer=cloud, idempotency_key="k", route="messages", body_digest="x")
    assert outbox_purge(now=now + timedelta(days=6)) == {"delivered": 0, "dead": 0, "receipts": 0}
    assert outbox_purge(now=now + timedelta(days=8)) == {"delivered": 1, "dead": 0, "receipts": 0}
    assert outbox_purge(now=now + timedelta(days=31)) == {"delivered": 0, "dead": 1, "receipts": 1}
    assert not OutboxMessage.objects.filter(message__in=[delivered, dead]).exists()
    assert AgentMessage.objects.filter(pk__in=[delivered.pk, dead.pk]).count() == 2  # the messages stay


def test_a_revoked_peer_is_not_drained(owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes) -> None:
    send(owner, sender, cloud, "hi")
    cloud.revoked_at = timezone.now()
    cloud.save()
    assert drain() == []
    assert remotes.received == []


def test_a_backlog_drains_pass_after_pass_without_waiting_for_a_ring(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes
) -> None:
    for n in range(123):
        send(owner, sender, cloud, f"m{n}")
    async_to_sync(outbox_drain._drain_until_idle)(cloud.pk, holder="worker-1")
    assert [content for _, _, content in remotes.delivered] == [f"m{n}" for n in range(123)]


def test_the_loop_drains_each_peer_in_its_own_task_so_a_hanging_peer_delays_no_other(
    owner: Any, sender: Agent, cloud: Any, laptop: Any, remotes: FakeRemotes, monkeypatch: pytest.MonkeyPatch
) -> None:
    hanging = asyncio.Event()
    real_handler = remotes.handler

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "laptop.test":
            await hanging.wait()  # a peer that accepts and never answers
        return await real_handler(request)

    monkeypatch.setattr(
        outbox_drain, "PeerClient", functools.partial(PeerClient, transport=httpx.MockTransport(handler))
    )
    send(owner, sender, laptop, "to the hanging laptop")
    for n in range(3):
        send(owner, sender, cloud, f"cloud {n}")

    async def run() -> None:
        loop_task = asyncio.ensure_future(outbox_drain.outbox_drain_loop())
        try:
            await until(lambda: len(remotes.delivered) == 3, 5)
            # The laptop still hangs; new mail for the cloud goes out on the next ring.
            for n in range(3, 5):
                await database_sync_to_async(send)(owner, sender, cloud, f"cloud {n}")
            await until(lambda: len(remotes.delivered) == 5, 5)
        finally:
            loop_task.cancel()
            hanging.set()
            await asyncio.gather(loop_task, return_exceptions=True)

    async_to_sync(run)()
    assert [content for host, _, content in remotes.delivered if host == "cloud.test"] == [
        f"cloud {n}" for n in range(5)
    ]


def test_mail_that_arrives_while_its_peers_drain_is_running_goes_out_without_waiting_for_the_interval(
    owner: Any, sender: Agent, cloud: Any, remotes: FakeRemotes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ring for "second" comes while the drain is still sending "first" (its pass read
    # its rows before "second" was queued): the loop must not swallow that ring, or
    # "second" waits for the next ring or DRAIN_INTERVAL (found by bench/peers.py: 28 s gaps).
    monkeypatch.setattr(outbox_drain, "DRAIN_INTERVAL", 60.0)
    gate = asyncio.Event()
    entered: list[str] = []
    real_handler = remotes.handler

    async def slow_first(request: httpx.Request) -> httpx.Response:
        entered.append(json.loads(request.content)["content"])
        if entered[-1] == "first":
            await gate.wait()
        return await real_handler(request)

    monkeypatch.setattr(
        outbox_drain, "PeerClient", functools.partial(PeerClient, transport=httpx.MockTransport(slow_first))
    )
    send(owner, sender, cloud, "first")

    async def run() -> None:
        loop_task = asyncio.ensure_future(outbox_drain.outbox_drain_loop())
        try:
            await until(lambda: bool(entered), 4)  # the drain is inside its first POST
            assert entered == ["first"]
            await database_sync_to_async(send)(owner, sender, cloud, "second")  # rings after commit
            await asyncio.sleep(0.5)  # the loop hears the ring while the drain is still running
            gate.set()
            await until(lambda: len(remotes.delivered) == 2, 5)  # against a 60 s DRAIN_INTERVAL
        finally:
            loop_task.cancel()
            gate.set()
            await asyncio.gather(loop_task, return_exceptions=True)

    async_to_sync(run)()
    assert [content for _, _, content in remotes.delivered] == ["first", "second"]


def test_a_drain_the_loop_rang_during_a_short_pass_makes_one_more_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    rung: set[int] = set()
    passes: list[int] = []

    async def fake_pass(peer_id: int, *, holder: str) -> outbox_drain.PeerDrain:
        passes.append(peer_id)
        if len(passes) == 1:
            rung.add(peer_id)  # the loop heard a ring for this peer during the pass
        return outbox_drain.PeerDrain(peer_id=peer_id, delivered=[1])  # a short pass

    monkeypatch.setattr(outbox_drain, "outbox_drain_peer", fake_pass)
    async_to_sync(outbox_drain._drain_until_idle)(7, holder="worker-1", rung=rung)
    assert passes == [7, 7]  # one more pass for the ring, then a short pass nobody rang for
    assert rung == set()
