"""The OAuth authorization server of ``/mcp/oauth`` against a client and a browser that
misbehave (docs/mcp.md#oauth), over a real ``manage.py serve``: each refusal is checked for
its status and OAuth error code, and for what did NOT happen (no redirect to the attacker,
no grant, no token stored).

RFC 6749 §4.1.2.1 (no redirect to an unverified URI), RFC 7636 (PKCE), RFC 8252 §7.3
(loopback redirects), RFC 8707 (resource indicators), RFC 9700 §4.14 (refresh token
replay), RFC 7009 (revocation), RFC 9207 (``iss``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.infra import Instance, Server, instance
from tests.oauth.flow import INITIALIZE, Flow, form_fields, pkce_pair
from tests.oauth.hostile_support import (
    NOTHING_ISSUED,
    redirect_query,
    redirect_target,
    shell_json,
    stored,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

APP_URI = "https://app.example/cb"
LOOPBACK_URI = "http://127.0.0.1/callback"
OTHER_RESOURCE = "https://other.example/mcp"
TOOLS_LIST = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}
LIST_AGENTS = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "list_agents", "arguments": {}}}

_SETUP = """
import json
from django.contrib.auth import get_user_model
from agents.models import Agent
User = get_user_model()
bob = User.objects.create_user("bob", password="bob-secret-123")
admin = User.objects.get(username="admin")
Agent.objects.create(owner=admin, name="admin-agent", type="expert", cwd="/tmp", status="running")
Agent.objects.create(owner=bob, name="bob-agent", type="expert", cwd="/tmp", status="running")
print(json.dumps(True))
"""


@dataclass
class World:
    inst: Instance
    server: Server

    def client(self, redirect_uri: str = APP_URI) -> Flow:
        """A newly registered (DCR) client, its browser not signed in."""
        flow = Flow(self.server.url, redirect_uri=redirect_uri)
        answer = flow.register()
        assert answer.status_code == 201, answer.text
        return flow

    def signed_in(self, redirect_uri: str = APP_URI, user: str = "admin") -> Flow:
        """A newly registered client whose browser is signed in as ``user``."""
        flow = self.client(redirect_uri)
        flow.login(user, self.inst.admin_password if user == "admin" else "bob-secret-123")
        return flow

    def tokens(self, flow: Flow) -> dict[str, Any]:
        """Authorize and exchange: the token response of ``flow``'s client."""
        verifier, challenge = pkce_pair()
        answer = flow.exchange(flow.code(challenge), verifier)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def stored(self, flow: Flow) -> dict[str, Any]:
        return stored(self.inst, flow.client_id)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with instance() as inst:
        shell_json(inst, _SETUP)
        # Every test registers its own client: the per-address DCR rate is not under test here.
        yield World(inst, inst.serve(public=True, DISPATCH_OAUTH_DCR_RATE="1000/hour"))


def assert_error_page(answer: httpx.Response, error: str) -> None:
    """An error shown to the user, not sent anywhere: 400, no ``Location``."""
    assert answer.status_code == 400, (answer.status_code, answer.headers.get("location"))
    assert "location" not in answer.headers
    assert error in answer.text


def assert_token_error(answer: httpx.Response, error: str) -> None:
    """A token endpoint refusal (RFC 6749 §5.2): 400 (or 401) with ``{"error": error}`` and no token."""
    assert answer.status_code in (400, 401), answer.text
    body = answer.json()
    assert body["error"] == error, body
    assert "access_token" not in body and "refresh_token" not in body


# --- redirect URIs --------------------------------------------------------------------------


def test_it_never_redirects_to_a_redirect_uri_that_is_not_registered(world: World) -> None:
    flow = world.signed_in()
    _verifier, challenge = pkce_pair()
    hostile = [
        "https://app.example/other",  # another path
        "https://evil.example/cb",  # another host
        "https://app.example:8443/cb",  # another port on a non-loopback host
        "https://evil.example/",  # open redirect
        "//evil.example/cb",  # scheme-relative
        "https://app.example@evil.example/cb",  # userinfo: the host is evil.example
        "https://app.example/cb@evil.example",
        "https://app.example/cb/../../evil",
        "https://app.example/cb?next=https://evil.example/",
        "https://app.example/cb#@evil.example",
        "http://app.example/cb",  # the registered one, downgraded to http
    ]
    for uri in hostile:
        answer = flow.authorize_page(challenge, redirect_uri=uri)
        assert answer.status_code == 400, (uri, answer.status_code, answer.headers.get("location"))
        assert "location" not in answer.headers, uri
        assert "invalid_request" in answer.text, uri
    assert world.stored(flow) == NOTHING_ISSUED


