"""``GET /api/v1/peers/events`` (docs/peers.md#events): what a peer may see, in order.

The first tests drive the stream's frame generator in-process (with the in-memory channel
layer) to control the moment between subscribing and the snapshot; the last ones go
through a real ``manage.py serve`` with a signed request, as a peer would.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.utils import timezone

from agents.models import Agent
from agents.services import agent_create, agent_event_record, agent_set_status
from peers import stream
from peers.models import Peer

AGENT_KEYS = {"id", "name", "type", "status", "parent_id", "launched_by", "updated_at"}


def parse(raw: str) -> dict[str, Any]:
    frame: dict[str, Any] = {}
    for line in raw.strip().splitlines():
        field, _, value = line.partition(": ")
        frame[field] = json.loads(value) if field == "data" else value
    return frame


async def next_frame(frames: AsyncIterator[str], timeout: float = 5) -> dict[str, Any]:
    while True:
        raw = await asyncio.wait_for(anext(frames), timeout)
        if not raw.startswith(":"):
            return parse(raw)


def make_local(owner: User, name: str, **fields: Any) -> Agent:
    return agent_create(owner=owner, type="expert", name=name, cwd="/tmp", **fields)


def make_shadow(owner: User, peer: Peer, name: str) -> Agent:
    return Agent.objects.create(
        owner=owner, name=name, type="shell", status="running", cwd="", peer=peer, peer_agent_id="ag_remote1"
    )


@pytest.mark.django_db(transaction=True)
async def test_a_change_made_while_the_snapshot_is_built_arrives_after_it(owner, member, make_peer, monkeypatch):
    fake = await database_sync_to_async(make_peer)(owner)
    peer, agent = fake.peer, await database_sync_to_async(make_local)(owner, "worker")
    original = stream.peer_snapshot

    def snapshot_then_change(peer: Peer) -> dict[str, Any]:
        snapshot = original(peer)  # rows read: the snapshot says "running"
        agent_set_status(agent=agent, status="stopped")  # ...and the agent stops before it is sent
        return snapshot

    monkeypatch.setattr(stream, "peer_snapshot", snapshot_then_change)
    frames = await stream.peer_events_open(peer)
    try:
        first = await next_frame(frames)
        assert (first["id"], first["event"]) == ("0", "snapshot")
        assert [(a["id"], a["status"]) for a in first["data"]["agents"]] == [(agent.pk, "running")]
        second = await next_frame(frames)
        assert (second["id"], second["event"]) == ("1", "agent.upsert")
        assert (second["data"]["id"], second["data"]["status"]) == (agent.pk, "stopped")
    finally:
        await frames.aclose()  # type: ignore[attr-defined]


@pytest.mark.django_db(transaction=True)
async def test_only_the_link_users_local_agents_in_the_scoped_shape(owner, member, make_peer):
    fake = await database_sync_to_async(make_peer)(owner)
    peer = fake.peer
    mine = await database_sync_to_async(make_local)(owner, "mine")
    child = await database_sync_to_async(make_local)(owner, "child", parent=mine, launched_by=mine)
    await database_sync_to_async(agent_event_record)(agent=mine, type="working", message="building")
    await database_sync_to_async(make_local)(member, "someone else's")
    await database_sync_to_async(make_shadow)(owner, peer, "a shadow")
    archived = await database_sync_to_async(make_local)(owner, "archived")
    await database_sync_to_async(agent_set_status)(agent=archived, status="archived")
    frames = await stream.peer_events_open(peer)
    try:
        snapshot = (await next_frame(frames))["data"]
        by_name = {a["name"]: a for a in snapshot["agents"]}
        assert set(by_name) == {"mine", "child"}
        assert set(by_name["child"]) == AGENT_KEYS | {"latest_event"}
        assert (by_name["child"]["parent_id"], by_name["child"]["launched_by"]) == (mine.pk, mine.pk)
        assert by_name["child"]["latest_event"] is None  # shared, but nothing yet
        assert by_name["mine"]["latest_event"]["type"] == "working"
        assert by_name["mine"]["latest_event"]["message"] == "building"
        # Live: a shadow's and another user's changes never come through; ours do.
        await database_sync_to_async(make_shadow)(owner, peer, "another shadow")
        await database_sync_to_async(make_local)(member, "member again")
        await database_sync_to_async(agent_event_record)(agent=child, type="done", message="finished")
        upsert = await next_frame(frames)
        assert upsert["event"] == "agent.upsert"
        assert upsert["data"]["id"] == child.pk
        assert set(upsert["data"]) == AGENT_KEYS | {"latest_event"}
        assert upsert["data"]["latest_event"]["message"] == "finished"
    finally:
        await frames.aclose()  # type: ignore[attr-defined]


@pytest.mark.django_db(transaction=True)
async def test_without_allow_events_the_latest_event_key_is_absent(owner, make_peer):
    fake = await database_sync_to_async(make_peer)(owner, allow_events=False)
    mine = await database_sync_to_async(make_local)(owner, "mine")
    await database_sync_to_async(agent_event_record)(agent=mine, type="working", message="secret plans")
    frames = await stream.peer_events_open(fake.peer)
    try:
        (item,) = (await next_frame(frames))["data"]["agents"]
        assert set(item) == AGENT_KEYS
        await database_sync_to_async(agent_event_record)(agent=mine, type="done", message="more secrets")
        upsert = await next_frame(frames)
        assert set(upsert["data"]) == AGENT_KEYS
        assert "secret" not in json.dumps(upsert)
    finally:
        await frames.aclose()  # type: ignore[attr-defined]


@pytest.mark.django_db(transaction=True)
async def test_a_snapshot_that_cannot_be_built_closes_the_stream(owner, make_peer, monkeypatch):
    fake = await database_sync_to_async(make_peer)(owner)

    def broken(peer: Peer) -> dict[str, Any]:
        raise RuntimeError("database went away")

    monkeypatch.setattr(stream, "peer_snapshot", broken)
    frames = await stream.peer_events_open(fake.peer)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(frames), 5)


# --- through a real server -------------------------------------------------------------------


def _signed_get(url: str, *, token: str, private_key: Any, keyid: str) -> httpx.Request:
    from peers.auth import sign_request_with_key

    request = httpx.Request("GET", url, headers={"Authorization": f"Bearer {token}", "Accept": "text/event-stream"})
    sign_request_with_key(request, private_key=private_key, keyid=keyid)
    return request


def _link_on(inst: Any, *, public_key: str, token: str, allow_events: bool = True) -> None:
    """Insert, in a served instance's database, a peer that presents ``token`` signed by ``public_key``."""
    inst.manage(
        "shell",
        "-c",
        "from django.contrib.auth import get_user_model; from core.services import token_digest; "
        "from peers.keys import fingerprint_of; from peers.models import Peer; "
        "admin = get_user_model().objects.get(username='admin'); "
        f"Peer.objects.create(owner=admin, instance_id='inst_00000000aaaa', label='A', url='http://127.0.0.1:9', "
        f"public_key={public_key!r}, fingerprint=fingerprint_of({public_key!r}), "
        f"inbound_digest=token_digest({token!r}), inbound_prefix={token[:8]!r}, outbound_token_encrypted='x', "
        f"allow_events={allow_events!r})",
    )


