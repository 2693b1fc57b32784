"""Two people in Chromium link two real Dispatch instances and watch a remote agent
(the Linked instances and Agent pages; docs/peers.md#pairing, docs/peers.md#shadow-agents).

On B's Linked instances page the admin presses "Show pairing code"; on A's page the admin
fills "Connect to another instance" (B's address, that code, label "Cloud") and links; both
fingerprints are shown and match what each instance says of itself. A's Agents page then
launches a shell agent on Cloud (the location select), lands on the shadow agent's page,
and something that happens to the agent on B (a message pasted into its terminal: B's
``message delivered`` event) appears in A's Remote activity pane without a reload.

Each instance is a real ``manage.py serve`` on its own port, data dir, SQLite database and
tmux server; each ``DISPATCH_PUBLIC_URL`` is its real address. The two pages live in two
browser contexts, one per person (one browser serving both: test_two_instances_browser.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backends import free_port
from tests.infra import PYTHON, REPO, Instance, Process, Server, instance, wait_until

pytestmark = [
    pytest.mark.browser,
    pytest.mark.integration,
    pytest.mark.timeout(150),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

LIVE = 30_000  # ms: a mirrored event crosses B's stream, A's mirror and the tab's live channel


@pytest.fixture
def tmux_sockets() -> Iterator[tuple[str, str]]:
    sockets = (f"dispatch-pgb-a-{uuid.uuid4().hex[:8]}", f"dispatch-pgb-b-{uuid.uuid4().hex[:8]}")
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


@pytest.fixture
def sites(tmp_path: Path, tmux_sockets: tuple[str, str]) -> Iterator[tuple[Instance, Server, Instance, Server]]:
    """Instances A and B, both served; B's repo root is ``tmp_path``."""
    port_a, port_b = free_port(), free_port()
    common: dict[str, Any] = {"DISPATCH_CLI_SUPERVISE_INTERVAL": "0.3", "DISPATCH_PEER_BACKOFF_SCALE": "0.05"}
    with (
        instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_a}", DISPATCH_TMUX_SOCKET=tmux_sockets[0], **common) as a,
        instance(
            DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_b}",
            DISPATCH_TMUX_SOCKET=tmux_sockets[1],
            DISPATCH_REPO_ROOTS=str(tmp_path),
            **common,
        ) as b,
    ):
        yield a, serve_at(a, port_a), b, serve_at(b, port_b)


def log_in(page: Any, server: Server, password: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server.url}/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", password)
    page.click("#login-button")
    expect(page).to_have_url(f"{server.url}/")