def test_a_consent_form_whose_redirect_uri_was_changed_redirects_nowhere(world: World) -> None:
    flow = world.signed_in()
    _verifier, challenge = pkce_pair()
    page = flow.authorize_page(challenge)
    assert page.status_code == 200
    # Allow, and Cancel (which DOT would redirect with access_denied to the posted URI).
    allowed = flow.approve(page, redirect_uri="https://evil.example/cb")
    assert_error_page(allowed, "invalid_request")
    fields = {name: value for name, value in form_fields(page.text).items() if name != "allow"}
    cancelled = flow.browser.post("/oauth/authorize/", data={**fields, "redirect_uri": "https://evil.example/cb"})
    assert_error_page(cancelled, "invalid_request")
    assert world.stored(flow) == NOTHING_ISSUED


def test_a_loopback_redirect_uri_takes_any_port_but_not_another_path(world: World) -> None:
    flow = world.signed_in(LOOPBACK_URI)
    verifier, challenge = pkce_pair()
    other_path = flow.authorize_page(challenge, redirect_uri="http://127.0.0.1:54321/other")
    assert_error_page(other_path, "invalid_request")
    other_host = flow.authorize_page(challenge, redirect_uri="http://127.0.0.2:54321/callback")
    assert_error_page(other_host, "invalid_request")
    assert world.stored(flow) == NOTHING_ISSUED

    # RFC 8252 §7.3: the port is the native app's, chosen at run time.
    flow.redirect_uri = "http://127.0.0.1:54321/callback"
    page = flow.authorize_page(challenge)
    assert page.status_code == 200, page.text[:300]
    answer = flow.approve(page)
    assert answer.status_code == 302
    assert redirect_target(answer) == "http://127.0.0.1:54321/callback"
    tokens = flow.exchange(redirect_query(answer)["code"], verifier)
    assert tokens.status_code == 200, tokens.text


# --- PKCE (RFC 7636; S256 only) ---------------------------------------------------------------


def test_an_authorization_request_without_a_code_challenge_is_refused(world: World) -> None:
    flow = world.signed_in()
    answer = flow.authorize_page("", code_challenge=None, code_challenge_method=None)  # type: ignore[arg-type]
    # RFC 6749 §4.1.2.1: the client and its redirect URI are valid, so the error goes there.
    assert answer.status_code == 302
    assert redirect_target(answer) == APP_URI
    query = redirect_query(answer)
    assert query["error"] == "invalid_request" and query["state"] == "st" and "code" not in query
    assert world.stored(flow) == NOTHING_ISSUED


def test_the_plain_code_challenge_method_never_yields_a_code(world: World) -> None:
    flow = world.signed_in()
    verifier = "p" * 50
    page = flow.authorize_page(verifier, code_challenge_method="plain")
    if page.status_code == 200:
        # django-oauth-toolkit shows the page and refuses on Allow (RFC 9700 §2.1.1).
        answer = flow.approve(page)
    else:
        answer = page
    assert answer.status_code == 302, answer.text[:300]
    assert redirect_target(answer) == APP_URI
    query = redirect_query(answer)
    assert query["error"] == "invalid_request" and "code" not in query
    assert world.stored(flow) == NOTHING_ISSUED


def test_the_token_endpoint_refuses_a_wrong_or_missing_code_verifier(world: World) -> None:
    flow = world.signed_in()
    _verifier, challenge = pkce_pair()
    code = flow.code(challenge)
    wrong_verifier, _ = pkce_pair()
    assert_token_error(flow.exchange(code, wrong_verifier), "invalid_grant")
    missing = flow.token(grant_type="authorization_code", code=code, redirect_uri=flow.redirect_uri)
    assert_token_error(missing, "invalid_request")
    assert world.stored(flow) == {**NOTHING_ISSUED, "grants": 1}  # the code, unused


# --- codes -------------------------------------------------------------------------------------


def test_a_code_used_twice_is_refused_the_second_time_and_its_first_tokens_revoked(world: World) -> None:
    flow = world.signed_in()
    verifier, challenge = pkce_pair()
    code = flow.code(challenge)
    first = flow.exchange(code, verifier)
    assert first.status_code == 200, first.text
    assert_token_error(flow.exchange(code, verifier), "invalid_grant")
    # RFC 6749 §4.1.2: the tokens the first use issued are revoked by the replay.
    assert world.stored(flow) == NOTHING_ISSUED


