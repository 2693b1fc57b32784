"""Two real Dispatch instances linked as peers (docs/peers.md): pair, launch on B from A,
mirror B's agent on A as a shadow, survive B going away, unlink.

Each instance has its own data dir, database, tmux server and port; each
``DISPATCH_PUBLIC_URL`` is its real address, so each side can dial the other. The same
scenario runs twice: on SQLite with the in-memory channel layer, and on PostgreSQL + Redis
(each instance its own PostgreSQL database and its own Redis key prefix; marked
``postgres`` and ``redis``, so it fails rather than skips under CI=true without them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backends import free_port
from tests.infra import PYTHON, REPO, Instance, Process, Server, instance, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


@pytest.fixture
def tmux_sockets() -> Iterator[tuple[str, str]]:
    sockets = (f"dispatch-peers-a-{uuid.uuid4().hex[:8]}", f"dispatch-peers-b-{uuid.uuid4().hex[:8]}")
    try:
        yield sockets
    finally:
        for socket in sockets:
            subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)
            (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / socket).unlink(missing_ok=True)


def serve_at(inst: Instance, port: int) -> Server:
    """``manage.py serve`` of ``inst`` on a fixed ``port`` (its public URL), waited healthy."""
    started = Process.spawn(inst.env, [PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port)], name="peer")
    server = Server(proc=started.proc, log_path=started.log_path, port=port)
    inst.servers.append(server)
    return server.wait_healthy()


class Api:
    """A user's REST client of one served instance."""

    def __init__(self, url: str, token: str) -> None:
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=40)

    def get(self, path: str) -> Any:
        response = self.client.get(path)
        assert response.status_code == 200, response.text
        return response.json()

    def post(self, path: str, body: dict[str, Any] | None = None, status: int = 201) -> Any:
        response = self.client.post(path, json=body or {})
        assert response.status_code == status, response.text
        return response.json()


