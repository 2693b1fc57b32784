"""The launching side of peers (docs/peers.md#using-a-link): locations, launching on
a peer with its local shadow, messages to agents on peers by address or through their shadow,
and forwarding a shadow's stop and archive.

The peer is a fake behind ``httpx.MockTransport`` speaking the peer API's answers
(``/api/v1/peers/launch``, ``/repos``, ``/agents/{id}/stop|archive``, ``/messages``).
"""

from __future__ import annotations

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

from agents.models import Agent, AgentMessage
from agents.services import agent_create
from agents.tools import agent_tools
from core.errors import DispatchError, InvalidRequest, NotFound
from peers import outbox_drain, remote_launch
from peers.client import PeerClient
from peers.models import OutboxMessage
from peers.outbox_drain import outbox_drain_once
from peers.remote_launch import location_resolve, peer_address_parse
from peers.services import outgoing
from peers.services.shadows import shadow_upsert
from tests.agents.conftest import Api, error_of

pytestmark = pytest.mark.django_db(transaction=True)

REMOTE_ID = "agt_00000000abcd"


@dataclass
class FakePeerApi:
    """The peer's API as far as the launching side uses it."""

    roots: list[str] = field(default_factory=lambda: ["/srv/repos"])
    launch_answer: tuple[int, dict[str, Any]] = (201, {"agent_id": REMOTE_ID, "name": "far", "status": "creating"})
    stop_status: int = 200
    archive_status: int = 200
    requests: list[httpx.Request] = field(default_factory=list)

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/api/v1/peers/repos":
            return httpx.Response(200, json={"roots": self.roots})
        if path == "/api/v1/peers/launch":
            return httpx.Response(self.launch_answer[0], json=self.launch_answer[1])
        if path.endswith("/stop") and self.stop_status != 200:
            refusal = {"code": "CAPABILITY_NOT_GRANTED", "message": "launch is not permitted for this peer"}
            return httpx.Response(self.stop_status, json={"error": refusal})
        if path.endswith("/stop"):
            return httpx.Response(self.stop_status, json={"agent_id": REMOTE_ID, "name": "far", "status": "stopping"})
        if path.endswith("/archive"):
            return httpx.Response(
                self.archive_status, json={"agent_id": REMOTE_ID, "name": "far", "status": "archived"}
            )
        if path == "/api/v1/peers/messages":
            return httpx.Response(409, json={"error": {"code": "CONFLICT", "message": "agent is not running"}})
        return httpx.Response(404, json={"error": {"code": "NOT_FOUND", "message": "no route"}})

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.url.path == path]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakePeerApi:
    api = FakePeerApi()
    client = functools.partial(PeerClient, transport=httpx.MockTransport(api.handler))
    monkeypatch.setattr(remote_launch, "PeerClient", client)
    monkeypatch.setattr(outbox_drain, "PeerClient", client)
    return api


@pytest.fixture
def cloud(owner: Any, make_peer: Any) -> Any:
    return make_peer(owner, label="Cloud", url="http://cloud.test", last_seen_at=timezone.now()).peer


@pytest.fixture
def reported(cloud: Any) -> Agent:
    """The shadow of Cloud's agent ``REMOTE_ID``, as the mirror would have reported it."""
    return shadow_upsert(
        peer=cloud, peer_agent_id=REMOTE_ID, name="far", type="shell", status="running", seen_at=timezone.now()
    )


@pytest.fixture
def launcher(owner: Any, tmp_path: Any) -> Agent:
    return agent_create(owner=owner, type="expert", name="lead", cwd=str(tmp_path))


async def atools(user: Any, caller: Agent | None) -> dict[str, Any]:
    return {tool.name: tool for tool in await agent_tools(user=user, caller_agent=caller)}


def tools(user: Any, caller: Agent | None) -> dict[str, Any]:
    return async_to_sync(atools)(user, caller)


# --- locations ---------------------------------------------------------------------------------


def test_a_location_is_a_label_or_an_instance_id_whatever_the_case(owner: Any, make_peer: Any) -> None:
    cloud = make_peer(owner, label="Cloud", instance_id="inst_00000000aaaa").peer
    assert location_resolve(user=owner, location="cloud") == cloud
    assert location_resolve(user=owner, location="CLOUD") == cloud
    assert location_resolve(user=owner, location="INST_00000000AAAA") == cloud


