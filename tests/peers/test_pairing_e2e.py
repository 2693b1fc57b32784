"""Pairing two real instances end to end (docs/peers.md#headless).

Two ``manage.py serve`` subprocesses with their own data dirs and ``DISPATCH_PUBLIC_URL``:
``peer_offer`` on B prints a code, ``peer_link`` on A types it; then each side holds a
live link whose fingerprint is the other's, and A's token opens B's peer API.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.backends import free_port
from tests.infra import PYTHON, REPO, Instance, Process, Server, instance, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def serve_on(inst: Instance, port: int) -> Server:
    """``manage.py serve`` on ``port`` (the one its ``DISPATCH_PUBLIC_URL`` names)."""
    started = Process.spawn(
        inst.env, [PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port)], name=f"serve-{port}"
    )
    server = Server(proc=started.proc, log_path=started.log_path, port=port)
    inst.servers.append(server)
    return server


def field(output: str, name: str) -> str:
    found = re.search(rf"^{name}: (.+)$", output, re.MULTILINE)
    assert found, output
    return found.group(1).strip()


def test_two_instances_pair_with_the_commands_and_each_pins_the_others_key() -> None:
    port_a, port_b = free_port(), free_port()
    with (
        instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_a}") as a,
        instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_b}") as b,
    ):
        server_a, server_b = serve_on(a, port_a), serve_on(b, port_b)
        server_a.wait_healthy()
        server_b.wait_healthy()

        offered = b.manage("peer_offer", "--no-events").stdout
        code, address, b_fingerprint = field(offered, "code"), field(offered, "address"), field(offered, "fingerprint")
        assert re.fullmatch(r"[BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4}", code)
        assert address == server_b.url

        link = a.manage("peer_link", address, code.lower(), "--label", "Bee", "--full-access")
        assert "nothing answers" not in link.stderr  # A serves on the DISPATCH_PUBLIC_URL it gave B
        linked = link.stdout
        a_fingerprint, their = field(linked, "our fingerprint"), field(linked, "their fingerprint")
        assert their == b_fingerprint

        on_a = server_a.get("/api/v1/peers", a.admin_token).json()["peers"]
        on_b = server_b.get("/api/v1/peers", b.admin_token).json()["peers"]
        assert [(p["label"], p["fingerprint"], p["url"]) for p in on_a] == [("Bee", b_fingerprint, server_b.url)]
        assert [(p["fingerprint"], p["url"]) for p in on_b] == [(a_fingerprint, server_a.url)]
        # Each side's grants, as it set them and as the other side was told.
        assert on_b[0]["capabilities"]["allow_events"] is False
        assert on_a[0]["granted_by_peer"]["allow_events"] is False
        assert on_a[0]["capabilities"]["allow_full_access"] is True
        assert on_b[0]["granted_by_peer"]["allow_full_access"] is True

        # The code was single use: typing it again is refused with the one message.
        replay = a.manage("peer_link", address, code, check=False)
        assert replay.returncode == 1
        assert "pairing code is unknown, used or expired" in replay.stderr

        # The tokens work: A's signed request with B's token is accepted by B's peer API.
        answer = a.manage(
            "shell",
            "-c",
            "import asyncio; from peers.client import PeerClient; from peers.models import Peer; "
            "peer = Peer.objects.get(label='Bee'); "
            "print('status', asyncio.run(PeerClient(peer).get('/api/v1/peers/repos')).status_code)",
        ).stdout
        assert "status 200" in answer, answer

        # Unlinking on A revokes A's side at once and tells B, which revokes its side too.
        gone = httpx.delete(
            f"{server_a.url}/api/v1/peers/{on_a[0]['id']}", headers={"Authorization": f"Bearer {a.admin_token}"}
        )
        assert gone.status_code == 200, gone.text
        assert server_a.get("/api/v1/peers", a.admin_token).json()["peers"] == []
        wait_until(
            lambda: server_b.get("/api/v1/peers", b.admin_token).json()["peers"] == [],
            timeout=20,
            what="B to revoke the link A unlinked",
            details=server_a.log,
        )
        told = b.manage(
            "shell",
            "-c",
            "from peers.models import Peer; print('unlinked_by_peer', Peer.objects.get().unlinked_by_peer)",
        ).stdout
        assert "unlinked_by_peer True" in told
