"""Breaking the OAuth server of ``/mcp/oauth`` where the hostile tests (``test_oauth_hostile.py``,
``test_registration.py``) do not go (docs/mcp.md#oauth): two server processes on one
PostgreSQL and Redis, a Redis that dies, malformed input on every endpoint, another user's
session and token, and narrow scopes calling the tools they do not cover.

Every refusal is checked for what it must never be (a 500, a hang) and for what must not
have been stored.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent

from tests.backends import free_port, start_redis_server
from tests.infra import Instance, Server, instance, wait_until
from tests.oauth.flow import INITIALIZE, MCP_HEADERS, EventStream, Flow, form_fields, pkce_pair
from tests.oauth.hostile_support import NOTHING_ISSUED, redirect_query, shell_json, stored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

APP_URI = "https://app.example/cb"
OTHER_RESOURCE = "https://other.example/mcp"
BOB_PASSWORD = "bob-secret-123"
HOSTILE_NAME = '<script>alert("x")</script><img src=x onerror=alert(1)>'

_SETUP = """
import json
from django.contrib.auth import get_user_model
from agents.models import Agent
User = get_user_model()
bob = User.objects.create_user("bob", password="bob-secret-123")
admin = User.objects.get(username="admin")
agent = Agent.objects.create(owner=admin, name="admin-agent", type="expert", cwd="/tmp", status="running")
print(json.dumps({"admin_agent": str(agent.pk), "admin_id": admin.pk}))
"""

_COUNTS = """
import json
from oauth2_provider.models import AccessToken, Application, Grant, RefreshToken
print(json.dumps([Application.objects.count(), Grant.objects.count(), AccessToken.objects.count(),
                  RefreshToken.objects.count()]))
"""


def rates_reset(inst: Instance) -> None:
    """Forget the instance's counts in the shared limiter: tests sharing ``pair`` run in any
    order, and each registering one needs the whole per-address budget."""
    inst.manage("shell", "-c", "from core.services import password_throttle_reset; password_throttle_reset()")


def counts(inst: Instance) -> list[int]:
    """``[applications, grants, access tokens, refresh tokens]`` stored by ``inst``."""
    return list(shell_json(inst, _COUNTS))


def application_pk(inst: Instance, client_id: str) -> int:
    return int(
        shell_json(
            inst,
            "import json; from oauth2_provider.models import Application; "
            f"print(json.dumps(Application.objects.get(client_id={client_id!r}).pk))",
        )
    )


def assert_4xx(answer: httpx.Response, what: str) -> None:
    """A clear refusal of the client's input: 4xx, never a 5xx."""
    assert 400 <= answer.status_code < 500, f"{what}: {answer.status_code} {answer.text[:300]}"


def rpc_results(answer: httpx.Response) -> list[dict[str, Any]]:
    """The JSON-RPC messages of an MCP POST answer (JSON or an SSE stream)."""
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        return [json.loads(line[5:]) for line in answer.text.splitlines() if line.startswith("data:")]
    return [answer.json()]


