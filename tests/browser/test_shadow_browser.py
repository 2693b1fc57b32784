"""A person in Chromium sees a shadow agent (docs/peers.md#shadow-agents):
its peer badge and nesting on the Agents page, the launch form's location select, the
Remote activity pane — and the pane turning to "Link down" live, without a reload, when
the peer's event stream drops.

The peer is a stand-in HTTP server in this test: it answers the mirror's
``GET /api/v1/peers/events`` with stream headers and then holds the connection, until the
test closes it. The real ``manage.py serve`` mirror then marks the peer's shadows stale
(a ``system`` event "lost contact with Cloud"), which reaches the page over the tab's SSE.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.infra import Instance, Server, instance, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(120)]

USERNAME = "gil"
PASSWORD = "browser-test-pw-91"  # a throwaway instance's user
LIVE = 20_000  # ms


class HeldStream:
    """A TCP server that answers every GET with event-stream headers (then ``snapshot``, a
    frame, when given) and holds the connection open until ``drop()`` closes every one of
    them, and refuses every POST (a launch) with 403 ``CAPABILITY_NOT_GRANTED``. While
    ``down`` is set it answers every GET 503 instead (the peer is away)."""

    def __init__(self, snapshot: bytes = b"") -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.snapshot = snapshot
        self.down = False
        self.held: list[socket.socket] = []
        self.requests: list[str] = []
        self.connected = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            head = b""
            conn.settimeout(10)
            try:
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    head += chunk
                if head.startswith(b"POST"):  # a launch: refused the way a real peer refuses it
                    body = b'{"error": {"code": "CAPABILITY_NOT_GRANTED", "message": "launch is not permitted"}}'
                    conn.sendall(
                        b"HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\nconnection: close\r\n"
                        + b"content-length: %d\r\n\r\n" % len(body)
                        + body
                    )
                    conn.close()
                    continue
                if self.down:
                    conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
                    conn.close()
                    continue
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\r\n")
                conn.sendall(self.snapshot)
            except OSError:
                conn.close()
                continue
            with self._lock:
                self.requests.append(head.split(b"\r\n", 1)[0].decode("latin-1"))
                self.held.append(conn)
            self.connected.set()

    def drop(self) -> None:
        with self._lock:
            for conn in self.held:
                conn.close()
            self.held.clear()
            self.connected.clear()

    def close(self) -> None:
        self.drop()
        self.listener.close()


SETUP = """
import json, secrets
from datetime import timedelta
from django.contrib.auth import get_user_model
from django.utils import timezone
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from core import secrets_at_rest
from agents.models import Agent, AgentEvent
from core.services import generate_token, token_digest
from peers.keys import b64url, fingerprint_of
from peers.models import Peer

