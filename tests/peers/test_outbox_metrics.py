"""The outbox in ``/metrics`` (docs/metrics.md#families; what operators see of it,
docs/peers.md#the-outbox): per linked instance, the queued rows, the age of the oldest, the dead ones."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from agents.models import Agent, AgentMessage
from agents.services import agent_create
from peers.models import OutboxMessage, Peer
from tests.scrape import has, scrape_sync, value

pytestmark = pytest.mark.django_db(transaction=True)


def queue(owner: Any, peer: Peer, *, age: timedelta, status: str = "queued") -> OutboxMessage:
    """An outbox row to ``peer`` made ``age`` ago (a read-only test: the rows, not the sending)."""
    sender = Agent.objects.filter(owner=owner).first() or agent_create(owner=owner, type="expert", name="lead", cwd="/")
    message = AgentMessage.objects.create(sender_agent=sender, recipient_agent=sender, peer=peer, content="hi")
    return OutboxMessage.objects.create(
        peer=peer,
        message=message,
        to_agent_id="agt_0123456789ab",
        payload={},
        status=status,
        created_at=timezone.now() - age,
    )


def test_the_outbox_depth_and_the_age_of_its_oldest_row_are_shown_per_peer(owner: Any, make_peer: Any) -> None:
    cloud, laptop = make_peer(owner, label="Cloud").peer, make_peer(owner, label="Laptop").peer
    cloud_labels = {"peer_id": str(cloud.pk), "peer": "Cloud"}
    laptop_labels = {"peer_id": str(laptop.pk), "peer": "Laptop"}
    samples = scrape_sync()
    assert has(samples, "dispatch_outbox_depth", **cloud_labels)  # a live peer is listed with 0
    assert value(samples, "dispatch_outbox_depth", **cloud_labels) == 0

    queue(owner, cloud, age=timedelta(seconds=90))
    queue(owner, cloud, age=timedelta(seconds=10))
    queue(owner, cloud, age=timedelta(hours=2), status="delivered")  # gone: neither depth nor age
    queue(owner, laptop, age=timedelta(hours=1), status="dead")
    samples = scrape_sync()
    assert value(samples, "dispatch_outbox_depth", **cloud_labels) == 2
    assert 90 <= value(samples, "dispatch_outbox_oldest_age_seconds", **cloud_labels) < 120
    assert value(samples, "dispatch_outbox_dead", **cloud_labels) == 0
    assert value(samples, "dispatch_outbox_depth", **laptop_labels) == 0
    assert value(samples, "dispatch_outbox_oldest_age_seconds", **laptop_labels) == 0
    assert value(samples, "dispatch_outbox_dead", **laptop_labels) == 1


def test_a_revoked_peer_is_listed_while_rows_wait_for_it(owner: Any, make_peer: Any) -> None:
    gone = make_peer(owner, label="Gone").peer
    Peer.objects.filter(pk=gone.pk).update(revoked_at=timezone.now())
    labels = {"peer_id": str(gone.pk), "peer": "Gone"}
    assert not has(scrape_sync(), "dispatch_outbox_depth", **labels)
    queue(owner, gone, age=timedelta(seconds=5))
    assert value(scrape_sync(), "dispatch_outbox_depth", **labels) == 1
