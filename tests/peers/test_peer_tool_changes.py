"""A change of a user's linked instances rings the user's tool-list doorbell
(``dispatch_launch_agent``'s description lists them, docs/mcp.md#tools), so MCP clients
hear ``notifications/tools/list_changed``: relabelling, changing capabilities, unlinking."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from core.tool_changes import tools_group
from peers.pairing_exchange import peer_unlink
from peers.services.links import peer_capabilities_set, peer_rename
from tests.peers.conftest import FakePeer


def rings(user_id: int, change: Callable[[], Any], capture: Any) -> int:
    """How many rings ``user_id``'s group hears when ``change`` commits."""
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(tools_group(user_id), channel)
    with capture(execute=True):
        change()
    heard = 0

    async def receive_all() -> None:
        nonlocal heard
        while True:
            try:
                async with asyncio.timeout(0.2):
                    message = await layer.receive(channel)
            except TimeoutError:
                return
            heard += message["type"] == "tools.changed"

    async_to_sync(receive_all)()
    return heard


@pytest.mark.django_db
def test_relabelling_recapping_and_unlinking_a_peer_ring_its_owners_tool_list(
    owner: Any, make_peer: Callable[..., FakePeer], django_capture_on_commit_callbacks: Any
) -> None:
    peer = make_peer(owner).peer
    assert (
        rings(
            owner.pk,
            lambda: peer_rename(user=owner, peer_id=peer.pk, label="Elsewhere"),
            django_capture_on_commit_callbacks,
        )
        == 1
    )
    assert (
        rings(
            owner.pk,
            lambda: peer_capabilities_set(user=owner, peer_id=peer.pk, allow_launch=False),
            django_capture_on_commit_callbacks,
        )
        == 1
    )
    assert (
        rings(
            owner.pk, lambda: peer_unlink(user=owner, peer_id=peer.pk, notify=False), django_capture_on_commit_callbacks
        )
        == 1
    )