config = json.loads({config!r})
user = get_user_model().objects.get(username=config["user"])
public = b64url(Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
inbound = generate_token()
now = timezone.now()
peer = Peer.objects.create(
    owner=user, instance_id="inst_" + secrets.token_hex(6), label="Cloud", reported_name="cloud",
    url=config["url"], public_key=public, fingerprint=fingerprint_of(public),
    inbound_digest=token_digest(inbound), inbound_prefix=inbound[:8],
    outbound_token_encrypted=secrets_at_rest.encrypt(generate_token().encode()), last_seen_at=now,
)
lead = Agent.objects.create(owner=user, name="remote-lead", type="claude", status="running", cwd="/srv/repo",
                            peer=peer, peer_agent_id="agt_aaaaaaaaaaaa")
helper = Agent.objects.create(owner=user, name="remote-helper", type="claude", status="running", cwd="/srv/repo",
                              peer=peer, peer_agent_id="agt_bbbbbbbbbbbb", parent=lead)
AgentEvent.objects.create(agent=lead, type="working", message="reading the parser", mirrored=True,
                          created_at=now - timedelta(minutes=3))
AgentEvent.objects.create(agent=lead, type="blocked", message="needs the staging password", mirrored=True,
                          created_at=now - timedelta(minutes=1))
print(json.dumps({{"lead": lead.pk, "helper": helper.pk}}))
"""


@pytest.fixture
def stand_in() -> Iterator[HeldStream]:
    server = HeldStream()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def live(stand_in: HeldStream) -> Iterator[tuple[Instance, Server, dict[str, str]]]:
    with instance() as site:
        site.create_user(USERNAME, PASSWORD)
        config = json.dumps({"user": USERNAME, "url": f"http://127.0.0.1:{stand_in.port}"})
        ids = json.loads(site.manage("shell", "-c", SETUP.format(config=config)).stdout.strip().splitlines()[-1])
        server = site.serve(DISPATCH_PEER_BACKOFF_SCALE="0.2")
        yield site, server, ids


def shoot(page: Any, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)


def test_a_user_watches_a_shadow_agent_and_sees_the_link_go_down_live(live, stand_in, context, artifacts, tmp_path):
    from playwright.sync_api import expect

    _, server, ids = live
    page = context.new_page()
    try:
        page.goto(f"{server.url}/")
        page.fill("input[name=username]", USERNAME)
        page.fill("input[name=password]", PASSWORD)
        page.click("#login-button")
        expect(page).to_have_url(f"{server.url}/")

        # The shadow rows: the peer's badge, the sub-agent nested under its parent.
        lead_row = page.locator(f'tr[data-agent="{ids["lead"]}"]')
        helper_row = page.locator(f'tr[data-agent="{ids["helper"]}"]')
        expect(lead_row.locator(".peer-badge")).to_have_text("Cloud")
        expect(helper_row).to_have_attribute("data-depth", "1")
        assert page.locator("tr[data-agent]").evaluate_all("rows => rows.map(r => r.dataset.agent)") == [
            ids["lead"],
            ids["helper"],
        ]
        # The location select offers the peer; a launch there goes through the API from the
        # page's script and its refusal is shown on the page (nothing is launched here).
        expect(page.locator('#launch-location option[value="Cloud"]')).to_be_enabled()
        shoot(page, artifacts / "shadow-agents.png")
        page.select_option("#launch-type", "shell")  # no model endpoint here: no default type
        page.fill("#launch-form input[name=name]", "far-away")
        page.fill("#launch-form input[name=cwd]", str(tmp_path))
        page.select_option("#launch-location", "Cloud")
        page.click("#launch")
        expect(page.locator("#launch-error")).to_be_visible()
        expect(page.locator("#launch-error")).to_contain_text("Could not launch on Cloud:")
        expect(page.locator("#launch-error")).to_contain_text("launch is not permitted")
        expect(page).to_have_url(f"{server.url}/")

        # The shadow's page: the Remote activity pane, live while the peer's stream is up.
        assert stand_in.connected.wait(20), "the mirror never opened the peer's event stream"
        assert stand_in.requests[0].startswith("GET /api/v1/peers/events")
        lead_row.locator("a").first.click()
        expect(page).to_have_url(f"{server.url}/agents/{ids['lead']}/")
        expect(page.locator("#mirror-state")).to_have_text("Mirroring live")
        expect(page.locator("#remote-timeline li.event-blocked")).to_contain_text("needs the staging password")
        expect(page.locator("#pane")).to_have_count(0)
        shoot(page, artifacts / "shadow-agent-live.png")

        # The stream drops: the page turns to "Link down" without a reload.
        page.evaluate("window.sameDocument = true")
        stand_in.drop()
        expect(page.locator("#mirror-state")).to_contain_text("Link down — last known state", timeout=LIVE)
        expect(page.locator("#remote-timeline li.lost-contact").first).to_contain_text("lost contact with Cloud")
        assert page.evaluate("window.sameDocument") is True
        assert re.search(r"Mirroring live", page.locator("#mirror-state").inner_text()) is None
        shoot(page, artifacts / "shadow-agent-link-down.png")
    except BaseException:
        page.screenshot(path=str(artifacts / "shadow-failure.png"), full_page=True)
        print("--- server log ---\n" + server.log())
        raise


# --- the peer comes back ---------------------------------------------------------------------------

SNAPSHOT = (
    "event: snapshot\ndata: "
    + json.dumps(
        {
            "agents": [
                {"id": "agt_aaaaaaaaaaaa", "name": "remote-lead", "type": "claude", "status": "running"},
                {
                    "id": "agt_bbbbbbbbbbbb",
                    "name": "remote-helper",
                    "type": "claude",
                    "status": "running",
                    "parent_id": "agt_aaaaaaaaaaaa",
                },
            ]
        }
    )
    + "\n\n"
).encode()


@pytest.fixture
def returning_peer() -> Iterator[HeldStream]:
    server = HeldStream(snapshot=SNAPSHOT)
    try:
        yield server
    finally:
        server.close()


def log_in_as(page: Any, server: Server) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server.url}/")
    page.fill("input[name=username]", USERNAME)
    page.fill("input[name=password]", PASSWORD)
    page.click("#login-button")
    expect(page).to_have_url(f"{server.url}/")


def _contact_notes(server: Server, token: str, agent_id: str) -> list[str]:
    events = server.get(f"/api/v1/agents/{agent_id}/events", token).json()["events"]
    return [e["message"] for e in events if e["type"] == "system" and "contact" in e["message"]]


def test_a_shadow_says_contact_is_restored_when_its_peer_is_back_live_and_after_the_tab_reconnects(
    returning_peer: HeldStream, context: Any, artifacts: Path
) -> None:
    from playwright.sync_api import expect

    stand_in = returning_peer
    with instance() as site:
        site.create_user(USERNAME, PASSWORD)
        token = site.token(USERNAME)
        config = json.dumps({"user": USERNAME, "url": f"http://127.0.0.1:{stand_in.port}"})
        ids = json.loads(site.manage("shell", "-c", SETUP.format(config=config)).stdout.strip().splitlines()[-1])
        server = site.serve(DISPATCH_PEER_BACKOFF_SCALE="0.05")
        page = context.new_page()
        try:
            log_in_as(page, server)
            assert stand_in.connected.wait(20), "the mirror never opened the peer's event stream"
            page.goto(f"{server.url}/agents/{ids['lead']}/")
            state = page.locator("#mirror-state")
            lost = page.locator("#remote-timeline li.lost-contact")
            restored = page.locator("#remote-timeline li.contact-restored")
            expect(state).to_have_text("Mirroring live")
            expect(restored).to_have_count(0)  # the first snapshot restores nothing: nothing was lost
            page.evaluate("window.sameDocument = true")

            # The peer's stream drops and is back at once (a peer restarting): "lost contact",
            # then "contact restored" a moment later — the page ends on the latter, live.
            stand_in.drop()
            expect(lost).to_have_count(1, timeout=LIVE)
            expect(restored).to_have_count(1, timeout=LIVE)
            expect(page.locator("#remote-timeline li").first).to_contain_text("contact restored with Cloud")
            expect(state).to_have_text("Mirroring live")
            assert page.evaluate("window.sameDocument") is True
            shoot(page, artifacts / "shadow-agent-contact-restored.png")

            # The peer goes away for a while: "Link down". It comes back while the tab's own
            # event stream is down too: the user logs out in another tab (which ends this tab's
            # stream) and back in, and this tab's reconnects are held off until the note is
            # recorded. When its stream reconnects, the page catches up without a reload.
            stand_in.down = True
            stand_in.drop()
            expect(state).to_contain_text("Link down — last known state", timeout=LIVE)
            expect(lost).to_have_count(2)
            # Let the burst's trailing re-fetch (≤ 500 ms after the first) happen while still
            # logged in: one after the logout would send this tab to the login page.
            page.wait_for_timeout(1000)
            page.route("**/api/v1/events*", lambda route: route.abort())
            other = context.new_page()
            other.goto(f"{server.url}/")
            other.click(".logout button")
            expect(page.locator("body.offline")).to_have_count(1, timeout=LIVE)  # this tab's stream ended
            stand_in.down = False
            wait_until(
                lambda: _contact_notes(server, token, ids["lead"]).count("contact restored with Cloud") == 2,
                timeout=30,
                interval=0.25,
                what="the second 'contact restored' recorded",
            )
            log_in_as(other, server)
            expect(restored).to_have_count(1)  # this tab has not heard of it yet
            page.unroute("**/api/v1/events*")
            expect(restored).to_have_count(2, timeout=LIVE)
            expect(page.locator("#remote-timeline li").first).to_contain_text("contact restored with Cloud")
            expect(state).to_have_text("Mirroring live")
            expect(page.locator("body.offline")).to_have_count(0)
            assert page.evaluate("window.sameDocument") is True
        except BaseException:
            page.screenshot(path=str(artifacts / "shadow-restored-failure.png"), full_page=True)
            print("--- server log ---\n" + server.log()[-8000:])
            raise