def _read_frames(lines: Iterator[str], count: int, deadline: float) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    for line in lines:
        if time.monotonic() > deadline:
            break
        if line.startswith(":"):
            continue
        if not line:
            if current:
                frames.append(current)
                current = {}
                if len(frames) == count:
                    break
            continue
        field, _, value = line.partition(": ")
        current[field] = json.loads(value) if field == "data" else value
    return frames


@pytest.mark.integration
def test_a_signed_peer_gets_the_snapshot_then_upserts_through_serve():
    from tests.infra import instance
    from tests.peers.conftest import new_key_pair

    private, public = new_key_pair()
    token = "peer-token-" + "x" * 30
    with instance() as inst:
        server = inst.serve()
        _link_on(inst, public_key=public, token=token)
        from peers.keys import fingerprint_of

        keyid = fingerprint_of(public)
        headers = {"Authorization": f"Bearer {inst.admin_token}"}
        created = httpx.post(
            f"{server.url}/api/v1/agents", json={"type": "expert", "name": "before", "cwd": "/tmp"}, headers=headers
        )
        assert created.status_code == 201, created.text
        with httpx.Client(timeout=10) as client:
            unsigned = client.get(f"{server.url}/api/v1/peers/events", headers={"Authorization": f"Bearer {token}"})
            assert unsigned.status_code == 401
            wrong_token = client.send(
                _signed_get(f"{server.url}/api/v1/peers/events", token="nope", private_key=private, keyid=keyid)
            )
            assert wrong_token.status_code == 401
            assert "invalid_token" in wrong_token.headers.get("WWW-Authenticate", "")
            request = _signed_get(f"{server.url}/api/v1/peers/events", token=token, private_key=private, keyid=keyid)
            response = client.send(request, stream=True)
            try:
                assert response.status_code == 200, response.read()
                assert response.headers["content-type"].startswith("text/event-stream")
                lines = response.iter_lines()
                (snapshot,) = _read_frames(lines, 1, time.monotonic() + 10)
                assert (snapshot["id"], snapshot["event"]) == ("0", "snapshot")
                assert [a["name"] for a in snapshot["data"]["agents"]] == ["before"]
                after = httpx.post(
                    f"{server.url}/api/v1/agents",
                    json={"type": "expert", "name": "after", "cwd": "/tmp"},
                    headers=headers,
                )
                assert after.status_code == 201, after.text
                (upsert,) = _read_frames(lines, 1, time.monotonic() + 10)
                assert (upsert["id"], upsert["event"]) == ("1", "agent.upsert")
                assert upsert["data"]["name"] == "after"
                assert set(upsert["data"]) == AGENT_KEYS | {"latest_event"}
            finally:
                response.close()


