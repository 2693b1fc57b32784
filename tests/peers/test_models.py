"""Peer rows: live labels unique case-insensitively, one live link per instance id."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone


def test_live_labels_are_unique_whatever_the_case(owner: Any, make_peer: Any) -> None:
    make_peer(owner, label="Cloud")
    with pytest.raises(IntegrityError), transaction.atomic():
        make_peer(owner, label="cLOUD")


def test_a_revoked_peer_frees_its_label_and_instance_slot(owner: Any, make_peer: Any) -> None:
    first = make_peer(owner, label="Cloud")
    first.peer.revoked_at = timezone.now()
    first.peer.save()
    again = make_peer(owner, label="cloud", instance_id=first.instance_id)
    assert again.peer.pk != first.peer.pk


def test_one_live_link_per_instance_id(owner: Any, make_peer: Any) -> None:
    first = make_peer(owner, label="A")
    with pytest.raises(IntegrityError), transaction.atomic():
        make_peer(owner, label="B", instance_id=first.instance_id)


def test_a_peer_responds_when_seen_within_five_minutes(owner: Any, make_peer: Any) -> None:
    from peers.models import NOT_RESPONDING_AFTER

    now = timezone.now()
    peer = make_peer(owner, label="Cloud", last_seen_at=None).peer
    assert not peer.responding(now)
    peer.last_seen_at = now - NOT_RESPONDING_AFTER
    assert peer.responding(now)
    peer.last_seen_at = now - NOT_RESPONDING_AFTER - timedelta(seconds=1)
    assert not peer.responding(now)


def test_a_launch_refusal_says_why_a_peer_cannot_be_launched_on(owner: Any, make_peer: Any) -> None:
    peer = make_peer(owner, label="Cloud").peer
    assert peer.launch_refusal() == ""
    peer.granted_by_peer = {"allow_launch": False}
    assert peer.launch_refusal() == "launching not permitted"
    peer.granted_by_peer = ["not", "a", "grant"]
    assert peer.launch_refusal() == ""
    peer.unlinked_by_peer = True
    assert peer.launch_refusal() == "unlinked by the other side"
