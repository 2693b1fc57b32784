"""A linked instance that sends hostile approvals (docs/peers.md#approvals): the Approvals
page's part for linked instances shows it as one line and still lists every other link,
and an answer never sends an id that is not an approval's to the peer.

The hostile peer is a plain HTTP server of the test on 127.0.0.1 answering the peer
API's listing with what it likes (the page does not verify answers' signatures, only the
peer's TLS and its own requests are signed).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.test import Client

from agents.models import Approval
from peers.models import Peer
from tests.peers.test_peer_approvals import ask, local_agent, self_link


class HostilePeer:
    def __init__(self) -> None:
        self.listing: Any = {"approvals": []}
        self.paths: list[str] = []
        self.url = ""


@pytest.fixture
def hostile_peer() -> Iterator[HostilePeer]:
    state = HostilePeer()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            state.paths.append(self.path)
            body = json.dumps(state.listing).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = _answer
        do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def evil_link(owner: Any, url: str) -> Peer:
    """A second link, to the hostile server (its own instance id; keys and token as the
    self link's: the requests are signed as usual, the answers come from the test)."""
    template = self_link(owner, "http://127.0.0.1:9", label="template")
    evil = Peer.objects.create(
        owner=owner,
        instance_id="inst_0000000e7111",
        label="Evil",
        url=url,
        public_key=template.public_key,
        fingerprint=template.fingerprint,
        inbound_digest=template.inbound_digest + "x",
        inbound_prefix="evil",
        outbound_token_encrypted=template.outbound_token_encrypted,
    )
    template.delete()
    return evil


def approval_entry(approval_id: str, agent_id: str = "agt_0123456789ab") -> dict[str, Any]:
    return {
        "id": approval_id,
        "agent_id": agent_id,
        "agent_name": "evil",
        "tool_name": "Bash",
        "tool_summary": "ls",
        "tool_input": {"command": "ls"},
        "suggestions": [],
        "status": "pending",
        "asked_at": "2026-12-05T04:00:00Z",
        "expires_at": None,
    }


@pytest.mark.django_db(transaction=True)  # the fragment is an async view
@pytest.mark.parametrize("bad_id", ["apr_1/../../x", "../../agents", "a" * 70, "apr_x?y=1", ""])
def test_a_peer_sending_an_id_that_is_no_approval_id_is_one_line_and_the_other_links_still_list(
    live_server: Any, owner: Any, tmp_path: Any, hostile_peer: HostilePeer, bad_id: str
) -> None:
    pending = ask(local_agent(owner, tmp_path), "terraform plan")
    evil = evil_link(owner, hostile_peer.url)
    self_link(owner, live_server.url, label="Mirror")  # a well-behaved link: this very instance
    hostile_peer.listing = {"approvals": [approval_entry("apr_0123456789ab"), approval_entry(bad_id)]}
    client = Client()
    client.force_login(owner)
    fragment = client.get("/approvals/linked")
    assert fragment.status_code == 200
    html = fragment.content.decode()
    assert "terraform plan" in html  # the good link is listed
    assert "Evil sent approvals this instance cannot read" in html
    assert f"/approvals/linked/{evil.pk}/" not in html  # no answer form for anything Evil sent
    assert Approval.objects.get(pk=pending.pk).status == "pending"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("bad_id", ["..", "apr_x%3Fy=1", "apr_%2e%2e"])
def test_an_answer_with_an_id_that_is_no_approval_id_never_reaches_the_peer(
    owner: Any, hostile_peer: HostilePeer, bad_id: str
) -> None:
    evil = evil_link(owner, hostile_peer.url)
    client = Client()
    client.force_login(owner)
    response = client.post(f"/approvals/linked/{evil.pk}/{bad_id}/answer", {"decision": "allow_once"}, follow=True)
    assert response.status_code == 200
    assert "no such approval" in response.content.decode()
    assert hostile_peer.paths == []
    assert Peer.objects.filter(pk=evil.pk).exists()


@pytest.mark.django_db
def test_the_peer_listing_cuts_huge_inputs_so_one_agent_cannot_make_it_hundreds_of_megabytes(
    make_peer: Any, owner: Any, tmp_path: Any
) -> None:
    from agents import approvals
    from peers.services.approvals import PEER_APPROVALS_MAX, PEER_INPUT_SHOWN
    from tests.peers.signing import peer_get

    agent = local_agent(owner, tmp_path)
    small = approvals.approval_request(agent=agent, tool_name="Bash", tool_input={"command": "ls", "n": 1})
    for _ in range(5):
        approvals.approval_request(agent=agent, tool_name="Write", tool_input={"content": "A" * 300_000})
    response = peer_get(Client(), make_peer(owner, label="Cloud"), "/api/v1/peers/approvals")
    assert response.status_code == 200
    listed = response.json()["approvals"]
    assert len(response.content) < 6 * (PEER_INPUT_SHOWN + approvals.MAX_SUMMARY + 2_000)
    assert listed[0]["id"] == small.pk and listed[0]["tool_input"] == {"command": "ls", "n": 1}  # small: whole
    cut = listed[1]["tool_input"]
    assert set(cut) == {"input_cut"} and cut["input_cut"].startswith('{"content": "AAA')
    assert len(cut["input_cut"]) <= PEER_INPUT_SHOWN + 100 and PEER_APPROVALS_MAX == 100
