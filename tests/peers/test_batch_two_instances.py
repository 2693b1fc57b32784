"""Two real instances paired with the headless commands announce ``messages.batch`` to each
other, and mail queued on A while B was away reaches B once each, in order, when B comes
back: the batch route between two servers.

The same servers and fixtures as tests/integration/test_two_instances.py (SQLite, the
in-memory channel layer); B's agents are experts (no LLM configured: a message queues a
run that fails fast), so no tmux is needed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backends import free_port
from tests.infra import PYTHON, REPO, Instance, Process, Server, instance, wait_until

pytestmark = pytest.mark.integration


def serve_at(inst: Instance, port: int) -> Server:
    started = Process.spawn(inst.env, [PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port)], name="peer")
    server = Server(proc=started.proc, log_path=started.log_path, port=port)
    inst.servers.append(server)
    return server.wait_healthy()


def features_of(inst: Instance) -> list[str]:
    out = inst.manage(
        "shell", "-c", "import json; from peers.models import Peer; print(json.dumps(Peer.objects.get().features))"
    ).stdout
    return list(json.loads(out.strip().splitlines()[-1]))


def test_two_instances_announce_the_batch_and_deliver_a_queued_backlog_in_order(tmp_path: Path) -> None:
    port_a, port_b = free_port(), free_port()
    common: dict[str, Any] = {"DISPATCH_PEER_BACKOFF_SCALE": "0.05", "DISPATCH_PEER_BATCH_MESSAGES": "5"}
    with (
        instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_a}", **common) as a,
        instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_b}", **common) as b,
    ):
        server_b = serve_at(b, port_b)
        code = re.search(r"code: (\S+)", b.manage("peer_offer").stdout)
        assert code is not None
        assert "linked: Bee" in a.manage("peer_link", server_b.url, code.group(1), "--label", "Bee").stdout
        # Both sides learnt it from the claim and its answer, before any other request.
        assert features_of(a) == ["messages.batch"] and features_of(b) == ["messages.batch"]
        server_a = serve_at(a, port_a)
        api_a = httpx.Client(base_url=server_a.url, headers={"Authorization": f"Bearer {a.admin_token}"}, timeout=30)
        api_b = httpx.Client(base_url=server_b.url, headers={"Authorization": f"Bearer {b.admin_token}"}, timeout=30)
        details = lambda: f"--- A ---\n{server_a.log()[-3000:]}\n--- B ---\n{server_b.log()[-3000:]}"  # noqa: E731

        far = api_b.post("/api/v1/agents", json={"type": "expert", "name": "far", "cwd": str(tmp_path)}).json()
        shadows: list[str] = []

        def shadow_seen() -> bool:
            agents = api_a.get("/api/v1/agents").json()["agents"]
            shadows[:] = [agent["id"] for agent in agents if agent.get("peer_agent_id") == far["id"]]
            return bool(shadows)

        wait_until(shadow_seen, timeout=40, what="the shadow of B's agent on A", details=details)

        server_b.stop()
        sent = [
            api_a.post(f"/api/v1/agents/{shadows[0]}/messages", json={"content": f"queued {n}"}).json()
            for n in range(12)
        ]
        assert all(message["status"] == "queued" for message in sent)
        server_b = serve_at(b, port_b)

        wait_until(
            lambda: all(api_a.get(f"/api/v1/messages/{m['id']}").json()["status"] == "delivered" for m in sent),
            timeout=60,
            what="the backlog delivered",
            details=details,
        )
        arrived = api_b.get(f"/api/v1/agents/{far['id']}/messages", params={"limit": 200}).json()["messages"]
        contents = [m["content"] for m in sorted(arrived, key=lambda m: m["id"]) if m["content"].startswith("queued")]
        assert contents == [f"queued {n}" for n in range(12)]
        assert features_of(a) == ["messages.batch"]
