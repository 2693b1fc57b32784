"""Peer rows: live labels unique case-insensitively, one live link per instance id."""

from __future__ import annotations

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
