"""The peer API served to linked peers (peers/peer_api.py, docs/peers.md#the-peer-api, except events):
launch, messages, repos, stop/archive of the agents a peer launched, unlink — each gated
by its own capability, every POST answered through an Idempotency-Key receipt."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from agents import services as agent_services
from agents.models import Agent, AgentMessage, Run
from agents.types import parse_agent_types
from peers.models import Peer, PeerReceipt, new_idempotency_key
from peers.services import incoming as peer_services
from tests.agents.conftest import Api, error_of, force_status
from tests.peers.conftest import FakePeer
from tests.peers.signing import json_body, peer_get, peer_post, signed_headers

pytestmark = pytest.mark.django_db

LAUNCH = "/api/v1/peers/launch"
MESSAGES = "/api/v1/peers/messages"
REPOS = "/api/v1/peers/repos"


@pytest.fixture
def repo_root(tmp_path: Path, settings: Any) -> str:
    """One advertised repo root with a project in it; ``settings.REPO_ROOTS`` points at it."""
    root = tmp_path / "repos"
    (root / "project").mkdir(parents=True)
    settings.REPO_ROOTS = [os.path.realpath(root)]
    return os.path.realpath(root)


@pytest.fixture
def cloud(make_peer: Callable[..., FakePeer], owner: Any) -> FakePeer:
    """A peer linked for alice with the default capabilities (full access off)."""
    return make_peer(owner, label="Cloud")


@pytest.fixture
def client() -> Client:
    return Client()


def launch_body(fake: FakePeer, repo_root: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "reviewer",
        "prompt": "review the diff",
        "type": "expert",
        "cwd": os.path.join(repo_root, "project"),
        "launched_by": {"instance_id": fake.instance_id, "agent_id": "agt_planner1", "name": "planner"},
    }
    body.update(overrides)
    return body


def message_body(fake: FakePeer, agent: Agent, content: str = "hello from the cloud") -> dict[str, Any]:
    return {
        "to_agent_id": agent.pk,
        "content": content,
        "from": {"instance_id": fake.instance_id, "agent_id": "agt_planner1", "name": "planner"},
    }


def running_expert(user: Any, cwd: str, name: str = "helper") -> Agent:
    return agent_services.agent_create(owner=user, type="expert", name=name, cwd=cwd)


# --- launch -------------------------------------------------------------------------------------


def test_it_launches_an_expert_agent_owned_by_the_link_user_with_the_preamble(client, cloud, owner, repo_root):
    response = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root))

    assert response.status_code == 201, response.content
    answer = response.json()
    agent = Agent.objects.get(pk=answer["agent_id"])
    assert answer == {"agent_id": agent.pk, "name": "reviewer", "status": "running"}
    assert agent.owner == owner
    assert agent.cwd == os.path.join(repo_root, "project")
    assert agent.launched_by_peer == {"instance_id": cloud.instance_id, "agent_id": "agt_planner1", "name": "planner"}
    assert agent.full_access is False
    instruction = Run.objects.get(agent=agent).input["instruction"]
    assert 'linked Dispatch instance "Cloud"' in instruction
    assert "Cloud:agt_planner1" in instruction and "dispatch_send_message" in instruction
    assert "none of that agent's context" in instruction
    assert instruction.endswith("\n\nreview the diff")


def test_a_launch_by_a_person_names_that_person_in_the_preamble(client, cloud, repo_root):
    body = launch_body(
        cloud, repo_root, launched_by={"instance_id": cloud.instance_id, "agent_id": None, "name": "dana"}
    )

    response = peer_post(client, cloud, LAUNCH, body)

    assert response.status_code == 201, response.content
    agent = Agent.objects.get(pk=response.json()["agent_id"])
    assert agent.launched_by_peer == {"instance_id": cloud.instance_id, "agent_id": None, "name": "dana"}
    instruction = Run.objects.get(agent=agent).input["instruction"]
    assert '"dana", a person there' in instruction
    assert "dispatch_send_message" not in instruction


def test_a_replayed_launch_launches_nothing_new_and_returns_the_first_answer(client, cloud, repo_root):
    key = new_idempotency_key()
    first = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root), idempotency_key=key)
    again = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root), idempotency_key=key)

    assert first.status_code == again.status_code == 201
    assert again.json() == first.json()
    assert Agent.objects.count() == 1
    assert Run.objects.count() == 1


def test_the_same_key_with_another_launch_body_is_422_and_launches_nothing(client, cloud, repo_root):
    key = new_idempotency_key()
    peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root), idempotency_key=key)

    response = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root, name="other"), idempotency_key=key)

    assert response.status_code == 422
    assert error_of(response)["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert list(Agent.objects.values_list("name", flat=True)) == ["reviewer"]


def test_a_launch_without_an_idempotency_key_is_refused(client, cloud, repo_root):
    content = json_body(launch_body(cloud, repo_root))
    headers = signed_headers(cloud, "POST", LAUNCH, content)

    response = client.post(LAUNCH, data=content, content_type="application/json", headers=headers)

    assert response.status_code == 400
    assert "Idempotency-Key" in error_of(response)["message"]
    assert not Agent.objects.exists()


def test_a_failed_launch_leaves_no_receipt_so_a_corrected_setup_can_retry_the_key(client, cloud, repo_root, settings):
    settings.REPO_ROOTS = []
    key = new_idempotency_key()

    refused = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root), idempotency_key=key)
    assert refused.status_code == 400
    assert "DISPATCH_REPO_ROOTS is empty" in error_of(refused)["message"]
    assert not PeerReceipt.objects.exists()

    settings.REPO_ROOTS = [repo_root]
    retried = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root), idempotency_key=key)
    assert retried.status_code == 201


def test_an_unavailable_type_is_refused_with_the_available_ones(client, cloud, repo_root, settings):
    settings.LLM_BASE_URL = "http://127.0.0.1:9/v1"  # expert works here
    response = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root, type="no-such-type"))

    assert response.status_code == 400
    error = error_of(response)
    assert "no-such-type" in error["message"]
    assert "expert" in error["details"]["available_types"]
    assert not Agent.objects.exists()


def test_a_peer_cannot_launch_in_the_name_of_another_instance(client, cloud, repo_root):
    body = launch_body(
        cloud, repo_root, launched_by={"instance_id": "inst_000000000000", "agent_id": None, "name": "x"}
    )

    response = peer_post(client, cloud, LAUNCH, body)

    assert response.status_code == 400
    assert "launched_by.instance_id" in error_of(response)["message"]
    assert not Agent.objects.exists()


def test_full_access_is_off_by_default_and_needed_for_a_full_access_launch(client, make_peer, owner, repo_root):
    plain = make_peer(owner, label="Plain")
    trusted = make_peer(owner, label="Trusted", allow_full_access=True)
    assert plain.peer.allow_full_access is False

    refused = peer_post(client, plain, LAUNCH, launch_body(plain, repo_root, full_access=True))
    allowed = peer_post(client, trusted, LAUNCH, launch_body(trusted, repo_root, full_access=True))

    assert refused.status_code == 403
    assert error_of(refused)["code"] == "CAPABILITY_NOT_GRANTED"
    assert allowed.status_code == 201
    assert list(Agent.objects.values_list("full_access", "launched_by_peer__instance_id")) == [
        (True, trusted.instance_id)
    ]


def test_another_user_of_this_instance_does_not_see_a_peer_launched_agent(
    client, cloud, repo_root, owner_token, member_token
):
    agent_id = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root)).json()["agent_id"]

    mine = Api(owner_token).get(f"/api/v1/agents/{agent_id}")
    theirs = Api(member_token).get(f"/api/v1/agents/{agent_id}")

    assert mine.status_code == 200
    assert mine.json()["launched_by_peer"]["instance_id"] == cloud.instance_id
    assert theirs.status_code == 404
    assert agent_id not in [a["id"] for a in Api(member_token).get("/api/v1/agents").json()["agents"]]


def test_a_launch_without_a_type_gets_the_local_default_never_a_shell(client, cloud, repo_root, settings):
    settings.AGENT_TYPES = parse_agent_types({"shell": {"argv": ["bash"], "kind": "shell"}})
    settings.LLM_BASE_URL = ""
    body = launch_body(cloud, repo_root)
    del body["type"]

    refused = peer_post(client, cloud, LAUNCH, body)

    assert refused.status_code == 400
    error = error_of(refused)
    assert error["message"].startswith("type is required") and error["details"] == {"available_types": ["shell"]}
    assert not Agent.objects.exists()

    settings.LLM_BASE_URL = "http://127.0.0.1:9/v1"  # a model endpoint: expert is the default
    launched = peer_post(client, cloud, LAUNCH, body)

    assert launched.status_code == 201, launched.content
    assert Agent.objects.get(pk=launched.json()["agent_id"]).type == "expert"


# --- capabilities ---------------------------------------------------------------------------------


def test_without_allow_launch_launch_stop_and_archive_are_refused_but_messages_pass(
    client, make_peer, owner, repo_root
):
    fake = make_peer(owner, label="NoLaunch", allow_launch=False)
    helper = running_expert(owner, repo_root)
    Agent.objects.filter(pk=helper.pk).update(
        launched_by_peer={"instance_id": fake.instance_id, "agent_id": None, "name": "dana"}
    )

    launch = peer_post(client, fake, LAUNCH, launch_body(fake, repo_root))
    stop = peer_post(client, fake, f"/api/v1/peers/agents/{helper.pk}/stop", {})
    archive = peer_post(client, fake, f"/api/v1/peers/agents/{helper.pk}/archive", {})
    message = peer_post(client, fake, MESSAGES, message_body(fake, helper))

    assert launch.status_code == stop.status_code == archive.status_code == 403
    assert launch.json() == {
        "error": {"code": "CAPABILITY_NOT_GRANTED", "message": "launch is not permitted for this peer", "details": {}}
    }
    assert message.status_code == 200
    helper.refresh_from_db()
    assert helper.status == "running"
    assert Agent.objects.count() == 1


def test_without_allow_message_messages_are_refused_but_launches_pass(client, make_peer, owner, repo_root):
    fake = make_peer(owner, label="NoMessage", allow_message=False)
    helper = running_expert(owner, repo_root)

    message = peer_post(client, fake, MESSAGES, message_body(fake, helper))
    launch = peer_post(client, fake, LAUNCH, launch_body(fake, repo_root))

    assert message.status_code == 403
    assert message.json()["error"] == {
        "code": "CAPABILITY_NOT_GRANTED",
        "message": "messaging is not permitted for this peer",
        "details": {},
    }
    assert not AgentMessage.objects.exists()
    assert launch.status_code == 201


def test_a_changed_flag_takes_effect_on_the_next_request(client, cloud, repo_root):
    assert peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root)).status_code == 201

    Peer.objects.filter(pk=cloud.peer.pk).update(allow_launch=False)

    assert peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root, name="second")).status_code == 403


def test_an_unsigned_request_is_refused_before_anything_happens(client, cloud, repo_root):
    content = json_body(launch_body(cloud, repo_root))

    response = client.post(
        LAUNCH,
        data=content,
        content_type="application/json",
        headers={"Authorization": f"Bearer {cloud.inbound_token}"},
    )

    assert response.status_code == 401
    assert not Agent.objects.exists()


# --- messages ---------------------------------------------------------------------------------------


def test_a_message_reaches_an_expert_agent_of_the_link_user_as_a_run(client, cloud, owner, repo_root):
    helper = running_expert(owner, repo_root)
    key = new_idempotency_key()

    response = peer_post(client, cloud, MESSAGES, message_body(cloud, helper), idempotency_key=key)

    assert response.status_code == 200, response.content
    message = AgentMessage.objects.get()
    assert response.json() == {"delivered": True, "message_id": message.pk}
    assert message.recipient_agent == helper
    assert message.sender_peer == cloud.peer and message.peer == cloud.peer
    assert message.sender_address == {"instance_id": cloud.instance_id, "agent_id": "agt_planner1", "name": "planner"}
    assert message.sender_user is None and message.sender_agent is None
    assert message.idempotency_key == key
    assert message.status == "delivered"
    assert Run.objects.get(agent=helper).input["instruction"] == "hello from the cloud"


def test_a_repeated_message_key_answers_duplicate_without_delivering_again(client, cloud, owner, repo_root):
    helper = running_expert(owner, repo_root)
    key = new_idempotency_key()
    peer_post(client, cloud, MESSAGES, message_body(cloud, helper), idempotency_key=key)

    again = peer_post(client, cloud, MESSAGES, message_body(cloud, helper), idempotency_key=key)

    assert again.status_code == 200
    assert again.json() == {"delivered": True, "duplicate": True}
    assert AgentMessage.objects.count() == 1
    assert Run.objects.filter(agent=helper).count() == 1


def test_the_same_message_key_with_another_body_is_422(client, cloud, owner, repo_root):
    helper = running_expert(owner, repo_root)
    key = new_idempotency_key()
    peer_post(client, cloud, MESSAGES, message_body(cloud, helper), idempotency_key=key)

    response = peer_post(client, cloud, MESSAGES, message_body(cloud, helper, "something else"), idempotency_key=key)

    assert response.status_code == 422
    assert AgentMessage.objects.count() == 1


def test_a_message_to_a_stopped_agent_is_409_and_a_retry_after_it_is_back_delivers(client, cloud, owner, repo_root):
    helper = force_status(running_expert(owner, repo_root), "stopped")
    key = new_idempotency_key()

    refused = peer_post(client, cloud, MESSAGES, message_body(cloud, helper), idempotency_key=key)

    assert refused.status_code == 409
    assert error_of(refused)["code"] == "CONFLICT"
    assert not PeerReceipt.objects.exists()
    assert not AgentMessage.objects.exists()

    force_status(helper, "running")
    retried = peer_post(client, cloud, MESSAGES, message_body(cloud, helper), idempotency_key=key)
    assert retried.status_code == 200
    assert retried.json()["delivered"] is True and "duplicate" not in retried.json()
    assert AgentMessage.objects.get().idempotency_key == key


@pytest.mark.parametrize("case", ["archived", "missing", "another_users", "shadow"])
def test_a_message_to_an_agent_the_link_user_cannot_receive_with_is_409(client, cloud, owner, member, repo_root, case):
    if case == "archived":
        target = force_status(running_expert(owner, repo_root), "archived")
    elif case == "missing":
        target = Agent(id="agt_nosuchagent")
    elif case == "another_users":
        target = running_expert(member, repo_root)
    else:
        target = running_expert(owner, repo_root)
        Agent.objects.filter(pk=target.pk).update(peer=cloud.peer, peer_agent_id="agt_remote1")

    response = peer_post(client, cloud, MESSAGES, message_body(cloud, target))

    assert response.status_code == 409
    assert not AgentMessage.objects.exists()
    assert not PeerReceipt.objects.exists()
    assert not Run.objects.exists()


def test_a_message_that_fails_unexpectedly_is_503_and_keeps_no_receipt(client, cloud, owner, repo_root, monkeypatch):
    helper = running_expert(owner, repo_root)

    def database_down(**kwargs: Any) -> None:
        raise RuntimeError("database went away")

    monkeypatch.setattr(peer_services, "peer_message_here", database_down)

    response = peer_post(client, cloud, MESSAGES, message_body(cloud, helper))

    assert response.status_code == 503
    assert error_of(response)["code"] == "TEMPORARILY_UNAVAILABLE"
    assert not PeerReceipt.objects.exists()


def test_a_message_must_come_from_the_calling_peer(client, cloud, owner, repo_root):
    helper = running_expert(owner, repo_root)
    body = message_body(cloud, helper)
    body["from"]["instance_id"] = "inst_aaaaaaaaaaaa"

    response = peer_post(client, cloud, MESSAGES, body)

    assert response.status_code == 400
    assert not AgentMessage.objects.exists()


# --- repos ---------------------------------------------------------------------------------------------


def test_repos_lists_the_advertised_roots(client, cloud, repo_root, settings):
    assert peer_get(client, cloud, REPOS).json() == {"roots": [repo_root]}

    settings.REPO_ROOTS = []
    assert peer_get(client, cloud, REPOS).json() == {"roots": []}


# --- stop / archive -------------------------------------------------------------------------------------


def test_a_peer_stops_and_archives_an_agent_it_launched(client, cloud, repo_root):
    agent_id = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root)).json()["agent_id"]

    stopped = peer_post(client, cloud, f"/api/v1/peers/agents/{agent_id}/stop", {})
    archived = peer_post(client, cloud, f"/api/v1/peers/agents/{agent_id}/archive", {})

    assert stopped.status_code == 200, stopped.content
    assert stopped.json() == {"agent_id": agent_id, "name": "reviewer", "status": "stopped"}
    assert archived.json()["status"] == "archived"
    assert Agent.objects.get(pk=agent_id).status == "archived"


def test_a_replayed_stop_returns_the_first_answer_instead_of_a_conflict(client, cloud, repo_root):
    agent_id = peer_post(client, cloud, LAUNCH, launch_body(cloud, repo_root)).json()["agent_id"]
    key = new_idempotency_key()
    path = f"/api/v1/peers/agents/{agent_id}/stop"

    first = peer_post(client, cloud, path, {}, idempotency_key=key)
    again = peer_post(client, cloud, path, {}, idempotency_key=key)
    fresh = peer_post(client, cloud, path, {})

    assert first.status_code == again.status_code == 200
    assert again.json() == first.json()
    assert fresh.status_code == 409  # a new stop of a stopped agent


def test_a_peer_cannot_stop_or_archive_agents_it_did_not_launch(client, cloud, make_peer, owner, member, repo_root):
    local = running_expert(owner, repo_root, name="local")
    other = make_peer(owner, label="Other")
    by_other = peer_post(client, other, LAUNCH, launch_body(other, repo_root)).json()["agent_id"]
    members = running_expert(member, repo_root, name="members")
    Agent.objects.filter(pk=members.pk).update(
        launched_by_peer={"instance_id": cloud.instance_id, "agent_id": None, "name": "dana"}
    )

    for agent_id in (local.pk, by_other, members.pk, "agt_nosuchagent"):
        for action in ("stop", "archive"):
            response = peer_post(client, cloud, f"/api/v1/peers/agents/{agent_id}/{action}", {})
            assert response.status_code == 404, (agent_id, action, response.content)

    assert set(Agent.objects.values_list("status", flat=True)) == {"running"}


# --- unlink ---------------------------------------------------------------------------------------------------


def test_unlink_revokes_our_side_and_the_token_stops_working(client, cloud, repo_root):
    response = peer_post(client, cloud, "/api/v1/peers/unlink", {"instance_id": cloud.instance_id})

    assert response.status_code == 200
    assert response.json() == {"unlinked": True}
    peer = Peer.objects.get(pk=cloud.peer.pk)
    assert peer.revoked_at is not None and peer.unlinked_by_peer is True
    after = peer_get(client, cloud, REPOS)
    assert after.status_code == 401
    assert after["WWW-Authenticate"].startswith("Bearer")
