"""The outbox drain sends batches to a peer that announced ``messages.batch`` (docs/peers.md#message-batches),
and single POSTs to one that did not — checked end to end against this instance's own peer
API: the drain's signed requests go, through ``httpx.MockTransport``, to the real routes
(``POST /api/v1/peers/messages`` and ``…/messages/batch``) of a second link row standing
for the receiving side, in the same database.

The receiving side ("B") knows this instance as the link ``Aye`` (our identity's key, the
token ``Bee`` presents); the sending side's link is ``Bee``, whose shadows stand for B's
agents, which are local agents here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.test import Client
from django.utils import timezone

from agents import services as agent_services
from agents.models import Agent, AgentEvent, AgentMessage
from core import secrets_at_rest
from core.services import generate_token, token_digest
from peers import outbox_drain
from peers.client import PeerClient
from peers.keys import FEATURES_HEADER
from peers.models import OutboxMessage, Peer
from peers.outbox_drain import outbox_drain_peer
from peers.services import incoming as peer_services
from peers.services.identity import identity_get
from peers.services.outgoing import peer_message_send
from peers.services.shadows import shadow_upsert
from tests.agents.conftest import force_status

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = "/api/v1/peers/messages"
BATCH = "/api/v1/peers/messages/batch"
FORWARDED = ("authorization", "idempotency-key", "content-digest", "signature-input", "signature", FEATURES_HEADER)


@dataclass
class LoopBack:
    """The receiving side: every request goes to this instance's own peer API.

    ``announce``: pass B's ``Dispatch-Peer-Features`` back (False: an older instance that
    announces nothing); ``batch_route``: False answers the batch route 404 like an instance
    without it; ``down``: connection refused."""

    announce: bool = True
    batch_route: bool = True
    down: bool = False
    posts: list[tuple[str, int]] = field(default_factory=list)  # (path, messages carried)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        carried = len(httpx.Response(200, content=request.content).json().get("messages", [None]))
        self.posts.append((path, carried))
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if path == BATCH and not self.batch_route:
            return httpx.Response(404, json={"error": {"code": "NOT_FOUND", "message": "no such route"}})
        headers = {name: request.headers[name] for name in FORWARDED if name in request.headers}
        answer = await database_sync_to_async(Client().generic)(
            request.method, path, data=request.content, content_type="application/json", headers=headers
        )
        out = {FEATURES_HEADER: answer[FEATURES_HEADER]} if self.announce and answer.has_header(FEATURES_HEADER) else {}
        return httpx.Response(answer.status_code, headers=out, content=answer.content)

    def paths(self) -> list[str]:
        return [path for path, _ in self.posts]


@pytest.fixture
def loop_back(monkeypatch: pytest.MonkeyPatch) -> LoopBack:
    fake = LoopBack()
    monkeypatch.setattr(
        outbox_drain, "PeerClient", functools.partial(PeerClient, transport=httpx.MockTransport(fake.handler))
    )
    return fake


@dataclass
class Link:
    bee: Peer  # our link to B (the sending side's row)
    targets: list[Agent]  # B's agents (local agents here), all running experts
    sender: Agent  # our agent that sends


@pytest.fixture
def link(owner: Any, tmp_path: Path) -> Link:
    identity = identity_get()
    token = generate_token()
    bee = Peer.objects.create(
        owner=owner,
        instance_id="inst_bbbbbbbbbbbb",
        label="Bee",
        url="http://bee.test",
        public_key="unused",
        fingerprint="unused",
        inbound_digest=token_digest(generate_token()),
        outbound_token_encrypted=secrets_at_rest.encrypt(token.encode()),
        features=["messages.batch"],
    )
    Peer.objects.create(  # B's row for us: our key, the token Bee presents
        owner=owner,
        instance_id=identity.instance_id,
        label="Aye",
        url="http://aye.test",
        public_key=identity.public_key,
        fingerprint=identity.fingerprint,
        inbound_digest=token_digest(token),
        outbound_token_encrypted=secrets_at_rest.encrypt(b"unused"),
    )
    targets = [
        agent_services.agent_create(owner=owner, type="expert", name=f"far-{n}", cwd=str(tmp_path)) for n in range(2)
    ]
    for target in targets:
        shadow_upsert(
            peer=bee, peer_agent_id=target.pk, name=target.name, type="expert", status="running", seen_at=timezone.now()
        )
    sender = agent_services.agent_create(owner=owner, type="expert", name="lead", cwd=str(tmp_path))
    return Link(bee=bee, targets=targets, sender=sender)


def send(owner: Any, link: Link, content: str, to: int = 0) -> AgentMessage:
    return peer_message_send(
        user=owner, sender_agent=link.sender, peer=link.bee, to_agent_id=link.targets[to].pk, content=content
    )


def drain(link: Link) -> outbox_drain.PeerDrain:
    return async_to_sync(outbox_drain_peer)(link.bee.pk, holder="worker-1")


def received() -> list[str]:
    """What B holds: the contents of messages that came from a peer, in arrival order."""
    return list(AgentMessage.objects.filter(sender_peer__isnull=False).order_by("id").values_list("content", flat=True))


def status_of(*messages: AgentMessage) -> list[str]:
    return [AgentMessage.objects.get(pk=message.pk).status for message in messages]


def test_a_peer_that_announced_the_batch_gets_the_rows_in_one_post_in_order(owner, link, loop_back):
    sent = [send(owner, link, f"message {n}", to=n % 2) for n in range(7)]

    report = drain(link)

    assert loop_back.posts == [(BATCH, 7)]
    assert received() == [f"message {n}" for n in range(7)]
    assert report.delivered == [row.pk for row in OutboxMessage.objects.order_by("created_at", "id")]
    assert status_of(*sent) == ["delivered"] * 7
    keys = [m.idempotency_key for m in sent]
    assert (
        list(AgentMessage.objects.filter(sender_peer__isnull=False).values_list("idempotency_key", flat=True)) == keys
    )


def test_the_batch_size_and_the_byte_bound_split_a_pass_into_several_posts(owner, link, loop_back, settings):
    settings.PEER_BATCH_MESSAGES = 3
    for n in range(7):
        send(owner, link, f"message {n}")
    drain(link)
    # The last row alone goes as a single POST, the route every peer has.
    assert loop_back.posts == [(BATCH, 3), (BATCH, 3), (MESSAGES, 1)]

    loop_back.posts.clear()
    settings.PEER_BATCH_MESSAGES = 50
    settings.MAX_REQUEST_BYTES = 1800  # 900 bytes of bodies a batch: two of these (~400 each)
    for n in range(4):
        send(owner, link, f"{n} " + "x" * 200)
    drain(link)
    assert loop_back.posts == [(BATCH, 2), (BATCH, 2)]
    assert received()[-4:] == [f"{n} " + "x" * 200 for n in range(4)]


def test_a_peer_that_announced_nothing_gets_single_posts(owner, link, loop_back):
    Peer.objects.filter(pk=link.bee.pk).update(features=[])
    loop_back.announce = False  # an older instance: no header in its answers either

    sent = [send(owner, link, f"message {n}") for n in range(4)]
    drain(link)

    assert loop_back.paths() == [MESSAGES] * 4
    assert received() == [f"message {n}" for n in range(4)]
    assert status_of(*sent) == ["delivered"] * 4
    assert Peer.objects.get(pk=link.bee.pk).features == []


def test_a_peer_that_announces_the_feature_in_an_answer_gets_batches_from_the_next_pass(owner, link, loop_back):
    Peer.objects.filter(pk=link.bee.pk).update(features=[])  # linked before it was upgraded
    for n in range(3):
        send(owner, link, f"first {n}")
    drain(link)
    assert loop_back.paths() == [MESSAGES] * 3
    assert Peer.objects.get(pk=link.bee.pk).features == ["messages.batch"]

    loop_back.posts.clear()
    for n in range(3):
        send(owner, link, f"then {n}")
    drain(link)
    assert loop_back.posts == [(BATCH, 3)]
    assert received() == [f"first {n}" for n in range(3)] + [f"then {n}" for n in range(3)]


def test_a_peer_that_no_longer_serves_the_batch_route_gets_the_rows_one_by_one_in_the_same_pass(owner, link, loop_back):
    loop_back.batch_route = False
    loop_back.announce = False
    sent = [send(owner, link, f"message {n}") for n in range(3)]

    drain(link)

    assert loop_back.paths() == [BATCH, MESSAGES, MESSAGES, MESSAGES]
    assert received() == [f"message {n}" for n in range(3)]
    assert status_of(*sent) == ["delivered"] * 3
    assert Peer.objects.get(pk=link.bee.pk).features == []  # its 404 announced nothing


def test_a_replayed_batch_is_answered_from_the_receipts_and_delivered_once(owner, link, loop_back):
    sent = [send(owner, link, f"message {n}") for n in range(3)]
    drain(link)
    # A crash between sending and marking: the rows are queued again and the batch resent.
    OutboxMessage.objects.update(status="queued", delivered_at=None)
    AgentMessage.objects.filter(pk__in=[m.pk for m in sent]).update(status="queued", delivered_at=None)

    report = drain(link)

    assert loop_back.posts == [(BATCH, 3), (BATCH, 3)]
    assert len(report.delivered) == 3
    assert received() == [f"message {n}" for n in range(3)]  # once each
    assert status_of(*sent) == ["delivered"] * 3


def test_a_permanent_refusal_is_dead_lettered_and_the_rest_of_the_batch_delivered(owner, link, loop_back):
    sent = [send(owner, link, f"message {n}", to=n % 2) for n in range(5)]
    force_status(link.targets[1], "stopped")  # messages 1 and 3 are refused for good (409)

    report = drain(link)

    assert loop_back.posts == [(BATCH, 5)]
    assert received() == ["message 0", "message 2", "message 4"]
    assert status_of(*sent) == ["delivered", "dead", "delivered", "dead", "delivered"]
    assert len(report.delivered) == 3 and len(report.dead) == 2 and not report.deferred
    dead = OutboxMessage.objects.get(message=sent[1])
    assert dead.last_error.startswith("409: ") and "not running" in dead.last_error
    told = AgentEvent.objects.filter(agent=link.sender, type="system", message__contains="could not be delivered")
    assert told.count() == 2


def test_a_transient_failure_stops_the_pass_at_that_message_and_order_is_kept(owner, link, loop_back, monkeypatch):
    real = peer_services.peer_message_here

    def flaky(*, peer: Peer, message: Any, idempotency_key: str) -> AgentMessage:
        if message.content == "message 2":
            raise RuntimeError("database went away")
        return real(peer=peer, message=message, idempotency_key=idempotency_key)

    monkeypatch.setattr(peer_services, "peer_message_here", flaky)
    sent = [send(owner, link, f"message {n}") for n in range(5)]

    report = drain(link)

    assert received() == ["message 0", "message 1"]
    assert status_of(*sent) == ["delivered", "delivered", "queued", "queued", "queued"]
    rows = {row.message_id: row for row in OutboxMessage.objects.all()}
    assert rows[sent[2].pk].attempts == 1 and "503" in rows[sent[2].pk].last_error
    assert [rows[m.pk].attempts for m in sent[3:]] == [0, 0]  # not attempted: they wait behind it
    assert report.deferred == [rows[sent[2].pk].pk]

    monkeypatch.setattr(peer_services, "peer_message_here", real)
    OutboxMessage.objects.filter(status="queued").update(next_attempt_at=timezone.now())
    drain(link)
    assert received() == [f"message {n}" for n in range(5)]
    assert status_of(*sent) == ["delivered"] * 5


def test_an_unreachable_peer_defers_the_first_row_of_the_batch_only(owner, link, loop_back):
    loop_back.down = True
    sent = [send(owner, link, f"message {n}") for n in range(3)]

    report = drain(link)

    assert loop_back.posts == [(BATCH, 3)]
    rows = [OutboxMessage.objects.get(message=m) for m in sent]
    assert [row.attempts for row in rows] == [1, 0, 0]
    assert report.deferred == [rows[0].pk]
    assert "could not be reached" in rows[0].last_error
    assert status_of(*sent) == ["queued"] * 3


def test_the_drain_loop_delivers_a_backlog_in_batches(owner, link, loop_back):
    for n in range(120):
        send(owner, link, f"message {n}")

    async def until_idle() -> None:
        await outbox_drain._drain_until_idle(link.bee.pk, holder="worker-1")

    async_to_sync(until_idle)()

    assert [carried for _, carried in loop_back.posts] == [50, 50, 20]
    assert received() == [f"message {n}" for n in range(120)]
