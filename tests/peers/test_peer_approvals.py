"""Approvals over a link (docs/peers.md#approvals): the peer API that lists and answers
the link user's pending approvals (peers/peer_api.py, gated by ``allow_message``), and the
Approvals page asking every linked instance through it (peers/linked_approvals.py).

The route tests sign requests as a fake peer (tests/peers/signing.py). The page tests link
this instance to itself over a live server: one ``Peer`` row whose token and key are our
own, so the page's signed requests really leave through httpx and come back in through
the peer API's authentication.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from agents import approvals, services
from agents.models import Agent, AgentEvent, Approval
from core import secrets_at_rest
from core.services import generate_token, token_digest
from peers.models import Peer, new_idempotency_key
from peers.services.identity import identity_get
from tests.agents.conftest import error_of
from tests.peers.conftest import FakePeer
from tests.peers.signing import peer_get, peer_post

LIST = "/api/v1/peers/approvals"


def answer_path(approval: Approval) -> str:
    return f"/api/v1/peers/approvals/{approval.pk}/answer"


def local_agent(user: Any, tmp_path: Any, name: str = "builder") -> Agent:
    agent = services.agent_create(owner=user, type="shell", name=name, cwd=str(tmp_path))
    Agent.objects.filter(pk=agent.pk).update(status="running")
    agent.refresh_from_db()
    return agent


def ask(agent: Agent, command: str = "make deploy") -> Approval:
    return approvals.approval_request(agent=agent, tool_name="Bash", tool_input={"command": command})


def answer_body(fake: FakePeer, decision: str = "allow_once", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "decision": decision,
        "message": "",
        "answered_by": {"instance_id": fake.instance_id, "agent_id": None, "name": "bob"},
    }
    body.update(overrides)
    return body


@pytest.fixture
def cloud(make_peer: Callable[..., FakePeer], owner: Any) -> FakePeer:
    return make_peer(owner, label="Cloud")


# --- the routes ----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_peer_lists_the_pending_approvals_of_the_link_users_local_agents_only(cloud, owner, outsider, tmp_path):
    mine = ask(local_agent(owner, tmp_path), "rm -rf /srv/app/cache")
    answered = ask(local_agent(owner, tmp_path, "other"))
    approvals.approval_answer(approval_id=answered.pk, decision="deny", user=owner)
    ask(local_agent(outsider, tmp_path, "carols"))
    response = peer_get(Client(), cloud, LIST)
    assert response.status_code == 200, response.content
    listed = response.json()["approvals"]
    assert [entry["id"] for entry in listed] == [mine.pk]
    assert listed[0]["tool_summary"] == "rm -rf /srv/app/cache"
    assert listed[0]["agent_name"] == "builder"
    assert listed[0]["tool_input"] == {"command": "rm -rf /srv/app/cache"}


@pytest.mark.django_db
def test_a_peer_answers_and_the_answer_is_recorded_as_the_link_naming_the_person_there(cloud, owner, tmp_path):
    agent = local_agent(owner, tmp_path)
    pending = ask(agent)
    response = peer_post(Client(), cloud, answer_path(pending), answer_body(cloud))
    assert response.status_code == 200, response.content
    assert response.json()["answered_by"] == "bob on Cloud"
    pending.refresh_from_db()
    assert (pending.status, pending.decision, pending.answered_by_peer_id) == ("allowed", "allow_once", cloud.peer.pk)
    assert pending.answered_by_user is None
    assert AgentEvent.objects.filter(agent=agent, message__startswith="approved once by bob on Cloud").exists()


@pytest.mark.django_db
def test_a_deny_from_a_peer_carries_its_message(cloud, owner, tmp_path):
    pending = ask(local_agent(owner, tmp_path))
    body = answer_body(cloud, "deny", message="not on a Friday")
    assert peer_post(Client(), cloud, answer_path(pending), body).status_code == 200
    pending.refresh_from_db()
    assert (pending.status, pending.message) == ("denied", "not on a Friday")


@pytest.mark.django_db
def test_a_replayed_answer_gets_the_first_answer_and_a_second_answer_is_told_it_was_answered(cloud, owner, tmp_path):
    pending = ask(local_agent(owner, tmp_path))
    key = new_idempotency_key()
    first = peer_post(Client(), cloud, answer_path(pending), answer_body(cloud), idempotency_key=key)
    replay = peer_post(Client(), cloud, answer_path(pending), answer_body(cloud), idempotency_key=key)
    assert first.status_code == replay.status_code == 200
    assert replay.json() == first.json()
    again = peer_post(Client(), cloud, answer_path(pending), answer_body(cloud, "deny"))
    assert again.status_code == 409
    error = error_of(again)
    assert error["code"] == "APPROVAL_ANSWERED" and "bob on Cloud" in error["message"]
    assert Approval.objects.get(pk=pending.pk).decision == "allow_once"


@pytest.mark.django_db
def test_a_link_without_the_messaging_capability_can_neither_list_nor_answer(make_peer, owner, tmp_path):
    old = make_peer(owner, label="Old", allow_message=False)
    pending = ask(local_agent(owner, tmp_path))
    listing = peer_get(Client(), old, LIST)
    assert listing.status_code == 403 and error_of(listing)["code"] == "CAPABILITY_NOT_GRANTED"
    answer = peer_post(Client(), old, answer_path(pending), answer_body(old))
    assert answer.status_code == 403 and error_of(answer)["code"] == "CAPABILITY_NOT_GRANTED"
    assert Approval.objects.get(pk=pending.pk).status == "pending"


@pytest.mark.django_db
def test_another_users_approval_is_404_to_the_peer(cloud, outsider, tmp_path):
    theirs = ask(local_agent(outsider, tmp_path))
    response = peer_post(Client(), cloud, answer_path(theirs), answer_body(cloud))
    assert response.status_code == 404
    assert Approval.objects.get(pk=theirs.pk).status == "pending"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "overrides",
    [
        {"decision": "yes"},
        {"answered_by": {"instance_id": "inst_000000000000", "agent_id": None, "name": "mallory"}},
        {"answered_by": None},
        {"decision": "allow_once", "message": "a message goes with deny only"},
    ],
)
def test_a_bad_answer_body_is_400_and_changes_nothing(cloud, owner, tmp_path, overrides):
    pending = ask(local_agent(owner, tmp_path))
    response = peer_post(Client(), cloud, answer_path(pending), answer_body(cloud, **overrides))
    assert response.status_code == 400, response.content
    assert Approval.objects.get(pk=pending.pk).status == "pending"


@pytest.mark.django_db
def test_an_unsigned_request_is_refused(cloud, owner, tmp_path):
    pending = ask(local_agent(owner, tmp_path))
    response = Client().post(answer_path(pending), answer_body(cloud), content_type="application/json")
    assert response.status_code == 401
    assert Approval.objects.get(pk=pending.pk).status == "pending"


# --- the Approvals page through a real link ---------------------------------------------------------


def self_link(owner: Any, url: str, label: str = "Mirror") -> Peer:
    """A link from this instance to itself at ``url``: the token it presents is the one it
    accepts, the key it signs with the one it checks."""
    identity = identity_get()
    token = generate_token()
    return Peer.objects.create(
        owner=owner,
        instance_id=identity.instance_id,
        label=label,
        url=url,
        public_key=identity.public_key,
        fingerprint=identity.fingerprint,
        inbound_digest=token_digest(token),
        inbound_prefix=token[:8],
        outbound_token_encrypted=secrets_at_rest.encrypt(token.encode()),
    )


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.django_db(transaction=True)
def test_the_approvals_page_lists_and_answers_approvals_on_a_linked_instance_through_the_peer_api(
    live_server, owner, tmp_path
):
    agent = local_agent(owner, tmp_path)
    pending = ask(agent, "terraform apply")
    link = self_link(owner, live_server.url)
    Peer.objects.create(  # a second link that is down: one line, the page still works
        owner=owner,
        instance_id="inst_00000000dead",
        label="Laptop",
        url=f"http://127.0.0.1:{closed_port()}",
        public_key=link.public_key,
        fingerprint=link.fingerprint,
        inbound_digest=token_digest(generate_token()),
        inbound_prefix="x",
        outbound_token_encrypted=link.outbound_token_encrypted,
    )
    client = Client()
    client.force_login(owner)
    fragment = client.get("/approvals/linked")
    assert fragment.status_code == 200
    html = fragment.content.decode()
    assert "instance Laptop: unreachable" in html
    assert "terraform apply" in html
    action = f"/approvals/linked/{link.pk}/{pending.pk}/answer"
    assert f'action="{action}"' in html
    response = client.post(action, {"decision": "deny", "message": "wait for the review", "next": "/approvals/"})
    assert response.status_code == 302 and response["Location"] == "/approvals/"
    pending.refresh_from_db()
    assert (pending.status, pending.message, pending.answered_by_peer_id) == ("denied", "wait for the review", link.pk)
    assert pending.answered_by == "alice on Mirror"
    # answering again through the link: the peer's "already answered" is a note, not an error page
    again = client.post(action, {"decision": "allow_once"}, follow=True)
    assert again.status_code == 200
    assert re.search(r"already answered.*alice on Mirror", again.content.decode())


@pytest.mark.django_db(transaction=True)  # an async view: database_sync_to_async closes connections
def test_another_users_link_cannot_be_used_to_answer(owner, outsider, tmp_path):
    link = self_link(owner, "http://127.0.0.1:9")
    client = Client()
    client.force_login(outsider)
    response = client.post(f"/approvals/linked/{link.pk}/apr_whatever/answer", {"decision": "allow_once"}, follow=True)
    assert "no linked instance" in response.content.decode()
    assert "unreachable" not in response.content.decode()  # it never tried to reach the peer