def test_two_people_link_instances_and_watch_a_remote_agent_live(
    sites: tuple[Instance, Server, Instance, Server], browser: Any, context: Any, artifacts: Path, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    a, server_a, b, server_b = sites
    repo = tmp_path / "repo"
    repo.mkdir()
    page_a = context.new_page()
    context_b = browser.new_context(viewport={"width": 1280, "height": 900})
    context_b.set_default_timeout(15_000)
    page_b = context_b.new_page()
    try:
        log_in(page_b, server_b, b.admin_password)
        log_in(page_a, server_a, a.admin_password)

        # B: Linked instances → "Show pairing code".
        page_b.goto(f"{server_b.url}/peers/")
        fingerprint_b = page_b.locator("#our-fingerprint").inner_text().strip()
        page_b.click("#offer-form button[type=submit]")
        expect(page_b.locator("#pairing-code")).to_be_visible()
        code = page_b.locator("#pairing-code").inner_text().strip()
        assert len(code.replace("-", "")) == 8, code
        expect(page_b.locator("#offer-fingerprint")).to_have_text(fingerprint_b)
        expect(page_b.locator("#offer-address")).to_have_text(server_b.url)
        page_b.screenshot(path=str(artifacts / "peers-pairing-code.png"), full_page=True)

        # A: "Connect to another instance" with B's address, the code and the label "Cloud".
        page_a.goto(f"{server_a.url}/peers/")
        expect(page_a.locator("#no-peers")).to_be_visible()
        fingerprint_a = page_a.locator("#our-fingerprint").inner_text().strip()
        assert fingerprint_a != fingerprint_b
        page_a.fill("#link-form input[name=url]", server_b.url)
        page_a.fill("#link-form input[name=code]", code)
        page_a.fill("#link-form input[name=label]", "Cloud")
        page_a.click("#link-form button[type=submit]")
        expect(page_a.locator("#link-result")).to_contain_text("Linked to Cloud")
        expect(page_a.locator("#link-our-fingerprint")).to_have_text(fingerprint_a)
        expect(page_a.locator("#link-their-fingerprint")).to_have_text(fingerprint_b)
        expect(page_a.locator('#linked article.peer[data-label="Cloud"]')).to_contain_text(fingerprint_b)
        page_a.screenshot(path=str(artifacts / "peers-linked.png"), full_page=True)

        # B lists A, with A's fingerprint.
        page_b.goto(f"{server_b.url}/peers/")
        expect(page_b.locator("#linked article.peer")).to_have_count(1)
        expect(page_b.locator("#linked article.peer")).to_contain_text(fingerprint_a)

        # A's Agents page launches a shell agent on Cloud and lands on the shadow's page.
        page_a.goto(f"{server_a.url}/")
        expect(page_a.locator('#launch-location option[value="Cloud"]')).to_be_enabled()
        page_a.select_option("#launch-type", "shell")
        page_a.fill("#launch-form input[name=name]", "far-shell")
        page_a.fill("#launch-form input[name=cwd]", str(repo))
        # No prompt: a prompt is a message too, and its "message delivered" event would race
        # the one this test makes happen below.
        page_a.select_option("#launch-location", "Cloud")
        page_a.click("#launch")
        page_a.wait_for_url(f"{server_a.url}/agents/*/", timeout=LIVE)
        shadow_id = page_a.url.rstrip("/").rsplit("/", 1)[-1]
        api_a = httpx.Client(base_url=server_a.url, headers={"Authorization": f"Bearer {a.admin_token}"}, timeout=30)
        api_b = httpx.Client(base_url=server_b.url, headers={"Authorization": f"Bearer {b.admin_token}"}, timeout=30)
        shadow = api_a.get(f"/api/v1/agents/{shadow_id}").json()
        assert (shadow["peer"], shadow["type"], shadow["name"]) == ("Cloud", "shell", "far-shell")
        remote_id = shadow["peer_agent_id"]
        remote = api_b.get(f"/api/v1/agents/{remote_id}").json()
        assert (remote["name"], remote["cwd"]) == ("far-shell", str(repo))

        expect(page_a.locator("#remote-activity")).to_be_visible()
        expect(page_a.locator("#mirror-state")).to_have_text("Mirroring live", timeout=LIVE)
        delivered = page_a.locator("#remote-timeline li.event-system", has_text="message delivered")
        expect(delivered).to_have_count(0)
        page_a.screenshot(path=str(artifacts / "peers-shadow-live.png"), full_page=True)

        # Something happens on B: a message pasted into the agent's terminal there. Wait until
        # B has the agent running (its supervisor pastes messages into a live pane only).
        wait_until(
            lambda: api_b.get(f"/api/v1/agents/{remote_id}").json()["status"] == "running",
            timeout=30,
            what="B's agent running",
        )
        page_a.evaluate("window.sameDocument = true")
        sent = api_b.post(f"/api/v1/agents/{remote_id}/messages", json={"content": "echo hello-$((6*7))"})
        assert sent.status_code == 201, sent.text
        wait_until(
            lambda: api_b.get(f"/api/v1/messages/{sent.json()['id']}").json()["status"] == "delivered",
            timeout=30,
            what="the message delivered on B",
        )
        # … and A's page shows it live, without a reload.
        expect(delivered).to_have_count(1, timeout=LIVE)
        assert page_a.evaluate("window.sameDocument") is True
        expect(page_a.locator("#mirror-state")).to_have_text("Mirroring live")
        page_a.screenshot(path=str(artifacts / "peers-shadow-event-live.png"), full_page=True)
    except BaseException:
        page_a.screenshot(path=str(artifacts / "peers-failure-a.png"), full_page=True)
        page_b.screenshot(path=str(artifacts / "peers-failure-b.png"), full_page=True)
        print(f"--- A log ---\n{server_a.log()[-6000:]}\n--- B log ---\n{server_b.log()[-6000:]}")
        raise
    finally:
        context_b.close()


# --- the first hour with linked instances -------------------------------------------------------


@pytest.fixture
def twins() -> Iterator[tuple[Instance, Server, Instance, Server]]:
    """Instances A and B, both served on the ports their ``DISPATCH_PUBLIC_URL`` names; both
    get the same name in the test (as two fresh installs on one computer both start with
    its host name)."""
    port_a, port_b = free_port(), free_port()
    with (
        instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_a}") as a,
        instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_b}") as b,
    ):
        yield a, serve_at(a, port_a), b, serve_at(b, port_b)


def name_instance(page: Any, server: Server, name: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server.url}/peers/")
    page.fill("#this-instance input[name=name]", name)
    page.click("#this-instance button[type=submit]")
    expect(page.locator("#this-instance input[name=name]")).to_have_value(name)