STORES = [
    pytest.param(False, id="sqlite"),
    pytest.param(True, id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
]


def backend_of(inst: Instance) -> tuple[str, str]:
    """(database vendor, channel layer backend class name) as ``inst``'s own processes see them."""
    out = inst.manage(
        "shell",
        "-c",
        "from django.conf import settings; from django.db import connection; "
        "print('backend', connection.vendor, settings.CHANNEL_LAYERS['default']['BACKEND'].rsplit('.', 1)[-1])",
    ).stdout
    found = re.search(r"backend (\S+) (\S+)", out)
    assert found is not None, out
    return found.group(1), found.group(2)


@pytest.mark.parametrize("shared_services", STORES)
def test_two_linked_instances_mirror_queue_and_unlink(
    tmp_path: Path, tmux_sockets: tuple[str, str], shared_services: bool
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    port_a, port_b = free_port(), free_port()
    common: dict[str, Any] = {
        "DISPATCH_CLI_SUPERVISE_INTERVAL": "0.3",
        "DISPATCH_PEER_BACKOFF_SCALE": "0.05",
        "postgres": shared_services,
        "redis": shared_services,
        "database_prefix": "dispatch_peers_it_",
    }
    with (
        instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_a}", DISPATCH_TMUX_SOCKET=tmux_sockets[0], **common) as a,
        instance(
            DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_b}",
            DISPATCH_TMUX_SOCKET=tmux_sockets[1],
            DISPATCH_REPO_ROOTS=str(tmp_path),
            **common,
        ) as b,
    ):
        if shared_services:
            # Two separate deployments: each its own PostgreSQL database and Redis prefix.
            assert a.env["DATABASE_URL"] != b.env["DATABASE_URL"]
            assert a.env["DISPATCH_REDIS_PREFIX"] != b.env["DISPATCH_REDIS_PREFIX"]
            # The Redis layer this run asked for (DISPATCH_CHANNEL_LAYER=list: channels-redis' lists).
            layer = "RedisChannelLayer" if os.environ.get("DISPATCH_CHANNEL_LAYER") == "list" else "PubSubChannelLayer"
            assert backend_of(b) == ("postgresql", layer)
        else:
            assert "DATABASE_URL" not in a.env and "REDIS_URL" not in b.env
        server_b = serve_at(b, port_b)
        # Pair with the headless commands: B offers, A links (A's server is not needed for that).
        offer = b.manage("peer_offer").stdout
        code = re.search(r"code: (\S+)", offer)
        assert code is not None, offer
        linked = a.manage("peer_link", server_b.url, code.group(1), "--label", "Bee").stdout
        assert "linked: Bee" in linked, linked
        server_a = serve_at(a, port_a)
        api_a, api_b = Api(server_a.url, a.admin_token), Api(server_b.url, b.admin_token)
        details = lambda: f"--- A ---\n{server_a.log()[-4000:]}\n--- B ---\n{server_b.log()[-4000:]}"  # noqa: E731

        # Launch a shell agent on B from A: A answers with the shadow, seeded from B's answer.
        shadow = api_a.post(
            "/api/v1/agents",
            {"type": "shell", "name": "far", "cwd": str(repo), "prompt": "echo far-$((20+1))", "location": "bee"},
        )
        assert (shadow["peer"], shadow["type"]) == ("Bee", "shell")
        remote_id = shadow["peer_agent_id"]
        assert api_b.get(f"/api/v1/agents/{remote_id}")["name"] == "far"

        # The shadow follows B's status and events (original timestamps).
        def in_step() -> bool:
            mine, theirs = api_a.get(f"/api/v1/agents/{shadow['id']}"), api_b.get(f"/api/v1/agents/{remote_id}")
            return (
                theirs["status"] == "running"
                and mine["status"] == "running"
                and theirs["latest_event_at"] is not None
                and mine["latest_event_at"] == theirs["latest_event_at"]
                and not mine["stale"]
            )

        wait_until(in_step, timeout=40, what="the shadow in step with B's agent", details=details)
        mirrored = api_a.get(f"/api/v1/agents/{shadow['id']}/events")["events"]
        assert any(event["mirrored"] for event in mirrored)

        # B goes away: the shadow is stale with a lost-contact event; a message waits in the outbox.
        server_b.stop()
        wait_until(
            lambda: api_a.get(f"/api/v1/agents/{shadow['id']}")["stale"], timeout=30, what="stale", details=details
        )
        events = api_a.get(f"/api/v1/agents/{shadow['id']}/events")["events"]
        assert [e["message"] for e in events].count("lost contact with Bee") == 1
        message = api_a.post(f"/api/v1/agents/{shadow['id']}/messages", {"content": "echo queued-$((40+2))"})
        assert message["status"] == "queued"

        # B comes back: the shadow is fresh and the message is delivered exactly once.
        server_b = serve_at(b, port_b)
        wait_until(
            lambda: not api_a.get(f"/api/v1/agents/{shadow['id']}")["stale"],
            timeout=60,
            what="the shadow fresh again",
            details=details,
        )
        wait_until(
            lambda: api_a.get(f"/api/v1/messages/{message['id']}")["status"] == "delivered",
            timeout=60,
            what="the queued message delivered",
            details=details,
        )
        received = [
            m for m in api_b.get(f"/api/v1/agents/{remote_id}/messages")["messages"] if "queued-" in m["content"]
        ]
        assert len(received) == 1, received
        time.sleep(1)  # another drain pass or reconnect must not send it again
        received = [
            m for m in api_b.get(f"/api/v1/agents/{remote_id}/messages")["messages"] if "queued-" in m["content"]
        ]
        assert len(received) == 1, received

        # Unlink on A: the shadow stops, and B's credential is refused by A.
        (peer,) = api_a.get("/api/v1/peers")["peers"]
        response = api_a.client.delete(f"/api/v1/peers/{peer['id']}")
        assert response.status_code == 200, response.text
        wait_until(
            lambda: api_a.get(f"/api/v1/agents/{shadow['id']}")["status"] == "stopped", timeout=10, what="stopped"
        )
        refused = b.manage(
            "shell",
            "-c",
            "from asgiref.sync import async_to_sync; from peers.client import PeerClient; "
            "from peers.models import Peer; peer = Peer.objects.get(); "
            "print('status', async_to_sync(PeerClient(peer).get)('/api/v1/peers/repos').status_code)",
        ).stdout
        assert "status 401" in refused, refused