@pytest.mark.django_db(transaction=True)
async def test_a_revoked_link_ends_the_stream_at_the_next_keep_alive(owner, make_peer, monkeypatch):
    monkeypatch.setattr(stream, "KEEPALIVE_SECONDS", 0.1)
    fake = await database_sync_to_async(make_peer)(owner)
    frames = await stream.peer_events_open(fake.peer)
    assert parse(await asyncio.wait_for(anext(frames), 5))["event"] == "snapshot"
    assert (await asyncio.wait_for(anext(frames), 5)).startswith(": keep-alive")
    await database_sync_to_async(Peer.objects.filter(pk=fake.peer.pk).update)(revoked_at=timezone.now())
    with pytest.raises(StopAsyncIteration):
        while True:
            await asyncio.wait_for(anext(frames), 5)


@pytest.mark.django_db(transaction=True)
async def test_switching_events_off_or_unlinking_takes_effect_on_a_busy_stream(owner, make_peer, monkeypatch):
    monkeypatch.setattr(stream, "LINK_RECHECK_SECONDS", 0.0)  # re-read the link before every frame
    fake = await database_sync_to_async(make_peer)(owner)
    mine = await database_sync_to_async(make_local)(owner, "mine")
    frames = await stream.peer_events_open(fake.peer)
    try:
        assert (await next_frame(frames))["event"] == "snapshot"
        await database_sync_to_async(agent_event_record)(agent=mine, type="working", message="shared")
        assert (await next_frame(frames))["data"]["latest_event"]["message"] == "shared"

        await database_sync_to_async(Peer.objects.filter(pk=fake.peer.pk).update)(allow_events=False)
        await database_sync_to_async(agent_event_record)(agent=mine, type="done", message="private now")
        upsert = await next_frame(frames)
        assert "latest_event" not in upsert["data"] and "private" not in json.dumps(upsert)

        await database_sync_to_async(Peer.objects.filter(pk=fake.peer.pk).update)(revoked_at=timezone.now())
        await database_sync_to_async(agent_event_record)(agent=mine, type="working", message="after unlink")
        with pytest.raises(StopAsyncIteration):  # ends before sending anything more
            await next_frame(frames)
    finally:
        await frames.aclose()  # type: ignore[attr-defined]