def test_an_ambiguous_location_lists_the_matches(owner: Any, make_peer: Any) -> None:
    make_peer(owner, label="inst_00000000bbbb", instance_id="inst_00000000aaaa")
    make_peer(owner, label="Other", instance_id="inst_00000000bbbb")
    with pytest.raises(InvalidRequest) as refused:
        location_resolve(user=owner, location="inst_00000000bbbb")
    assert "ambiguous" in refused.value.message
    assert "inst_00000000bbbb (inst_00000000aaaa)" in refused.value.message
    assert "Other (inst_00000000bbbb)" in refused.value.message


def test_another_users_peer_is_no_location(owner: Any, member: Any, make_peer: Any) -> None:
    make_peer(member, label="Bobs")
    mine = make_peer(owner, label="Mine").peer
    with pytest.raises(InvalidRequest) as refused:
        location_resolve(user=owner, location="bobs")
    assert "no linked instance 'bobs'" in refused.value.message and "Mine" in refused.value.message
    assert peer_address_parse(user=owner, target="Bobs:agt_0123456789ab") is None
    assert peer_address_parse(user=owner, target="mine:agt_0123456789ab") == (mine, "agt_0123456789ab")


def test_a_revoked_peer_is_no_location(owner: Any, make_peer: Any) -> None:
    make_peer(owner, label="Gone", revoked_at=timezone.now())
    with pytest.raises(InvalidRequest):
        location_resolve(user=owner, location="gone")


# --- launching ---------------------------------------------------------------------------------


async def test_launching_on_a_peer_creates_a_shadow_seeded_from_the_answer(
    owner: Any, cloud: Any, launcher: Agent, fake: FakePeerApi
) -> None:
    arguments = {"name": "far", "prompt": "build it", "type": "claude", "cwd": "/srv/repos/app", "location": "cloud"}
    launched = await (await atools(owner, launcher))["dispatch_launch_agent"](arguments)

    [body] = fake.bodies("/api/v1/peers/launch")
    request = next(r for r in fake.requests if r.url.path == "/api/v1/peers/launch")
    assert request.headers["idempotency-key"] and "signature" in request.headers
    assert body["name"] == "far" and body["prompt"] == "build it" and body["cwd"] == "/srv/repos/app"
    assert body["type"] == "claude" and body["child"] is True and body["full_access"] is False
    assert body["launched_by"]["agent_id"] == launcher.pk and body["launched_by"]["name"] == "lead"
    shadow = await database_sync_to_async(Agent.objects.get)(pk=launched["id"])
    assert shadow.pk != REMOTE_ID and shadow.peer_id == cloud.pk and shadow.peer_agent_id == REMOTE_ID
    assert (shadow.owner_id, shadow.status, shadow.type, shadow.cwd) == (
        owner.pk,
        "creating",
        "claude",
        "/srv/repos/app",
    )
    assert shadow.parent_id == launcher.pk and shadow.launched_by_id == launcher.pk


async def test_a_launch_without_child_records_the_launcher_but_no_parent(
    owner: Any, cloud: Any, launcher: Agent, fake: FakePeerApi
) -> None:
    arguments = {"name": "far", "prompt": "", "cwd": "/srv/repos/app", "location": "Cloud", "child": False}
    launched = await (await atools(owner, launcher))["dispatch_launch_agent"](arguments)
    shadow = await database_sync_to_async(Agent.objects.get)(pk=launched["id"])
    assert (shadow.parent_id, shadow.launched_by_id) == (None, launcher.pk)
    assert "type" not in fake.bodies("/api/v1/peers/launch")[0]


async def test_a_shadow_the_mirror_created_first_keeps_the_mirrors_status(
    owner: Any, cloud: Any, launcher: Agent, fake: FakePeerApi
) -> None:
    early = await database_sync_to_async(shadow_upsert)(
        peer=cloud, peer_agent_id=REMOTE_ID, name="far", type="claude", status="running", seen_at=timezone.now()
    )
    arguments = {"name": "far", "prompt": "", "cwd": "/srv/repos/app", "location": "cloud"}
    launched = await (await atools(owner, launcher))["dispatch_launch_agent"](arguments)
    assert launched["id"] == early.pk
    shadow = await database_sync_to_async(Agent.objects.get)(pk=early.pk)
    assert shadow.status == "running" and shadow.launched_by_id == launcher.pk
    assert await database_sync_to_async(Agent.objects.filter(peer=cloud).count)() == 1


