"""Real OAuth clients against ``/mcp/oauth`` on a real ``manage.py serve``
(docs/mcp.md#oauth): the official TypeScript MCP SDK's own ``auth()`` (registered by DCR,
then by a Client ID Metadata Document), and mcp-remote, the stdio bridge desktop apps run,
each signing in through Chromium (login, consent, Allow) and then using the tools.

The server sits behind ``RecordingProxy`` at its public URL, so each test knows the
requests every client made, in order (printed: ``pytest -s`` shows them). Without
``node``, the test clients (``make tests/clients/node_modules/.installed``) or Chromium
the tests are skipped locally and fail under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.tls import self_signed_certificate
from tests.backends import free_port, unavailable
from tests.infra import REPO, Instance, Server, instance, wait_until
from tests.mcp.test_mcp_typescript_client import NodeClient as TypeScriptClient
from tests.oauth.flow import INITIALIZE, MCP_HEADERS
from tests.oauth.oauth_proxy import Exchange, RecordingProxy

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(180)]

CLIENTS = REPO / "tests" / "clients"
SCRIPT = CLIENTS / "mcp_oauth_client.mjs"
MCP_REMOTE = CLIENTS / "node_modules" / ".bin" / "mcp-remote"
INSTALL = "apt-get install nodejs npm && make tests/clients/node_modules/.installed"
ALLOW = "#consent-allow, input[name=allow]"  # Dispatch's consent page, or django-oauth-toolkit's stock one
DENY = "#consent-deny, input[type=submit]:not([name=allow])"


def node_or_skip() -> str:
    """The ``node`` binary, with the SDK and mcp-remote installed; else skip (fail on CI)."""
    node = shutil.which("node")
    if node is None:
        unavailable(f"node is not installed; install it and the test clients with: {INSTALL}")
    if not (SCRIPT.exists() and MCP_REMOTE.exists()):
        unavailable(f"the test clients are not installed: {INSTALL}")
    return node


@pytest.fixture(scope="module")
def inst() -> Iterator[Instance]:
    with instance() as created:
        yield created


@contextmanager
def served(inst: Instance, **env: str) -> Iterator[tuple[Server, RecordingProxy]]:
    """A server whose public URL (issuer, resource) is a recording proxy in front of it."""
    proxy = RecordingProxy()
    overrides: dict[str, Any] = {"DISPATCH_PUBLIC_URL": proxy.url, **env}
    server = inst.serve(**overrides)
    proxy.start(server.port)
    try:
        yield server, proxy
    finally:
        proxy.close()
        server.stop()


def report(name: str, exchanges: list[Exchange]) -> None:
    """Print a client's requests in order (what docs/mcp.md#oauth describes as its flow)."""
    print(f"\n{name}: {len(exchanges)} requests")
    for number, exchange in enumerate(exchanges, 1):
        print(f"  {number:2}. {exchange}")


class NodeClient(TypeScriptClient):
    """``node mcp_oauth_client.mjs``: the TypeScript MCP client's runner, with commands on its stdin."""

    script = SCRIPT

    def __init__(self, node: str, *args: str) -> None:
        super().__init__(node, *args, stdin=True)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def steps(self, step: str) -> list[dict[str, Any]]:
        """Every line of ``step`` read so far (by ``until``)."""
        return [line for line in self.seen if line["step"] == step]


