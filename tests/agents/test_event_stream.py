"""``GET /api/v1/events`` against a real server: snapshot first, then live frames."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture
def tmux_socket() -> Iterator[str]:
    """A private tmux server for the served process (``DISPATCH_TMUX_SOCKET``), killed afterwards."""
    socket = f"dispatch-sse-tests-{uuid.uuid4().hex[:10]}"
    try:
        yield socket
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)
        (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / socket).unlink(missing_ok=True)


def frames_until(lines, wanted, deadline: float) -> list[dict]:
    """Read frames until ``wanted(frame)`` or the deadline; every frame read is returned."""
    seen: list[dict] = []
    while time.monotonic() < deadline:
        batch = read_frames(lines, 1, deadline)
        if not batch:
            break
        seen.extend(batch)
        if wanted(batch[0]):
            return seen
    raise AssertionError(f"no matching frame before the deadline; saw {[f.get('event') for f in seen]}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_stream_carries_the_pane_of_a_local_cli_agent_and_message_frames(tmp_path, tmux_socket):
    with instance() as inst:
        server = inst.serve(DISPATCH_TMUX_SOCKET=tmux_socket, DISPATCH_CLI_SUPERVISE_INTERVAL="0.3")
        headers = {"Authorization": f"Bearer {inst.token('admin')}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=10) as client:
            launched = client.post(
                "/api/v1/agents",
                json={"type": "shell", "name": "sh", "cwd": str(tmp_path), "prompt": "echo pane-$((40+2))"},
            )
            assert launched.status_code == 201, launched.text
            agent_id = launched.json()["id"]
            with client.stream("GET", "/api/v1/events", params={"pane": agent_id}) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                (snapshot,) = read_frames(lines, 1, time.monotonic() + 10)
                assert snapshot["event"] == "snapshot"
                seen = frames_until(
                    lines, lambda f: f["event"] == "pane" and "pane-42" in f["data"]["text"], time.monotonic() + 20
                )
                pane = seen[-1]
                assert pane["data"]["agent_id"] == agent_id
                texts = [f["data"]["text"] for f in seen if f["event"] == "pane"]
                assert all(a != b for a, b in itertools.pairwise(texts))  # sent only when changed
                ids = [int(f["id"]) for f in [snapshot, *seen]]
                assert ids == sorted(ids) and len(set(ids)) == len(ids)

                with httpx.Client(base_url=server.url, headers=headers, timeout=10) as other:
                    sent = other.post(f"/api/v1/agents/{agent_id}/messages", json={"content": "echo msg-$((6*7))"})
                    assert sent.status_code == 201, sent.text
                message_id = sent.json()["id"]
                seen = frames_until(
                    lines,
                    lambda f: f["event"] == "pane" and "msg-42" in f["data"]["text"],
                    time.monotonic() + 20,
                )
                created = [f for f in seen if f["event"] == "message.created"]
                updated = [f for f in seen if f["event"] == "message.updated"]
                assert created and created[0]["data"]["id"] == message_id and created[0]["data"]["status"] == "queued"
                assert any(f["data"]["id"] == message_id and f["data"]["status"] == "delivered" for f in updated)
            client.post(f"/api/v1/agents/{agent_id}/stop")


def test_a_pane_of_another_users_agent_is_refused_before_streaming(tmp_path, tmux_socket):
    with instance() as inst:
        server = inst.serve(DISPATCH_TMUX_SOCKET=tmux_socket)
        inst.create_user("bob")
        admin, bob = inst.token("admin"), inst.token("bob")
        launched = httpx.post(
            f"{server.url}/api/v1/agents",
            json={"type": "shell", "name": "sh", "cwd": str(tmp_path)},
            headers={"Authorization": f"Bearer {admin}"},
            timeout=10,
        )
        assert launched.status_code == 201, launched.text
        agent_id = launched.json()["id"]
        refused = httpx.get(
            f"{server.url}/api/v1/events", params={"pane": agent_id}, headers={"Authorization": f"Bearer {bob}"}
        )
        assert refused.status_code == 404
        assert refused.headers["content-type"].startswith("application/json")
        assert refused.json()["error"]["code"] == "NOT_FOUND"