def test_two_instances_with_the_same_name_link_under_labels_naming_each_others_address(
    twins: tuple[Instance, Server, Instance, Server], browser: Any, context: Any, artifacts: Path
) -> None:
    from playwright.sync_api import expect

    a, server_a, b, server_b = twins
    page_a = context.new_page()
    context_b = browser.new_context(viewport={"width": 1280, "height": 900})
    context_b.set_default_timeout(15_000)
    page_b = context_b.new_page()
    try:
        log_in(page_a, server_a, a.admin_password)
        log_in(page_b, server_b, b.admin_password)
        name_instance(page_a, server_a, "devbox")
        name_instance(page_b, server_b, "devbox")

        page_b.click("#offer-form button[type=submit]")
        code = page_b.locator("#pairing-code").inner_text().strip()

        # A links without typing a label: B reports A's own name, so A proposes one naming B's address.
        page_a.fill("#link-form input[name=url]", server_b.url)
        page_a.fill("#link-form input[name=code]", code)
        page_a.click("#link-form button[type=submit]")
        label_b = f"devbox at 127.0.0.1 port {server_b.port}"
        expect(page_a.locator("#link-result")).to_contain_text(f"Linked to {label_b}")
        expect(page_a.locator("#link-same-name")).to_contain_text("the same name as this instance")
        card_a = page_a.locator("#linked article.peer")
        expect(card_a).to_have_count(1)
        expect(card_a).to_have_attribute("data-label", label_b)
        expect(card_a.locator(".calls-itself")).to_have_text("calls itself devbox (the same name as this instance)")
        page_a.screenshot(path=str(artifacts / "peers-same-name-linked.png"), full_page=True)

        # B, which took the claim, labels A by A's address the same way.
        page_b.goto(f"{server_b.url}/peers/")
        card_b = page_b.locator("#linked article.peer")
        expect(card_b).to_have_count(1)
        expect(card_b).to_have_attribute("data-label", f"devbox at 127.0.0.1 port {server_a.port}")
        expect(card_b.locator(".calls-itself")).to_have_text("calls itself devbox (the same name as this instance)")
        page_b.screenshot(path=str(artifacts / "peers-same-name-claimed.png"), full_page=True)
    except BaseException:
        page_a.screenshot(path=str(artifacts / "peers-same-name-failure-a.png"), full_page=True)
        page_b.screenshot(path=str(artifacts / "peers-same-name-failure-b.png"), full_page=True)
        print(f"--- A log ---\n{server_a.log()[-6000:]}\n--- B log ---\n{server_b.log()[-6000:]}")
        raise
    finally:
        context_b.close()


A_PEER = """
import secrets
from django.contrib.auth import get_user_model
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from core import secrets_at_rest
from core.services import generate_token, token_digest
from peers.keys import b64url, fingerprint_of
from peers.models import Peer

public = b64url(Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
inbound = generate_token()
Peer.objects.create(
    owner=get_user_model().objects.get(username="admin"), instance_id="inst_" + secrets.token_hex(6),
    label="Cloud", reported_name="cloud", url="http://127.0.0.1:9", public_key=public,
    fingerprint=fingerprint_of(public), inbound_digest=token_digest(inbound), inbound_prefix=inbound[:8],
    outbound_token_encrypted=secrets_at_rest.encrypt(generate_token().encode()),
)
"""

# Per checkbox under ``scope``: its box and the box of the first line of its label's text.
CHECKBOX_GEOMETRY = """
scope => Array.from(document.querySelectorAll(scope + ' input[type=checkbox]')).map(box => {
  const label = box.closest('label');
  const range = document.createRange();
  range.selectNodeContents(label);
  range.setStartAfter(box);
  const line = Array.from(range.getClientRects()).find(rect => rect.width > 0 && rect.height > 0);
  const b = box.getBoundingClientRect();
  return {
    name: box.name,
    text: range.toString().trim(),
    box: {top: b.top, bottom: b.bottom, left: b.left, right: b.right},
    line: line ? {top: line.top, bottom: line.bottom, left: line.left, right: line.right} : null,
  };
})
"""


def assert_checkboxes_inline(page: Any, scope: str, expected: int) -> None:
    """Each checkbox under ``scope`` is vertically centred within the line box of its
    label's text, and left of that text (the page used to put it on a line of its own)."""
    found = page.evaluate(CHECKBOX_GEOMETRY, scope)
    assert len(found) == expected, found
    for checkbox in found:
        box, line = checkbox["box"], checkbox["line"]
        assert line is not None and checkbox["text"], checkbox
        middle = (box["top"] + box["bottom"]) / 2
        assert line["top"] <= middle <= line["bottom"], f"{scope} {checkbox['name']}: off its text's line: {checkbox}"
        assert box["right"] <= line["left"], f"{scope} {checkbox['name']}: not left of its text: {checkbox}"


def test_each_permission_checkbox_sits_inline_before_its_label(context: Any, artifacts: Path) -> None:
    with instance() as site:
        site.manage("shell", "-c", A_PEER)
        server = site.serve()
        page = context.new_page()
        try:
            log_in(page, server, site.admin_password)
            page.goto(f"{server.url}/peers/")
            assert_checkboxes_inline(page, "#offer-form", 4)
            assert_checkboxes_inline(page, "#link-form", 4)
            page.click("#linked article.peer details summary")  # the link's own permissions
            assert_checkboxes_inline(page, "#linked article.peer details form", 4)
            page.screenshot(path=str(artifacts / "peers-checkboxes.png"), full_page=True)
            # The admin's pairing page has the same switches.
            page.goto(f"{server.url}/admin/peers/peer/pairing/")
            assert_checkboxes_inline(page, "#admin-offer-form", 4)
            assert_checkboxes_inline(page, "#admin-link-form", 4)
            page.screenshot(path=str(artifacts / "peers-admin-checkboxes.png"), full_page=True)
        except BaseException:
            page.screenshot(path=str(artifacts / "peers-checkboxes-failure.png"), full_page=True)
            print("--- server log ---\n" + server.log()[-6000:])
            raise