async def test_a_launch_on_a_peer_needs_a_cwd_and_names_the_peers_roots(
    owner: Any, cloud: Any, launcher: Agent, fake: FakePeerApi
) -> None:
    fake.roots = ["/srv/repos", "/home/dev/src"]
    with pytest.raises(InvalidRequest) as refused:
        await remote_launch.peer_launch(
            user=owner, caller_agent=launcher, location="cloud", name="far", prompt="", type=None, cwd=None,
            child=True, full_access=False,
        )  # fmt: skip
    assert "cwd is required to launch on Cloud" in refused.value.message
    assert "/srv/repos, /home/dev/src" in refused.value.message
    assert fake.bodies("/api/v1/peers/launch") == []


async def test_the_peers_refusal_comes_back_with_its_code(
    owner: Any, cloud: Any, launcher: Agent, fake: FakePeerApi
) -> None:
    message = "launch is not permitted for this peer"
    fake.launch_answer = (403, {"error": {"code": "CAPABILITY_NOT_GRANTED", "message": message, "details": {}}})
    arguments = {"name": "far", "prompt": "", "cwd": "/srv/repos/app", "location": "cloud"}
    with pytest.raises(DispatchError) as refused:
        await (await atools(owner, launcher))["dispatch_launch_agent"](arguments)
    assert refused.value.code == "CAPABILITY_NOT_GRANTED" and message in refused.value.message
    assert not await database_sync_to_async(Agent.objects.filter(peer=cloud).exists)()


async def test_an_unreachable_peer_is_a_remote_error(owner: Any, launcher: Agent, make_peer: Any) -> None:
    await database_sync_to_async(make_peer)(owner, label="Dark", url="http://127.0.0.1:9")
    arguments = {"name": "far", "prompt": "", "cwd": "/srv/repos/app", "location": "dark"}
    with pytest.raises(DispatchError) as refused:
        await (await atools(owner, launcher))["dispatch_launch_agent"](arguments)
    assert refused.value.code == "REMOTE_ERROR" and "could not be reached" in refused.value.message


def test_the_launch_description_lists_linked_instances_with_their_flags(owner: Any, make_peer: Any) -> None:
    assert "omit location to launch locally" in tools(owner, None)["dispatch_launch_agent"].description
    make_peer(owner, label="Cloud", instance_id="inst_00000000aaaa", last_seen_at=timezone.now())
    make_peer(
        owner, label="Laptop", instance_id="inst_00000000bbbb", last_seen_at=timezone.now() - timedelta(minutes=6)
    )
    make_peer(owner, label="Box", instance_id="inst_00000000cccc", last_seen_at=timezone.now(),
              granted_by_peer={"allow_launch": False})  # fmt: skip
    description = tools(owner, None)["dispatch_launch_agent"].description
    assert "Cloud (inst_00000000aaaa)" in description
    assert "Laptop (inst_00000000bbbb, not responding recently)" in description
    assert "Box (inst_00000000cccc, launching not permitted)" in description
    assert "omit it to launch here" in description


async def test_the_description_is_built_from_async_code_too(owner: Any, make_peer: Any) -> None:
    await database_sync_to_async(make_peer)(owner, label="Cloud", instance_id="inst_00000000aaaa")
    assert (
        "Cloud (inst_00000000aaaa, not responding recently)"
        in (await atools(owner, None))["dispatch_launch_agent"].description
    )


# --- messages ----------------------------------------------------------------------------------


