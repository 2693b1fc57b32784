"""The peer API and the pairing routes are in the OpenAPI schema (docs/peers.md#the-peer-api),
each with the success status its view answers."""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.test import Client

from agents import services as agent_services
from agents.approvals import approval_request
from core.services import generate_token
from peers import pairing_exchange
from peers.services.pairing import offer_create
from tests.peers.conftest import FakePeer, new_key_pair
from tests.peers.signing import peer_get, peer_post


@pytest.mark.django_db
def test_the_schema_describes_every_peer_route_with_its_security(client: Any, owner_token: str) -> None:
    response = client.get("/api/schema/", HTTP_ACCEPT="application/json", HTTP_AUTHORIZATION=f"Bearer {owner_token}")
    assert response.status_code == 200
    schema = response.json()
    paths = schema["paths"]
    for route in ("launch", "messages", "events", "repos", "unlink", "claim", "offers", "link"):
        assert f"/api/v1/peers/{route}" in paths
    stop = paths["/api/v1/peers/agents/{agent_id}/stop"]["post"]
    assert stop["security"] == [{"peerAuth": []}]
    names = {parameter["name"] for parameter in stop["parameters"]}
    assert {"agent_id", "Idempotency-Key", "Signature", "Signature-Input", "Content-Digest"} <= names
    assert paths["/api/v1/peers/claim"]["post"]["security"] == []
    assert "peerAuth" in schema["components"]["securitySchemes"]


def _claimant(**overrides: Any) -> dict[str, Any]:
    """Another instance as a claim or a claim answer describes it."""
    _, public = new_key_pair()
    return {
        "protocol_version": 2,
        "instance_id": "inst_" + secrets.token_hex(6),
        "name": "laptop",
        "url": "http://127.0.0.1:9",
        "public_key": public,
        "token_for_you": generate_token(),
        **overrides,
    }


# The async pairing views run their queries on another thread: the database is real.
@pytest.mark.django_db(transaction=True)
def test_every_peer_and_pairing_route_answers_the_success_status_the_schema_documents(
    owner: Any,
    owner_token: str,
    make_peer: Callable[..., FakePeer],
    tmp_path: Path,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = Client()
    staff = {"HTTP_AUTHORIZATION": f"Bearer {owner_token}"}
    schema = client.get("/api/schema/", {"format": "json"}, **staff).json()
    answered: dict[tuple[str, str], int] = {}

    def answer(method: str, path: str, response: Any) -> Any:
        assert response.status_code < 300, (method, path, response.content)
        answered[(method, path)] = response.status_code
        return response

    # The peer API, as a linked peer.
    settings.REPO_ROOTS = [os.path.realpath(tmp_path)]
    cloud = make_peer(owner, label="Cloud")
    person = {"instance_id": cloud.instance_id, "agent_id": None, "name": "dana"}
    launch = {"name": "worker", "prompt": "hi", "type": "expert", "cwd": str(tmp_path), "launched_by": person}
    launched = answer("post", "/api/v1/peers/launch", peer_post(client, cloud, "/api/v1/peers/launch", launch))
    helper = agent_services.agent_create(owner=owner, type="expert", name="helper", cwd=str(tmp_path))
    message = {"to_agent_id": helper.pk, "content": "hello", "from": person}
    answer("post", "/api/v1/peers/messages", peer_post(client, cloud, "/api/v1/peers/messages", message))
    batch = {"messages": [{"idempotency_key": "batched-1", **message}]}
    answer("post", "/api/v1/peers/messages/batch", peer_post(client, cloud, "/api/v1/peers/messages/batch", batch))
    answer("get", "/api/v1/peers/repos", peer_get(client, cloud, "/api/v1/peers/repos"))
    for action in ("stop", "archive"):
        path = f"/api/v1/peers/agents/{launched.json()['agent_id']}/{action}"
        answer("post", f"/api/v1/peers/agents/{{agent_id}}/{action}", peer_post(client, cloud, path, {}))
    answer("get", "/api/v1/peers/approvals", peer_get(client, cloud, "/api/v1/peers/approvals"))
    asked = approval_request(agent=helper, tool_name="Bash", tool_input={"command": "ls"})
    decided = {"decision": "allow_once", "answered_by": person}
    path = f"/api/v1/peers/approvals/{asked.pk}/answer"
    answer("post", "/api/v1/peers/approvals/{approval_id}/answer", peer_post(client, cloud, path, decided))
    answer("post", "/api/v1/peers/unlink", peer_post(client, cloud, "/api/v1/peers/unlink", {}))

    # Pairing and the staff routes.
    offer = client.post("/api/v1/peers/offers", {}, content_type="application/json", **staff)
    answer("post", "/api/v1/peers/offers", offer)
    claim = {"code": offer_create(user=owner).code, **_claimant()}
    answer("post", "/api/v1/peers/claim", client.post("/api/v1/peers/claim", claim, content_type="application/json"))
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=_claimant(capabilities={})))
    monkeypatch.setattr(
        pairing_exchange.httpx, "AsyncClient", functools.partial(httpx.AsyncClient, transport=transport)
    )
    link = {"url": "http://127.0.0.1:9", "code": "BCDF-GHJK", "label": "Other"}
    linked = client.post("/api/v1/peers/link", link, content_type="application/json", **staff)
    answer("post", "/api/v1/peers/link", linked)
    answer("get", "/api/v1/peers", client.get("/api/v1/peers", **staff))
    peer_path = f"/api/v1/peers/{linked.json()['peer']['id']}"
    relabel = client.patch(peer_path, {"label": "Renamed"}, content_type="application/json", **staff)
    answer("patch", "/api/v1/peers/{peer_id}", relabel)
    answer("delete", "/api/v1/peers/{peer_id}", client.delete(peer_path, **staff))

    for (method, path), status in answered.items():
        documented = [code for code in schema["paths"][path][method]["responses"] if code.startswith("2")]
        assert documented == [str(status)], (method, path)
    documented_routes = {
        (method, path)
        for path, operations in schema["paths"].items()
        if path.startswith("/api/v1/peers")
        for method in operations
    }
    # Every peer route but the event stream (its 200: tests/peers/test_stream.py, through serve).
    assert documented_routes - set(answered) == {("get", "/api/v1/peers/events")}