def sign_in(browser: Any, authorization_url: str, password: str, callback: str, *, button: str = ALLOW) -> str:
    """Open ``authorization_url`` in a fresh Chromium profile, log in on ``/login/`` as
    ``admin``, press Allow (or ``button``) on the consent page; returns the consent page's
    text once the browser has landed on ``callback`` (the client's loopback redirect URI)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    try:
        page = context.new_page()
        page.goto(authorization_url)
        page.wait_for_url("**/login/**")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", password)
        page.click("#login-button")
        page.wait_for_selector(ALLOW)
        consent = str(page.inner_text("body"))
        page.click(button)
        page.wait_for_url(f"{callback}**")
        return consent
    finally:
        context.close()


def applications(inst: Instance) -> list[dict[str, str]]:
    """The OAuth applications in the database: client_id, name, registration_source."""
    listed = inst.manage(
        "shell",
        "-c",
        "import json; from oauth2_provider.models import get_application_model; "
        "print(json.dumps(list(get_application_model().objects.values('client_id', 'name', 'registration_source'))))",
    )
    return list(json.loads(listed.stdout.strip().splitlines()[-1]))


def revoke(proxy: RecordingProxy, token: str, hint: str, client_id: str) -> None:
    """RFC 7009 §2.1 revocation, as a client (or its user's tooling) sends it."""
    data = {"token": token, "token_type_hint": hint, "client_id": client_id}
    answer = httpx.post(f"{proxy.url}/oauth/revoke/", data=data, timeout=10)
    assert answer.status_code == 200, answer.text


def refresh(proxy: RecordingProxy, refresh_token: str, client_id: str) -> httpx.Response:
    data = {"grant_type": "refresh_token", "refresh_token": refresh_token, "client_id": client_id}
    return httpx.post(f"{proxy.url}/oauth/token/", data=data, timeout=10)


def mcp_status(proxy: RecordingProxy, access_token: str) -> int:
    """The status of an ``initialize`` to ``/mcp/oauth`` with ``access_token``."""
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {access_token}"}
    return httpx.post(f"{proxy.url}/mcp/oauth", json=INITIALIZE, headers=headers, timeout=10).status_code


def test_the_typescript_sdk_registers_signs_in_in_chromium_and_loses_its_session_to_revocation(
    inst: Instance, browser: Any
) -> None:
    node = node_or_skip()
    callback_port = free_port()
    callback = f"http://127.0.0.1:{callback_port}/callback"
    with served(inst) as (_server, proxy):
        client = NodeClient(node, f"{proxy.url}/mcp/oauth", str(callback_port))
        try:
            registered = client.until("registered")
            authorize = client.until("authorize")["url"]
            assert authorize.startswith(f"{proxy.url}/oauth/authorize/?")
            consent = sign_in(browser, authorize, inst.admin_password, callback)
            assert "Dispatch suite (TypeScript SDK)" in consent
            returned = client.until("callback")
            assert returned["state_ok"] and returned["iss"] == returned["issuer"] == f"{proxy.url}/oauth"
            first = client.until("tokens")
            assert first["refresh_token"] and first["scope"] == "mcp"
            assert client.until("connected")["protocolVersion"] == "2025-11-25"
            client.until("stream_open")
            names = client.until("tools")["names"]
            assert "list_agents" in names and "local_pc_execute_command" in names
            client.until("ready")
            client.send("call list_agents")
            assert client.until("called")["isError"] is False
            client.until("ready")
            signed_in = len(proxy.exchanges)
            [application] = [app for app in applications(inst) if app["client_id"] == registered["client_id"]]
            assert application["registration_source"] == "dcr"

            # Revoking the access token (RFC 7009) ends the open event stream within the
            # watchdog's ~2 s, and the session with it: django-oauth-toolkit refuses a refresh
            # token whose access token is gone, so the SDK's reconnect gets a 401, its refresh
            # is refused, it drops the tokens and asks for a new sign-in.
            revoke(proxy, first["access_token"], "access_token", registered["client_id"])
            revoked_at = time.monotonic()
            assert client.until("stream_closed", timeout=5)["error"] is None
            print(f"GET stream ended {time.monotonic() - revoked_at:.2f}s after the revocation")
            assert client.until("invalidated", timeout=10)["scope"] == "tokens"
            again = client.until("authorize", timeout=10)["url"]
            assert again.startswith(f"{proxy.url}/oauth/authorize/?")
            assert mcp_status(proxy, first["access_token"]) == 401
            assert refresh(proxy, first["refresh_token"], registered["client_id"]).status_code == 400
            client.send("call list_agents")
            failed = client.until("call_failed", timeout=10)
            assert failed["name"] == "UnauthorizedError", failed
            assert len(client.steps("tokens")) == 1
            report("TypeScript SDK (DCR): sign-in", proxy.exchanges[:signed_in])
            report("TypeScript SDK (DCR): revocation", proxy.since(signed_in))
        finally:
            client.stop()


def test_cancel_on_the_consent_page_sends_the_sdk_access_denied_with_state_and_iss(
    inst: Instance, browser: Any
) -> None:
    node = node_or_skip()
    callback_port = free_port()
    callback = f"http://127.0.0.1:{callback_port}/callback"
    with served(inst) as (_server, proxy):
        client = NodeClient(node, f"{proxy.url}/mcp/oauth", str(callback_port))
        try:
            client.until("registered")
            sign_in(browser, client.until("authorize")["url"], inst.admin_password, callback, button=DENY)
            returned = client.until("callback")
            assert returned["error"] == "access_denied" and returned["state_ok"], returned
            assert not client.steps("tokens")
            # RFC 9207 §2: error responses carry the issuer too (mix-up defence applies to them).
            assert returned["iss"] == returned["issuer"] == f"{proxy.url}/oauth", returned
        finally:
            client.stop()


def test_the_typescript_sdk_refreshes_an_expired_token_and_a_replayed_refresh_token_ends_its_session(
    inst: Instance, browser: Any
) -> None:
    node = node_or_skip()
    callback_port = free_port()
    callback = f"http://127.0.0.1:{callback_port}/callback"
    # No grace window: the replay below comes right after the SDK's own refresh.
    with served(inst, DISPATCH_OAUTH_ACCESS_TOKEN_SECONDS="3", DISPATCH_OAUTH_REFRESH_GRACE_SECONDS="0") as (
        _server,
        proxy,
    ):
        client = NodeClient(node, f"{proxy.url}/mcp/oauth", str(callback_port))
        try:
            client_id = client.until("registered")["client_id"]
            sign_in(browser, client.until("authorize")["url"], inst.admin_password, callback)
            client.until("ready")
            tokens = client.steps("tokens")
            current = tokens[-1]
            assert current["expires_in"] == 3
            wait_until(
                lambda: mcp_status(proxy, current["access_token"]) == 401,
                timeout=10,
                interval=0.25,
                what="the access token to expire",
            )
            mark = len(proxy.exchanges)

            client.send("call list_agents")
            assert client.until("called", timeout=15)["isError"] is False
            refreshed = client.steps("tokens")[-1]
            assert refreshed["count"] > current["count"]
            assert refreshed["access_token"] != current["access_token"]
            assert refreshed["refresh_token"] != current["refresh_token"]
            client.until("ready")
            # The event stream opened with the expired token is ended by the server's
            # watchdog; the SDK reopens it with the token it refreshed.
            assert client.until("stream_closed", timeout=5)["error"] is None
            reopened = client.until("stream_open", timeout=10)
            assert reopened["status"] == 200
            report("TypeScript SDK: sign-in (3 s tokens)", proxy.exchanges[:mark])
            report("TypeScript SDK: refresh after expiry", proxy.since(mark))
            print("node steps:", [(line["step"], line["ms"]) for line in client.seen])

            # The refresh token it replaced is refused, and its replay (reuse detection,
            # RFC 9700 §4.14.2) revokes the whole family: the SDK's new tokens die too.
            replayed = refresh(proxy, current["refresh_token"], client_id)
            assert replayed.status_code == 400 and replayed.json()["error"] == "invalid_grant", replayed.text
            latest = client.steps("tokens")[-1]
            assert refresh(proxy, latest["refresh_token"], client_id).status_code == 400
            client.send("call list_agents")
            failed = client.until("call_failed", timeout=15)
            assert failed["name"] == "UnauthorizedError", failed
            assert len(client.steps("authorize")) >= 2  # the SDK asks the user to sign in again
        finally:
            client.stop()


def test_two_calls_at_once_after_an_expiry_both_succeed_and_keep_the_session(inst: Instance, browser: Any) -> None:
    node = node_or_skip()
    callback_port = free_port()
    callback = f"http://127.0.0.1:{callback_port}/callback"
    with served(inst, DISPATCH_OAUTH_ACCESS_TOKEN_SECONDS="3") as (_server, proxy):
        client = NodeClient(node, f"{proxy.url}/mcp/oauth", str(callback_port))
        try:
            client.until("registered")
            sign_in(browser, client.until("authorize")["url"], inst.admin_password, callback)
            client.until("ready")
            current = client.steps("tokens")[-1]
            wait_until(
                lambda: mcp_status(proxy, current["access_token"]) == 401,
                timeout=10,
                interval=0.25,
                what="the access token to expire",
            )
            mark = len(proxy.exchanges)
            client.send("parallel list_agents")
            outcomes = client.until("parallel", timeout=20)["results"]
            client.until("ready")
            client.send("call list_agents")
            after = client.until("called", timeout=15)
            report("TypeScript SDK: two calls at once after expiry", proxy.since(mark))
            assert outcomes == [{"ok": True, "isError": False}] * 2, outcomes
            assert after["isError"] is False
        finally:
            client.stop()


@contextmanager
def metadata_document(folder: Path, redirect_uri: str) -> Iterator[tuple[str, list[str]]]:
    """A Client ID Metadata Document served over HTTPS on 127.0.0.1: ``(its URL, the paths
    requested so far)``; its certificate, ``folder/cert.pem``, is its own CA (``deploy.tls``),
    which the server trusts through ``SSL_CERT_FILE``."""
    certificate = self_signed_certificate(folder)
    cert, key = certificate.cert, certificate.key
    requested: list[str] = []
    document: dict[str, Any] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requested.append(self.path)
            if self.path != "/oauth/client.json":
                self.send_error(404)
                return
            body = json.dumps(document).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    url = f"https://127.0.0.1:{httpd.server_address[1]}/oauth/client.json"
    document.update(
        {
            "client_id": url,
            "client_name": "Dispatch suite (metadata document)",
            "redirect_uris": [redirect_uri],
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
        }
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield url, requested
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_typescript_sdk_signs_in_with_a_client_id_metadata_document(
    inst: Instance, browser: Any, tmp_path: Path
) -> None:
    node = node_or_skip()
    callback_port = free_port()
    callback = f"http://127.0.0.1:{callback_port}/callback"
    inst.manage(
        "shell",
        "-c",
        "from oauth.models import OAuthPolicy; p = OAuthPolicy.current(); p.cimd_private_addresses = True; p.save()",
    )
    before = {app["client_id"] for app in applications(inst)}
    with (
        metadata_document(tmp_path, callback) as (document_url, fetched),
        served(inst, SSL_CERT_FILE=str(tmp_path / "cert.pem")) as (_server, proxy),
    ):
        metadata = httpx.get(f"{proxy.url}/.well-known/oauth-authorization-server/oauth").json()
        assert metadata["client_id_metadata_document_supported"] is True
        client = NodeClient(node, f"{proxy.url}/mcp/oauth", str(callback_port), document_url)
        try:
            assert client.until("registered")["client_id"] == document_url
            consent = sign_in(browser, client.until("authorize")["url"], inst.admin_password, callback)
            assert "Dispatch suite (metadata document)" in consent
            assert client.until("callback")["state_ok"]
            assert client.until("tokens")["refresh_token"]
            assert "list_agents" in client.until("tools")["names"]
            client.until("ready")
            client.send("call list_agents")
            assert client.until("called")["isError"] is False
        finally:
            client.stop()
        report("TypeScript SDK (CIMD)", proxy.exchanges)
        print(f"  metadata document fetched by the server: {fetched}")
    assert fetched and set(fetched) == {"/oauth/client.json"}
    assert not any(exchange.path.startswith("/oauth/register") for exchange in proxy.exchanges)
    added = [app for app in applications(inst) if app["client_id"] not in before]
    assert [(app["client_id"], app["registration_source"]) for app in added] == [(document_url, "cimd")]


class Bridge:
    """mcp-remote (``node_modules/.bin/mcp-remote``, what ``npx mcp-remote`` runs) as a
    subprocess: JSON-RPC lines on its stdin and stdout, its log on stderr."""

    MARKER = "Please authorize this client by visiting:"

    def __init__(self, url: str, callback_port: int, config_dir: Path) -> None:
        env = {key: value for key, value in os.environ.items() if key not in ("DISPLAY", "WAYLAND_DISPLAY")}
        # mcp-remote opens the URL with xdg-open, which runs $BROWSER: `true` opens nothing,
        # and the test's Chromium follows the URL mcp-remote logs instead. Its tokens and
        # registration are kept in MCP_REMOTE_CONFIG_DIR (default ~/.mcp-auth).
        env.update({"MCP_REMOTE_CONFIG_DIR": str(config_dir), "BROWSER": "true"})
        self.proc = subprocess.Popen(
            [str(MCP_REMOTE), url, str(callback_port), "--host", "127.0.0.1"],
            cwd=CLIENTS,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.logged: list[str] = []
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.logged.extend(iter(self.proc.stderr.readline, ""))

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip():
                self.answers.put(json.loads(line))

    def log(self) -> str:
        return "".join(self.logged)

    def authorization_url(self) -> str | None:
        """The URL mcp-remote asked the user to open, once it has logged it."""
        if self.MARKER not in self.log():
            assert self.proc.poll() is None, self.log()[-3000:]
            return None
        return self.log().split(self.MARKER, 1)[1].strip().split()[0]

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def answer(self, message_id: int, timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no answer {message_id}; mcp-remote logged:\n{self.log()[-3000:]}") from None
            if message.get("id") == message_id:
                return message

    def session(self) -> set[str]:
        """``initialize``, ``tools/list`` and a ``list_agents`` call over stdio; the tool names."""
        self.send(INITIALIZE)
        assert self.answer(1)["result"]["serverInfo"]
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        self.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}})
        names = {tool["name"] for tool in self.answer(2)["result"]["tools"]}
        call = {"name": "list_agents", "arguments": {}}
        self.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": call})
        called = self.answer(3)
        assert called["result"].get("isError", False) is False, called
        return names

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


def test_mcp_remote_signs_in_through_chromium_lists_the_tools_and_starts_again_signed_in(
    inst: Instance, browser: Any, tmp_path: Path
) -> None:
    node_or_skip()
    callback_port = free_port()
    callback = f"http://127.0.0.1:{callback_port}/oauth/callback"
    before = {app["client_id"] for app in applications(inst)}
    with served(inst) as (_server, proxy):
        bridge = Bridge(f"{proxy.url}/mcp/oauth", callback_port, tmp_path / "mcp-auth")
        try:
            url = wait_until(bridge.authorization_url, timeout=30, what="mcp-remote's authorization URL")
            assert url.startswith(f"{proxy.url}/oauth/authorize/?")
            consent = sign_in(browser, url, inst.admin_password, callback)
            names = bridge.session()
            assert "list_agents" in names and "local_pc_execute_command" in names
        finally:
            bridge.stop()
        first_run = len(proxy.exchanges)

        # Started again (the desktop app relaunched), it uses the tokens it stored: no
        # registration, no browser.
        again = Bridge(f"{proxy.url}/mcp/oauth", callback_port, tmp_path / "mcp-auth")
        try:
            assert "list_agents" in again.session()
            assert again.authorization_url() is None
        finally:
            again.stop()
        report("mcp-remote", proxy.exchanges[:first_run])
        report("mcp-remote, started again", proxy.since(first_run))
        assert not [exchange for exchange in proxy.since(first_run) if exchange.path.startswith("/oauth/")]
    # It registered itself (DCR, one client), and the consent page named it.
    [added] = [app for app in applications(inst) if app["client_id"] not in before]
    assert added["registration_source"] == "dcr" and added["name"] and added["name"] in consent, (added, consent)


def test_the_header_endpoint_points_no_client_at_oauth(inst: Instance) -> None:
    with served(inst) as (_server, proxy):
        refused = httpx.post(f"{proxy.url}/mcp", json=INITIALIZE, headers=MCP_HEADERS, timeout=10)
        assert refused.status_code == 401
        assert "resource_metadata" not in refused.headers.get("www-authenticate", "")
        assert httpx.get(f"{proxy.url}/.well-known/oauth-protected-resource", timeout=10).status_code == 404
        assert httpx.get(f"{proxy.url}/.well-known/oauth-authorization-server", timeout=10).status_code == 404
        challenged = httpx.post(f"{proxy.url}/mcp/oauth", json=INITIALIZE, headers=MCP_HEADERS, timeout=10)
        assert challenged.status_code == 401
        metadata = f"{proxy.url}/.well-known/oauth-protected-resource/mcp/oauth"
        assert f'resource_metadata="{metadata}"' in challenged.headers["www-authenticate"]