def test_a_code_past_its_lifetime_is_refused(world: World) -> None:
    flow = world.signed_in()
    verifier, challenge = pkce_pair()
    code = flow.code(challenge)
    shell_json(
        world.inst,
        "import json, datetime; from django.utils import timezone; from oauth2_provider.models import Grant; "
        f"n = Grant.objects.filter(application__client_id={flow.client_id!r})"
        ".update(expires=timezone.now() - datetime.timedelta(seconds=1)); print(json.dumps(n))",
    )
    assert_token_error(flow.exchange(code, verifier), "invalid_grant")
    assert world.stored(flow) == {**NOTHING_ISSUED, "grants": 1}


def test_a_code_and_a_refresh_token_are_good_only_for_their_own_client(world: World) -> None:
    owner = world.signed_in()
    thief = world.client()
    verifier, challenge = pkce_pair()
    code = owner.code(challenge)
    # RFC 6749 §4.1.3: the code was issued to another client_id.
    assert_token_error(thief.exchange(code, verifier), "invalid_grant")
    tokens = owner.exchange(code, verifier)
    assert tokens.status_code == 200, tokens.text
    refresh = tokens.json()["refresh_token"]
    assert_token_error(thief.token(grant_type="refresh_token", refresh_token=refresh), "invalid_grant")
    assert world.stored(thief) == NOTHING_ISSUED
    # The owner's refresh token still works: a stranger's attempt revokes nothing.
    assert owner.token(grant_type="refresh_token", refresh_token=refresh).status_code == 200


# --- tokens of one resource elsewhere (RFC 8707) ----------------------------------------------


def test_an_oauth_token_opens_only_mcp_oauth_and_an_api_token_not_mcp_oauth(world: World) -> None:
    flow = world.signed_in()
    access = world.tokens(flow)["access_token"]
    assert flow.mcp(access, INITIALIZE).status_code == 200

    on_mcp = flow.mcp(access, INITIALIZE, path="/mcp")
    assert on_mcp.status_code == 401
    assert "resource_metadata" not in on_mcp.headers["www-authenticate"]
    api = httpx.get(f"{world.server.url}/api/v1/agents", headers={"Authorization": f"Bearer {access}"})
    assert api.status_code == 401

    header_token = flow.mcp(world.inst.admin_token, INITIALIZE)
    assert header_token.status_code == 401
    challenge = header_token.headers["www-authenticate"]
    assert 'error="invalid_token"' in challenge
    assert f'resource_metadata="{world.server.url}/.well-known/oauth-protected-resource/mcp/oauth"' in challenge


def test_the_registration_access_token_is_no_access_token(world: World) -> None:
    flow = Flow(world.server.url)
    registration = flow.register()
    assert registration.status_code == 201
    token = registration.json()["registration_access_token"]
    assert flow.mcp(token, INITIALIZE).status_code == 401
    assert flow.mcp(token, INITIALIZE, path="/mcp").status_code == 401


def test_an_authorization_request_for_another_resource_is_refused(world: World) -> None:
    flow = world.signed_in()
    _verifier, challenge = pkce_pair()
    answer = flow.authorize_page(challenge, resource=OTHER_RESOURCE)
    assert_error_page(answer, "invalid_target")
    assert world.stored(flow) == NOTHING_ISSUED


def test_a_token_request_for_another_resource_is_refused(world: World) -> None:
    flow = world.signed_in()
    verifier, challenge = pkce_pair()
    code = flow.code(challenge)
    answer = flow.token(
        grant_type="authorization_code",
        code=code,
        redirect_uri=flow.redirect_uri,
        code_verifier=verifier,
        resource=OTHER_RESOURCE,
    )
    assert_token_error(answer, "invalid_target")
    assert world.stored(flow) == {**NOTHING_ISSUED, "grants": 1}

    # A refresh cannot widen it either.
    tokens = flow.exchange(code, verifier)
    assert tokens.status_code == 200, tokens.text
    refreshed = flow.token(
        grant_type="refresh_token", refresh_token=tokens.json()["refresh_token"], resource=OTHER_RESOURCE
    )
    assert_token_error(refreshed, "invalid_target")
    assert world.stored(flow) == {**NOTHING_ISSUED, "access_tokens": 1, "live_refresh_tokens": 1}


