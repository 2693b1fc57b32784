"""The peer API and the pairing routes are in the OpenAPI schema (spec/agents.md §5, peers.md §5)."""

from __future__ import annotations

from typing import Any

import pytest


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