async def test_a_peer_address_is_recognised_by_shape(
    owner: Any, cloud: Any, launcher: Agent, tmp_path: Any, reported: Agent
) -> None:
    local = await database_sync_to_async(agent_create)(
        owner=owner, type="expert", name="fix: sse race", cwd=str(tmp_path)
    )
    send = (await atools(owner, launcher))["dispatch_send_message"]

    by_label = await send({"target": f"cloud:{REMOTE_ID}", "message": "hi"})
    by_id = await send({"target": f"{cloud.instance_id.upper()}:{REMOTE_ID}", "message": "again"})
    named = await send({"target": "fix: sse race", "message": "local"})

    assert (by_label["status"], by_label["peer"], by_label["remote_agent_id"]) == ("queued", "Cloud", REMOTE_ID)
    assert by_id["peer"] == "Cloud" and by_id["recipient"] == by_label["recipient"] == reported.pk
    assert named["recipient"] == local.pk and "peer" not in named
    rows = await database_sync_to_async(
        lambda: list(OutboxMessage.objects.order_by("id").values_list("payload", flat=True))
    )()
    assert [row["content"] for row in rows] == ["hi", "again"]
    assert rows[0]["from"]["agent_id"] == launcher.pk
    with pytest.raises(InvalidRequest) as refused:
        await send({"target": f"nowhere:{REMOTE_ID}", "message": "hi"})
    assert "linked instance" in refused.value.message


async def test_a_shadow_agent_as_target_goes_to_its_peer(owner: Any, cloud: Any, launcher: Agent) -> None:
    shadow = await database_sync_to_async(shadow_upsert)(
        peer=cloud, peer_agent_id=REMOTE_ID, name="far", type="claude", status="running", seen_at=timezone.now()
    )
    sent = await (await atools(owner, launcher))["dispatch_send_message"]({"target": shadow.pk, "message": "hello"})
    assert sent["recipient"] == shadow.pk and sent["remote_agent_id"] == REMOTE_ID
    row = await database_sync_to_async(OutboxMessage.objects.get)(message_id=sent["message_id"])
    assert row.to_agent_id == REMOTE_ID and row.peer_id == cloud.pk


async def test_message_status_follows_a_cross_instance_message(
    owner: Any, cloud: Any, launcher: Agent, fake: FakePeerApi, reported: Agent
) -> None:
    agent_tools_now = await atools(owner, launcher)
    sent = await agent_tools_now["dispatch_send_message"]({"target": f"Cloud:{REMOTE_ID}", "message": "hello"})
    queued = await agent_tools_now["message_status"]({"message_id": sent["message_id"]})
    assert (queued["status"], queued["peer"], queued["attempts"]) == ("queued", "Cloud", 0)
    await outbox_drain_once(holder="test")  # the fake answers 409: the agent is not running there
    dead = await agent_tools_now["message_status"]({"message_id": sent["message_id"]})
    assert dead["status"] == "dead" and "agent is not running" in dead["error"]


# --- REST: messages, stop, start, archive of a shadow --------------------------------------------


@pytest.fixture
def shadow(cloud: Any) -> Agent:
    return shadow_upsert(
        peer=cloud, peer_agent_id=REMOTE_ID, name="far", type="claude", status="running", seen_at=timezone.now()
    )


@pytest.fixture
def api(owner_token: str) -> Api:
    return Api(owner_token)


def test_rest_messages_to_a_shadow_are_queued_for_its_peer(api: Api, shadow: Agent, cloud: Any) -> None:
    response = api.post(f"/api/v1/agents/{shadow.pk}/messages", {"content": "hi there"})
    assert response.status_code == 201, response.content
    assert response.json()["status"] == "queued"
    message = AgentMessage.objects.get(pk=response.json()["id"])
    assert message.peer_id == cloud.pk and message.sender_user is not None
    assert OutboxMessage.objects.get(message=message).payload["from"]["agent_id"] is None


def test_rest_stop_of_a_shadow_is_forwarded(api: Api, shadow: Agent, fake: FakePeerApi) -> None:
    response = api.post(f"/api/v1/agents/{shadow.pk}/stop")
    assert response.status_code == 200, response.content
    assert [r.url.path for r in fake.requests] == [f"/api/v1/peers/agents/{REMOTE_ID}/stop"]
    assert response.json()["status"] == "stopping"
    fake.stop_status = 403
    refused = api.post(f"/api/v1/agents/{shadow.pk}/stop")
    assert refused.status_code == 403 and error_of(refused)["code"] == "CAPABILITY_NOT_GRANTED"


def test_rest_archive_of_a_shadow_is_forwarded_then_archived_here(api: Api, shadow: Agent, fake: FakePeerApi) -> None:
    response = api.delete(f"/api/v1/agents/{shadow.pk}")
    assert response.status_code == 200, response.content
    assert [r.url.path for r in fake.requests] == [f"/api/v1/peers/agents/{REMOTE_ID}/archive"]
    assert Agent.objects.get(pk=shadow.pk).status == "archived"