def test_a_token_bound_to_another_resource_in_the_database_is_refused(world: World) -> None:
    flow = world.signed_in()
    access = world.tokens(flow)["access_token"]
    assert flow.mcp(access, INITIALIZE).status_code == 200
    shell_json(
        world.inst,
        "import json; from oauth2_provider.models import AccessToken; "
        f"n = AccessToken.objects.filter(application__client_id={flow.client_id!r}, scope='mcp')"
        f".update(resource=[{OTHER_RESOURCE!r}]); print(json.dumps(n))",
    )
    answer = flow.mcp(access, INITIALIZE)
    assert answer.status_code == 401
    assert 'error="invalid_token"' in answer.headers["www-authenticate"]


# --- refresh tokens (RFC 9700 §4.14.2: rotation, a replay revokes the family) ----------------


def test_a_reused_refresh_token_revokes_its_whole_family(world: World) -> None:
    flow = world.signed_in()
    first = world.tokens(flow)
    second = flow.token(grant_type="refresh_token", refresh_token=first["refresh_token"])
    assert second.status_code == 200, second.text
    new = second.json()
    assert new["refresh_token"] != first["refresh_token"]
    assert flow.mcp(new["access_token"], INITIALIZE).status_code == 200
    # Past the grace window for a client that refreshed twice at once
    # (REFRESH_TOKEN_GRACE_PERIOD_SECONDS): the rotation is moved back rather than waited for.
    shell_json(
        world.inst,
        "import json, datetime; from django.utils import timezone; "
        "from oauth2_provider.models import RefreshToken; from oauth2_provider.settings import oauth2_settings; "
        "ago = timezone.now() - datetime.timedelta(seconds=oauth2_settings.REFRESH_TOKEN_GRACE_PERIOD_SECONDS + 5); "
        f"n = RefreshToken.objects.filter(application__client_id={flow.client_id!r}, revoked__isnull=False)"
        ".update(revoked=ago); print(json.dumps(n))",
    )

    replay = flow.token(grant_type="refresh_token", refresh_token=first["refresh_token"])
    assert_token_error(replay, "invalid_grant")
    assert flow.mcp(new["access_token"], INITIALIZE).status_code == 401
    assert_token_error(flow.token(grant_type="refresh_token", refresh_token=new["refresh_token"]), "invalid_grant")
    assert world.stored(flow)["live_refresh_tokens"] == 0


def test_a_refresh_token_two_rotations_old_is_a_replay_even_within_the_grace_window(world: World) -> None:
    flow = world.signed_in()
    first = world.tokens(flow)
    second = flow.token(grant_type="refresh_token", refresh_token=first["refresh_token"])
    assert second.status_code == 200, second.text
    third = flow.token(grant_type="refresh_token", refresh_token=second.json()["refresh_token"])
    assert third.status_code == 200, third.text
    # The grace window is for one client refreshing twice at once, not for a token whose
    # successor was itself rotated: that is a stolen copy coming back.
    replay = flow.token(grant_type="refresh_token", refresh_token=first["refresh_token"])
    assert_token_error(replay, "invalid_grant")
    assert flow.mcp(third.json()["access_token"], INITIALIZE).status_code == 401
    assert world.stored(flow)["live_refresh_tokens"] == 0


# --- revocation (RFC 7009) ---------------------------------------------------------------------


def revoke(flow: Flow, token: str, client_id: str | None = None) -> httpx.Response:
    data = {"token": token, "client_id": client_id or flow.client_id}
    return httpx.post(flow.metadata["revocation_endpoint"], data=data, timeout=10)


def test_a_revoked_access_token_is_refused_at_once(world: World) -> None:
    flow = world.signed_in()
    tokens = world.tokens(flow)
    assert flow.mcp(tokens["access_token"], INITIALIZE).status_code == 200
    # Another client cannot revoke it (RFC 7009 §2.1): 200, and the token still works.
    other = world.client()
    assert revoke(other, tokens["access_token"]).status_code == 200
    assert flow.mcp(tokens["access_token"], INITIALIZE).status_code == 200

    assert revoke(flow, tokens["access_token"]).status_code == 200
    assert flow.mcp(tokens["access_token"], INITIALIZE).status_code == 401
    # Its refresh token goes with it, or the revocation could be undone by a refresh.
    assert_token_error(flow.token(grant_type="refresh_token", refresh_token=tokens["refresh_token"]), "invalid_grant")
    assert world.stored(flow) == {**NOTHING_ISSUED}


