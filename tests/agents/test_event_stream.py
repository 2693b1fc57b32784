"""``GET /api/v1/events`` against a real server: snapshot first, then live frames."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.infra import instance

pytestmark = pytest.mark.integration


def read_frames(lines, count: int, deadline: float) -> list[dict]:
    """Parse ``count`` SSE frames (id, event, data) from an iterator of lines."""
    frames: list[dict] = []
    current: dict = {}
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


def test_the_stream_sends_a_snapshot_then_changes_as_they_happen():
    with instance() as inst:
        server = inst.serve()
        token = inst.token("admin")
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=10) as client:
            created = client.post("/api/v1/agents", json={"type": "expert", "name": "before", "cwd": "/tmp"})
            assert created.status_code == 201, created.text
            with client.stream("GET", "/api/v1/events") as stream:
                assert stream.status_code == 200
                assert stream.headers["content-type"].startswith("text/event-stream")
                lines = stream.iter_lines()
                (snapshot,) = read_frames(lines, 1, time.monotonic() + 10)
                assert (snapshot["id"], snapshot["event"]) == ("0", "snapshot")
                assert [agent["name"] for agent in snapshot["data"]["agents"]] == ["before"]
                with httpx.Client(base_url=server.url, headers=headers, timeout=10) as other:
                    after = other.post("/api/v1/agents", json={"type": "expert", "name": "after", "cwd": "/tmp"})
                    assert after.status_code == 201, after.text
                (upsert,) = read_frames(lines, 1, time.monotonic() + 10)
                assert upsert["event"] == "agent.upsert"
                assert upsert["id"] == "1"
                assert upsert["data"]["name"] == "after"


def test_the_stream_needs_a_token_and_shows_only_the_callers_agents():
    with instance() as inst:
        server = inst.serve()
        assert httpx.get(f"{server.url}/api/v1/events", timeout=10).status_code == 401
        inst.create_user("bob")
        admin, bob = inst.token("admin"), inst.token("bob")
        httpx.post(
            f"{server.url}/api/v1/agents",
            json={"type": "expert", "name": "admins", "cwd": "/tmp"},
            headers={"Authorization": f"Bearer {admin}"},
            timeout=10,
        )
        with httpx.stream(
            "GET", f"{server.url}/api/v1/events", headers={"Authorization": f"Bearer {bob}"}, timeout=10
        ) as stream:
            (snapshot,) = read_frames(stream.iter_lines(), 1, time.monotonic() + 10)
            assert snapshot["data"]["agents"] == []