def test_rest_start_of_a_shadow_is_not_supported(api: Api, shadow: Agent, fake: FakePeerApi) -> None:
    response = api.post(f"/api/v1/agents/{shadow.pk}/start")
    assert response.status_code == 400
    assert error_of(response)["code"] == "UNSUPPORTED_OPERATION"
    assert fake.requests == []


def test_rest_launch_with_a_location(api: Api, cloud: Any, fake: FakePeerApi) -> None:
    body = {"type": "claude", "name": "far", "cwd": "/srv/repos/app", "location": "cloud"}
    response = api.post("/api/v1/agents", body)
    assert response.status_code == 201, response.content
    shadow = Agent.objects.get(pk=response.json()["id"])
    assert shadow.peer_id == cloud.pk and shadow.peer_agent_id == REMOTE_ID
    assert fake.bodies("/api/v1/peers/launch")[0]["launched_by"]["agent_id"] is None
    unknown = api.post("/api/v1/agents", {**body, "location": "nowhere"})
    assert unknown.status_code == 400 and "no linked instance 'nowhere'" in error_of(unknown)["message"]


def test_archive_of_a_shadow_whose_link_is_gone_is_local(
    api: Api, shadow: Agent, cloud: Any, fake: FakePeerApi
) -> None:
    cloud.revoked_at = timezone.now()
    cloud.save()
    assert api.delete(f"/api/v1/agents/{shadow.pk}").status_code == 200
    assert fake.requests == [] and Agent.objects.get(pk=shadow.pk).status == "archived"


def test_the_drain_is_async_safe_from_sync_code(
    owner: Any, cloud: Any, launcher: Agent, fake: FakePeerApi, reported: Agent
) -> None:
    sent = outgoing.peer_message_send(user=owner, sender_agent=launcher, peer=cloud, to_agent_id=REMOTE_ID, content="x")
    async_to_sync(outbox_drain_once)(holder="t")
    assert AgentMessage.objects.get(pk=sent.pk).status == "dead"


def test_a_message_to_an_agent_the_mirror_never_reported_is_refused_and_creates_nothing(
    owner: Any, cloud: Any, launcher: Agent, reported: Agent
) -> None:
    before = Agent.objects.count()
    with pytest.raises(NotFound) as refused:
        outgoing.peer_message_send(
            user=owner, sender_agent=launcher, peer=cloud, to_agent_id="agt_ffffffffffff", content="x"
        )
    assert "far (agt_00000000abcd)" in refused.value.message  # what is known there is listed
    assert Agent.objects.count() == before and not OutboxMessage.objects.exists()


def test_the_shadows_own_id_is_understood_as_its_agent_there(
    owner: Any, cloud: Any, launcher: Agent, reported: Agent
) -> None:
    sent = outgoing.peer_message_send(
        user=owner, sender_agent=launcher, peer=cloud, to_agent_id=reported.pk, content="x"
    )
    assert sent.recipient_agent_id == reported.pk
    assert OutboxMessage.objects.get(message=sent).to_agent_id == REMOTE_ID


@pytest.mark.parametrize("gone", ["revoked", "deleted"])
async def test_a_message_to_a_shadow_whose_link_is_gone_is_refused_alike_by_rest_and_tools(
    api: Api, owner: Any, shadow: Agent, cloud: Any, gone: str
) -> None:
    """One decision (``selectors.shadow_link_for_message``): a revoked link is a removed one."""
    if gone == "revoked":
        cloud.revoked_at = timezone.now()
        await database_sync_to_async(cloud.save)()
    else:
        await database_sync_to_async(cloud.delete)()
    response = await database_sync_to_async(api.post)(f"/api/v1/agents/{shadow.pk}/messages", {"content": "hi"})
    assert response.status_code == 400 and error_of(response)["code"] == "INVALID_REQUEST"
    assert "belongs to a link that was removed" in error_of(response)["message"]
    send = (await atools(owner, None))["dispatch_send_message"]
    with pytest.raises(InvalidRequest, match="belongs to a link that was removed"):
        await send({"target": shadow.pk, "message": "hi"})
    assert not await database_sync_to_async(OutboxMessage.objects.exists)()