def test_a_revoked_refresh_token_is_refused_and_an_unknown_token_revokes_fine(world: World) -> None:
    flow = world.signed_in()
    tokens = world.tokens(flow)
    assert revoke(flow, tokens["refresh_token"]).status_code == 200
    # At once, so within the refresh grace window: a revoked token was never superseded.
    assert_token_error(flow.token(grant_type="refresh_token", refresh_token=tokens["refresh_token"]), "invalid_grant")
    assert world.stored(flow)["live_refresh_tokens"] == 0
    unknown = revoke(flow, "not-a-token-of-this-server")
    assert unknown.status_code == 200  # RFC 7009 §2.2: nothing to say about unknown tokens


# --- the consent page ---------------------------------------------------------------------------


def test_the_consent_page_may_not_be_framed(world: World) -> None:
    flow = world.signed_in()
    _verifier, challenge = pkce_pair()
    page = flow.authorize_page(challenge)
    assert page.status_code == 200
    assert page.headers["x-frame-options"] == "DENY"
    # The page is being rebuilt: CSP is checked when it is sent at all.
    csp = page.headers.get("content-security-policy")
    if csp is not None:
        assert "frame-ancestors 'none'" in csp


def test_a_consent_post_needs_the_approving_users_own_csrf_token(world: World) -> None:
    alice = world.signed_in()
    _verifier, challenge = pkce_pair()
    page = alice.authorize_page(challenge)
    fields = form_fields(page.text)
    bob = Flow(world.server.url, redirect_uri=APP_URI, client_id=alice.client_id)
    bob.login("bob", "bob-secret-123")

    replayed = bob.browser.post("/oauth/authorize/", data={**fields, "allow": "Authorize"})
    assert replayed.status_code == 403
    assert "location" not in replayed.headers
    without = {name: value for name, value in fields.items() if name != "csrfmiddlewaretoken"}
    assert bob.browser.post("/oauth/authorize/", data={**without, "allow": "Authorize"}).status_code == 403
    assert alice.browser.post("/oauth/authorize/", data={**without, "allow": "Authorize"}).status_code == 403
    assert world.stored(alice) == NOTHING_ISSUED


def test_the_code_acts_as_the_user_who_approved(world: World) -> None:
    alice = world.signed_in()
    verifier, challenge = pkce_pair()
    fields = form_fields(alice.authorize_page(challenge).text)
    bob = Flow(world.server.url, redirect_uri=APP_URI, client_id=alice.client_id)
    bob.login("bob", "bob-secret-123")
    bobs_page = bob.authorize_page(challenge)
    bobs_csrf = form_fields(bobs_page.text)["csrfmiddlewaretoken"]
    # The form alice was shown, approved in bob's browser with bob's own CSRF token.
    answer = bob.browser.post(
        "/oauth/authorize/", data={**fields, "csrfmiddlewaretoken": bobs_csrf, "allow": "Authorize"}
    )
    assert answer.status_code == 302, answer.text[:300]
    tokens = alice.exchange(redirect_query(answer)["code"], verifier)
    assert tokens.status_code == 200, tokens.text
    access = tokens.json()["access_token"]
    assert alice.mcp(access, INITIALIZE).status_code == 200
    assert alice.mcp(access, TOOLS_LIST).status_code == 200
    listed = alice.mcp(access, LIST_AGENTS)
    assert listed.status_code == 200
    text = listed.text
    assert "bob-agent" in text and "admin-agent" not in text


# --- RFC 9207: iss in every authorization response --------------------------------------------


def test_the_success_redirect_carries_iss(world: World) -> None:
    flow = world.signed_in()
    _verifier, challenge = pkce_pair()
    answer = flow.approve(flow.authorize_page(challenge))
    assert answer.status_code == 302
    query = redirect_query(answer)
    assert "code" in query and query["iss"] == flow.metadata["issuer"]


def test_error_redirects_carry_iss(world: World) -> None:
    flow = world.signed_in()
    _verifier, challenge = pkce_pair()
    page = flow.authorize_page(challenge)
    fields = {name: value for name, value in form_fields(page.text).items() if name != "allow"}
    denied = flow.browser.post("/oauth/authorize/", data=fields)  # Cancel
    assert denied.status_code == 302
    assert redirect_query(denied)["error"] == "access_denied"
    no_challenge = flow.authorize_page("", code_challenge=None, code_challenge_method=None)  # type: ignore[arg-type]
    assert redirect_query(no_challenge)["error"] == "invalid_request"
    for answer in (denied, no_challenge):
        assert redirect_query(answer).get("iss") == flow.metadata["issuer"], answer.headers["location"]