def call_tool(flow: Flow, access_token: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """``tools/call`` on ``/mcp/oauth`` (after an initialize); the JSON-RPC ``result``."""
    assert flow.mcp(access_token, INITIALIZE).status_code == 200
    message = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    answer = flow.mcp(access_token, message)
    assert answer.status_code == 200, answer.text[:300]
    [reply] = [item for item in rpc_results(answer) if item.get("id") == 7]
    return dict(reply["result"])


def result_text(result: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in result.get("content", []))


# --- one server: malformed input, another user, scopes ---------------------------------------


@dataclass
class World:
    inst: Instance
    server: Server
    admin_agent: str
    shim_root: Path

    def client(self, **registration: Any) -> Flow:
        flow = Flow(self.server.url, redirect_uri=APP_URI)
        answer = flow.register(**registration)
        assert answer.status_code == 201, answer.text
        return flow

    def signed_in(self, user: str = "admin", **registration: Any) -> Flow:
        flow = self.client(**registration)
        flow.login(user, self.inst.admin_password if user == "admin" else BOB_PASSWORD)
        return flow

    def stored_of(self, flow: Flow) -> dict[str, Any]:
        return stored(self.inst, flow.client_id)

    def shell_count(self, module: str, model: str) -> int:
        code = f"import json; from {module} import {model}; print(json.dumps({model}.objects.count()))"
        return int(shell_json(self.inst, code))

    def access_token(self, flow: Flow, scope: str = "mcp") -> str:
        verifier, challenge = pkce_pair()
        answer = flow.exchange(flow.code(challenge, scope=scope), verifier)
        assert answer.status_code == 200, answer.text
        assert answer.json()["scope"] == scope
        return str(answer.json()["access_token"])


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with instance() as inst:
        made = shell_json(inst, _SETUP)
        server = inst.serve(public=True, DISPATCH_OAUTH_DCR_RATE="1000/hour")
        root = Path(tempfile.mkdtemp(prefix="dispatch-oauth-breaking-"))
        (root / "admin-only-file.txt").write_text("admin's")
        inst.shim("admin-pc", root, server=server)
        yield World(inst, server, made["admin_agent"], root)


DCR_BODIES: list[tuple[str, bytes, str]] = [
    ("not JSON", b"client_name=x&redirect_uris=https://app.example/cb", "application/x-www-form-urlencoded"),
    ("broken JSON", b'{"client_name": "x", "redirect_uris": [', "application/json"),
    ("a JSON array", b'["https://app.example/cb"]', "application/json"),
    ("a JSON string", b'"hello"', "application/json"),
    ("JSON null", b"null", "application/json"),
    ("redirect_uris a string", b'{"client_name": "x", "redirect_uris": "https://app.example/cb"}', "application/json"),
    ("redirect_uris of numbers", b'{"client_name": "x", "redirect_uris": [1, 2]}', "application/json"),
    ("grant_types a string", b'{"redirect_uris": ["https://app.example/cb"], "grant_types": "x"}', "application/json"),
    ("invalid UTF-8", b'{"client_name": "\xff\xfe", "redirect_uris": ["https://app.example/cb"]}', "application/json"),
    (
        "3 MB",
        json.dumps({"client_name": "x" * 3_000_000, "redirect_uris": [APP_URI]}).encode(),
        "application/json",
    ),
]


@pytest.mark.parametrize(("what", "body", "content_type"), DCR_BODIES, ids=[case[0] for case in DCR_BODIES])
def test_registration_refuses_a_malformed_body_with_a_4xx_and_stores_nothing(
    world: World, what: str, body: bytes, content_type: str
) -> None:
    before = counts(world.inst)
    answer = httpx.post(
        f"{world.server.url}/oauth/register/", content=body, headers={"Content-Type": content_type}, timeout=30
    )
    assert_4xx(answer, what)
    assert counts(world.inst) == before


def test_registration_refuses_a_deeply_nested_body_with_a_4xx(world: World) -> None:
    before = counts(world.inst)
    body = b'{"client_name": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    answer = httpx.post(
        f"{world.server.url}/oauth/register/", content=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert_4xx(answer, "a body nested 100000 deep")
    assert counts(world.inst) == before


def test_a_client_name_with_markup_is_escaped_on_the_consent_and_settings_pages(world: World) -> None:
    flow = world.signed_in(client_name=HOSTILE_NAME)
    verifier, challenge = pkce_pair()
    page = flow.authorize_page(challenge)
    assert page.status_code == 200, page.text[:300]
    assert "<script>alert" not in page.text and "<img src=x" not in page.text
    assert "&lt;script&gt;" in page.text
    answer = flow.approve(page)
    assert flow.exchange(redirect_query(answer)["code"], verifier).status_code == 200
    settings_page = flow.browser.get("/settings/")
    assert settings_page.status_code == 200
    assert "&lt;script&gt;" in settings_page.text, "the connected application is not listed"
    assert "<script>alert" not in settings_page.text and "<img src=x" not in settings_page.text


def _authorize_cases(flow: Flow, challenge: str) -> list[tuple[str, list[tuple[str, str]]]]:
    base = {
        "response_type": "code",
        "client_id": flow.client_id,
        "redirect_uri": APP_URI,
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "state": "st",
        "scope": "mcp",
        "resource": flow.resource,
    }

    def changed(**changes: str) -> list[tuple[str, str]]:
        return list({**base, **changes}.items())

    return [
        ("a NUL in state", changed(state="a\x00b")),
        ("a 6 KB state", changed(state="s" * 6_000)),
        ("unicode state", changed(state="é✓\U0001f600")),
        ("a NUL in client_id", changed(client_id=flow.client_id + "\x00")),
        ("a unicode client_id", changed(client_id="clïent-✓")),
        ("a 6 KB client_id", changed(client_id="c" * 6_000)),
        ("a NUL in redirect_uri", changed(redirect_uri=APP_URI + "\x00")),
        ("a 6 KB code_challenge", changed(code_challenge="A" * 6_000)),
        ("an unknown scope only", changed(scope="mcp:everything")),
        ("an unknown scope beside mcp", changed(scope="mcp admin")),
        ("a 6 KB scope", changed(scope="mcp " + "x" * 6_000)),
        ("a NUL in resource", changed(resource=flow.resource + "\x00")),
        ("response_type twice", [*changed(), ("response_type", "token")]),
        ("client_id twice", [*changed(), ("client_id", "someone-else")]),
        ("redirect_uri twice", [*changed(), ("redirect_uri", "https://evil.example/cb")]),
        ("code_challenge_method twice", [*changed(), ("code_challenge_method", "plain")]),
    ]


def authorize_problems(flow: Flow) -> list[str]:
    """What went wrong when ``flow``'s signed-in browser sent each hostile authorization
    request (a 5xx, no answer, a redirect elsewhere or with a code); empty when all is well."""
    _verifier, challenge = pkce_pair()
    wrong: list[str] = []
    for what, params in _authorize_cases(flow, challenge):
        try:
            answer = flow.browser.get("/oauth/authorize/", params=params)
        except httpx.TransportError as exc:
            wrong.append(f"{what}: no answer ({exc!r})")
            continue
        if answer.status_code not in (200, 302, 400):
            wrong.append(f"{what}: {answer.status_code} {answer.text[:200]}")
        elif answer.status_code == 302 and not (
            # Only ever back to the registered client, with an error (no code without consent).
            answer.headers["location"].startswith(APP_URI + "?") and "error" in redirect_query(answer)
        ):
            wrong.append(f"{what}: redirected to {answer.headers['location']}")
    return wrong


def test_the_authorization_endpoint_takes_hostile_query_values_without_a_5xx(world: World) -> None:
    flow = world.signed_in()
    wrong = authorize_problems(flow)
    assert not wrong, "\n".join(wrong)
    assert world.stored_of(flow) == NOTHING_ISSUED


def test_a_repeated_resource_never_binds_a_token_to_another_server(world: World) -> None:
    """RFC 8707 §2: ``resource`` may repeat; every value must be this server's resource."""
    flow = world.signed_in()
    for order in ([OTHER_RESOURCE, flow.resource], [flow.resource, OTHER_RESOURCE]):
        _verifier, challenge = pkce_pair()
        params = [(k, v) for k, v in _authorize_cases(flow, challenge)[0][1] if k not in ("resource", "state")]
        params += [("state", "st"), *[("resource", value) for value in order]]
        answer = flow.browser.get("/oauth/authorize/", params=params)
        assert answer.status_code in (302, 400), (order, answer.status_code, answer.text[:300])
        if answer.status_code == 302:
            assert redirect_query(answer).get("error") == "invalid_target", answer.headers["location"]
    assert world.stored_of(flow) == NOTHING_ISSUED


def token_problems(flow: Flow, admin_password: str) -> list[str]:
    """What went wrong when each hostile token request was sent for a fresh code of
    ``flow``'s signed-in browser (not a 4xx, or a token issued), then whether the code still
    works for the real request; empty when all is well."""
    verifier, challenge = pkce_pair()
    code = flow.code(challenge)
    good = {
        "grant_type": "authorization_code",
        "client_id": flow.client_id,
        "code": code,
        "redirect_uri": APP_URI,
        "code_verifier": verifier,
        "resource": flow.resource,
    }
    token_url = flow.metadata["token_endpoint"]
    cases: list[tuple[str, Any]] = [
        ("no body", {}),
        ("a NUL in code", {**good, "code": code + "\x00"}),
        ("a 100 KB code", {**good, "code": "c" * 100_000}),
        ("a unicode client_id", {**good, "client_id": "clïent-✓"}),
        ("a NUL in client_id", {**good, "client_id": flow.client_id + "\x00"}),
        ("a NUL in code_verifier", {**good, "code_verifier": verifier + "\x00"}),
        ("an unknown grant_type", {**good, "grant_type": "urn:x:unknown"}),
        (
            "the password grant",
            {
                "grant_type": "password",
                "client_id": flow.client_id,
                "username": "admin",
                "password": admin_password,
                "scope": "mcp",
            },
        ),
        ("the client credentials grant", {"grant_type": "client_credentials", "client_id": flow.client_id}),
        (
            "a garbage refresh token",
            {"grant_type": "refresh_token", "client_id": flow.client_id, "refresh_token": "\U0001f600" * 1000},
        ),
        (
            "an unknown scope on refresh",
            {"grant_type": "refresh_token", "client_id": flow.client_id, "refresh_token": "x", "scope": "admin"},
        ),
    ]
    cases += [
        ("grant_type twice", {**good, "grant_type": ["authorization_code", "password"]}),
        ("code twice", {**good, "code": [code, "other"]}),
        ("a 3 MB form", {**good, "code": "wrong", "pad": "x" * 3_000_000}),
    ]
    wrong: list[str] = []
    for what, data in cases:
        answer = httpx.post(token_url, data=data, timeout=30)
        if not 400 <= answer.status_code < 500 or "access_token" in answer.text:
            wrong.append(f"{what}: {answer.status_code} {answer.text[:200]}")
    as_json = httpx.post(token_url, json=good, timeout=20)
    if not 400 <= as_json.status_code < 500:
        wrong.append(f"a JSON body: {as_json.status_code} {as_json.text[:200]}")
    # None of those spent the code: the client's own request still works (RFC 6749 §4.1.2:
    # only a use of the code spends it).
    final = flow.exchange(code, verifier)
    if final.status_code != 200:
        wrong.append(f"the good request after them: {final.status_code} {final.text[:200]}")
    return wrong


def test_the_token_endpoint_refuses_hostile_form_fields_with_a_4xx_and_issues_nothing(world: World) -> None:
    flow = world.signed_in()
    wrong = token_problems(flow, world.inst.admin_password)
    assert not wrong, "\n".join(wrong)
    assert world.stored_of(flow)["access_tokens"] == 1  # the good request's, nothing else


BEARERS: list[tuple[str, dict[str, str] | list[tuple[str, str]]]] = [
    ("garbage", {"Authorization": "Bearer !!!not-a-token!!!"}),
    ("a 10 KB token", {"Authorization": "Bearer " + "A" * 10_240}),
    ("Bearer alone", {"Authorization": "Bearer"}),
    ("Bearer and a tab", {"Authorization": "Bearer \tx"}),
    ("basic credentials", {"Authorization": "Basic YWRtaW46YWRtaW4="}),
    ("a token with latin-1 bytes", {"Authorization": "Bearer tok\xe9n"}),
    ("two Authorization headers", [("Authorization", "Bearer a"), ("Authorization", "Bearer b")]),
]


@pytest.mark.parametrize(("what", "headers"), BEARERS, ids=[case[0] for case in BEARERS])
def test_mcp_oauth_answers_a_bad_authorization_header_with_a_401_challenge(
    world: World, what: str, headers: dict[str, str] | list[tuple[str, str]]
) -> None:
    pairs = headers.items() if isinstance(headers, dict) else headers
    raw = [(name.encode(), value.encode("latin-1")) for name, value in pairs]
    raw += [(name.encode(), value.encode()) for name, value in MCP_HEADERS.items()]
    for method in ("POST", "GET"):
        body = json.dumps(INITIALIZE).encode() if method == "POST" else b""
        request = httpx.Request(method, f"{world.server.url}/mcp/oauth", headers=httpx.Headers(raw), content=body)
        with httpx.Client(timeout=10) as http:
            answer = http.send(request)
        assert answer.status_code == 401, f"{method} {what}: {answer.status_code} {answer.text[:300]}"
        assert answer.headers.get("www-authenticate", "").startswith("Bearer"), (method, what)


ENDPOINTS = [
    "/.well-known/oauth-authorization-server/oauth",
    "/.well-known/oauth-protected-resource/mcp/oauth",
    "/oauth/authorize/",
    "/oauth/token/",
    "/oauth/revoke/",
    "/oauth/register/",
    "/oauth/register/some-client/",
    "/settings/oauth/1/revoke/",
    "/settings/oauth/policy/",
    "/mcp/oauth",
]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_other_methods_are_refused_with_a_4xx_on_every_endpoint(world: World, path: str) -> None:
    flow = world.signed_in()  # a signed-in browser: the pages' methods, not the login redirect
    for method in ("PUT", "PATCH", "DELETE", "TRACE", "PROPFIND"):
        if path.startswith("/oauth/register/some") and method in ("PUT", "DELETE"):
            continue  # RFC 7592's own methods (without its token: 401, in test_registration.py)
        answer = flow.browser.request(method, path)
        assert_4xx(answer, f"{method} {path}")


# --- another user --------------------------------------------------------------------------------


def test_another_users_session_revokes_nothing_of_theirs(world: World) -> None:
    admin = world.signed_in("admin", client_name="Admin's app")
    access = world.access_token(admin)
    app_id = application_pk(world.inst, admin.client_id)
    bob = Flow(world.server.url, redirect_uri=APP_URI)
    bob.login("bob", BOB_PASSWORD)
    page = bob.browser.get("/settings/")
    assert page.status_code == 200
    assert "Admin&#x27;s app" not in page.text and "Admin's app" not in page.text
    csrf = form_fields(page.text)["csrfmiddlewaretoken"]
    bob.browser.post(f"/settings/oauth/{app_id}/revoke/", data={"csrfmiddlewaretoken": csrf})
    admin_id = shell_json(
        world.inst,
        "import json; from django.contrib.auth.models import User; "
        "print(json.dumps(User.objects.get(username='admin').pk))",
    )
    as_admin = bob.browser.post(
        f"/settings/oauth/users/{admin_id}/{app_id}/revoke/", data={"csrfmiddlewaretoken": csrf}
    )
    assert as_admin.status_code == 403
    held = stored(world.inst, admin.client_id)
    assert held["access_tokens"] == 1 and held["live_refresh_tokens"] == 1, held
    assert admin.mcp(access, INITIALIZE).status_code == 200


def test_another_users_token_reads_none_of_their_agents_or_machines(world: World) -> None:
    admin = world.signed_in("admin")
    admin_token = world.access_token(admin)
    listed = result_text(call_tool(admin, admin_token, "list_machines", {}))
    assert "admin-pc" in listed, listed  # the shim is there: the test below would notice it
    bob = world.signed_in("bob")
    token = world.access_token(bob)
    assert "admin-pc" not in result_text(call_tool(bob, token, "list_machines", {}))
    history = call_tool(bob, token, "get_agent_history", {"agent_id": world.admin_agent})
    assert history.get("isError") is True, history
    files = call_tool(bob, token, "local_pc_file_list", {"target_machine": "admin-pc", "path": str(world.shim_root)})
    assert files.get("isError") is True, files
    assert "admin-only-file" not in result_text(files)
    command = call_tool(bob, token, "local_pc_execute_command", {"target_machine": "admin-pc", "argv": ["ls"]})
    assert command.get("isError") is True, command


# --- scopes, both protocol eras -------------------------------------------------------------------


@asynccontextmanager
async def mcp_client(url: str, token: str, mode: str) -> AsyncIterator[Client]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            yield client


FORBIDDEN_CALLS = [
    ("local_pc_execute_command", {"target_machine": "admin-pc", "argv": ["true"]}),
    ("local_pc_command_start", {"target_machine": "admin-pc", "argv": ["true"]}),
    ("dispatch_launch_agent", {"name": "scoped-out", "type": "expert", "cwd": "/tmp"}),
]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
@pytest.mark.parametrize("scope", ["mcp:remotes", "mcp:machines:read"])
async def test_a_narrow_token_is_forbidden_the_shell_and_agent_tools(world: World, scope: str, mode: str) -> None:
    flow = world.signed_in()
    token = world.access_token(flow, scope=scope)
    before = world.shell_count("agents.models", "Agent")
    async with mcp_client(f"{world.server.url}/mcp/oauth", token, mode) as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        for name, arguments in FORBIDDEN_CALLS:
            assert name not in listed
            result = await client.call_tool(name, arguments)
            assert result.is_error, (name, result)
            [block] = result.content
            assert isinstance(block, TextContent)
            assert block.text.startswith("FORBIDDEN"), (name, block.text)
    assert world.shell_count("agents.models", "Agent") == before
    assert not any(record.get("op") == "exec" for record in _shim_audit(world))


def _shim_audit(world: World) -> list[dict[str, Any]]:
    shim = next(process for process in world.inst.processes if getattr(process, "name", None) == "admin-pc")
    return list(shim.audit())  # type: ignore[attr-defined]


# --- two server processes on one PostgreSQL and Redis ----------------------------------------------

PAIR_DCR_RATE = 4  # registrations per hour and address, across both processes


@dataclass
class Pair:
    """Two ``serve`` processes of one instance; both are ``a``'s public URL (one issuer, one
    resource), as behind a load balancer."""

    inst: Instance
    a: Server
    b: Server


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with instance(postgres=True, redis=True) as inst:
        shell_json(inst, _SETUP)
        a = inst.serve(public=True, DISPATCH_OAUTH_DCR_RATE=f"{PAIR_DCR_RATE}/hour")
        b = inst.serve(DISPATCH_PUBLIC_URL=a.url, DISPATCH_OAUTH_DCR_RATE=f"{PAIR_DCR_RATE}/hour")
        yield Pair(inst, a, b)


@pytest.mark.multiprocess
@pytest.mark.postgres
@pytest.mark.redis
def test_a_revocation_on_one_process_ends_the_stream_open_on_the_other(pair: Pair) -> None:
    rates_reset(pair.inst)
    flow = Flow(pair.a.url, redirect_uri=APP_URI)
    assert flow.register(client_name="Across processes").status_code == 201
    flow.login("admin", pair.inst.admin_password)
    verifier, challenge = pkce_pair()
    code = flow.code(challenge)  # consent on A
    on_b = Flow(pair.a.url, redirect_uri=APP_URI, client_id=flow.client_id)
    on_b.metadata = {**on_b.metadata, "token_endpoint": f"{pair.b.url}/oauth/token/"}
    tokens = on_b.exchange(code, verifier)  # the token exchange on B
    assert tokens.status_code == 200, tokens.text
    access = tokens.json()["access_token"]

    stream = EventStream(f"{pair.a.url}/mcp/oauth", access)
    assert stream.opened.wait(20), "the stream did not open"
    # RFC 7009 revocation of the refresh token on B (RFC 7009 §2.1: its access token goes too).
    revoked_at = time.monotonic()
    revoke = httpx.post(
        f"{pair.b.url}/oauth/revoke/",
        data={"token": tokens.json()["refresh_token"], "token_type_hint": "refresh_token", "client_id": flow.client_id},
        timeout=10,
    )
    assert revoke.status_code == 200, revoke.text
    stream.reader.join(15)
    assert stream.ended, "A's stream is still open 15 s after B revoked its token"
    took = stream.ended[0] - revoked_at
    assert took < 8, f"A's stream ended {took:.1f} s after the revocation"
    assert flow.mcp(access, INITIALIZE).status_code == 401


@pytest.mark.multiprocess
@pytest.mark.postgres
@pytest.mark.redis
def test_the_admins_registration_switch_flipped_on_one_process_holds_on_the_other_at_once(pair: Pair) -> None:
    rates_reset(pair.inst)
    admin = Flow(pair.a.url)
    admin.login("admin", pair.inst.admin_password)

    def switch(dcr_enabled: bool) -> None:
        csrf = form_fields(admin.browser.get("/settings/").text)["csrfmiddlewaretoken"]
        fields = {"csrfmiddlewaretoken": csrf, "cimd_enabled": "on", **({"dcr_enabled": "on"} if dcr_enabled else {})}
        assert admin.browser.post("/settings/oauth/policy/", data=fields).status_code == 302

    body = {"client_name": "x", "redirect_uris": [APP_URI], "token_endpoint_auth_method": "none"}
    switch(False)
    try:
        refused = httpx.post(f"{pair.b.url}/oauth/register/", json=body, timeout=10)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"] == "access_denied"
        metadata = httpx.get(f"{pair.b.url}/.well-known/oauth-authorization-server/oauth", timeout=10).json()
        assert "registration_endpoint" not in metadata, metadata
    finally:
        switch(True)
    assert httpx.post(f"{pair.b.url}/oauth/register/", json=body, timeout=10).status_code in (201, 429)


@pytest.mark.multiprocess
@pytest.mark.postgres
@pytest.mark.redis
def test_hostile_authorization_and_token_requests_get_a_4xx_on_postgresql_too(pair: Pair) -> None:
    """PostgreSQL refuses a NUL in a text parameter where SQLite stores it: the same hostile
    requests as above, on the database a deployment runs."""
    rates_reset(pair.inst)
    flow = Flow(pair.a.url, redirect_uri=APP_URI)
    assert flow.register().status_code == 201
    flow.login("admin", pair.inst.admin_password)
    wrong = authorize_problems(flow) + token_problems(flow, pair.inst.admin_password)
    assert not wrong, "\n".join(wrong)


@pytest.mark.multiprocess
@pytest.mark.postgres
@pytest.mark.redis
def test_a_nul_in_a_registration_is_a_4xx_on_postgresql_and_stores_nothing(pair: Pair) -> None:
    rates_reset(pair.inst)
    before = counts(pair.inst)
    for body in (
        b'{"client_name": "a\\u0000b", "redirect_uris": ["https://app.example/cb"]}',
        b'{"client_name": "a", "redirect_uris": ["https://app.example/c\\u0000b"]}',
    ):
        answer = httpx.post(
            f"{pair.a.url}/oauth/register/", content=body, headers={"Content-Type": "application/json"}, timeout=10
        )
        assert_4xx(answer, body.decode())
    assert counts(pair.inst) == before


@pytest.mark.multiprocess
@pytest.mark.postgres
@pytest.mark.redis
def test_the_registration_rate_is_one_budget_across_both_processes(pair: Pair) -> None:
    rates_reset(pair.inst)
    body = {"client_name": "rate", "redirect_uris": [APP_URI], "token_endpoint_auth_method": "none"}
    answers: list[tuple[str, int]] = []
    for _round in range(PAIR_DCR_RATE + 1):
        for server in (pair.a, pair.b):
            answers.append((server.url, httpx.post(f"{server.url}/oauth/register/", json=body, timeout=10).status_code))
    created = [status for _url, status in answers if status == 201]
    assert len(created) <= PAIR_DCR_RATE, answers  # one process's budget each would let through more
    assert {status for _url, status in answers[-2:]} == {429}, answers  # both refuse at the end
    assert set(status for _url, status in answers) <= {201, 429}, answers


# --- a dead Redis --------------------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.timeout(180)
def test_registration_and_tokens_answer_503_while_redis_is_down_and_recover_after() -> None:
    port = free_port()
    redis = start_redis_server(port)
    try:
        with instance(
            REDIS_URL=f"redis://127.0.0.1:{port}", DISPATCH_REDIS_PREFIX=f"it-{uuid.uuid4().hex[:8]}"
        ) as inst:
            server = inst.serve(public=True, DISPATCH_OAUTH_DCR_RATE="1000/hour")
            flow = Flow(server.url, redirect_uri=APP_URI)
            assert flow.register().status_code == 201
            flow.login("admin", inst.admin_password)
            verifier, challenge = pkce_pair()
            code = flow.code(challenge)
            before = counts(inst)

            redis.kill()
            redis.wait(5)
            started = time.monotonic()
            registration = httpx.post(
                f"{server.url}/oauth/register/",
                json={"client_name": "x", "redirect_uris": [APP_URI], "token_endpoint_auth_method": "none"},
                timeout=30,
            )
            assert time.monotonic() - started < 15, "registration hung on the dead Redis"
            assert registration.status_code == 503, registration.text[:300]
            error = registration.json()  # RFC 7591 §3.2.2's shape, like every registration error
            assert error["error"] == "temporarily_unavailable" and "Redis" in error["error_description"], error
            assert int(registration.headers["retry-after"]) > 0
            # The token endpoint needs no Redis: it answers as usual (never a 500).
            exchanged = flow.exchange(code, verifier)
            assert exchanged.status_code in (200, 503), exchanged.text[:300]

            redis = start_redis_server(port)
            back = wait_until(
                lambda: flow.register().status_code == 201,
                timeout=15,
                interval=0.5,
                what="a registration after Redis came back",
            )
            assert back
            assert counts(inst)[0] == before[0] + 1
    finally:
        redis.kill()
        redis.wait(5)
