"""The OAuth sign-in of ``/mcp/oauth`` over a real ``manage.py serve``, step by step
(docs/mcp.md#oauth): discovery from the 401, registration, consent, code, token, MCP."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from tests.infra import Instance, Server, instance
from tests.oauth.flow import INITIALIZE, MCP_HEADERS, Flow

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOOLS_LIST = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Instance, Server]]:
    with instance() as inst:
        yield inst, inst.serve(public=True)


def test_discovery_registration_consent_token_and_tools(served: tuple[Instance, Server]) -> None:
    inst, server = served
    unauthenticated = httpx.post(f"{server.url}/mcp/oauth", json=INITIALIZE, headers=MCP_HEADERS)
    assert unauthenticated.status_code == 401
    challenge = unauthenticated.headers["www-authenticate"]
    metadata_url = f"{server.url}/.well-known/oauth-protected-resource/mcp/oauth"
    assert f'resource_metadata="{metadata_url}"' in challenge and 'scope="mcp"' in challenge
    resource = httpx.get(metadata_url).json()
    assert resource["resource"] == f"{server.url}/mcp/oauth"
    issuer = f"{server.url}/oauth"
    assert resource["authorization_servers"] == [issuer]
    # Nothing at the root: a client configured with a header token for /mcp must find no OAuth.
    assert httpx.get(f"{server.url}/.well-known/oauth-authorization-server").status_code == 404
    assert httpx.get(f"{server.url}/.well-known/oauth-protected-resource").status_code == 404
    assert httpx.get(f"{server.url}/.well-known/oauth-protected-resource/mcp").status_code == 404
    assert httpx.get(f"{server.url}/oauth/.well-known/oauth-authorization-server").json()["issuer"] == issuer

    flow = Flow(server.url)
    assert flow.metadata["issuer"] == issuer
    assert flow.metadata["code_challenge_methods_supported"] == ["S256"]
    assert flow.metadata["authorization_response_iss_parameter_supported"] is True
    assert flow.register().status_code == 201
    flow.login("admin", inst.admin_password)
    from tests.oauth.flow import pkce_pair

    verifier, pkce_challenge = pkce_pair()
    page = flow.authorize_page(pkce_challenge)
    assert page.status_code == 200, page.text[:300]
    answer = flow.approve(page)
    assert answer.status_code == 302
    query = parse_qs(urlsplit(answer.headers["location"]).query)
    assert query["iss"] == [issuer] and query["state"] == ["st"]
    tokens = flow.exchange(query["code"][0], verifier)
    assert tokens.status_code == 200, tokens.text
    access = tokens.json()["access_token"]
    assert flow.mcp(access, INITIALIZE).status_code == 200
    listed = flow.mcp(access, TOOLS_LIST)
    names = {tool["name"] for tool in listed.json()["result"]["tools"]}
    assert "list_agents" in names and "local_pc_execute_command" in names
    # The header endpoint and the REST API take no OAuth token, and /mcp/oauth no API token.
    assert flow.mcp(access, INITIALIZE, path="/mcp").status_code == 401
    assert httpx.get(f"{server.url}/api/v1/agents", headers={"Authorization": f"Bearer {access}"}).status_code == 401
    assert flow.mcp(inst.admin_token, INITIALIZE).status_code == 401


CURSOR_REDIRECTS = [
    "cursor://anysphere.cursor-mcp/oauth/callback",
    "https://www.cursor.com/agents/mcp/oauth/callback",
    "http://localhost:8787/callback",
]


def test_cursors_registration_with_its_private_use_scheme_signs_in(served: tuple[Instance, Server]) -> None:
    """Cursor registers three redirect URIs in one request — its private-use scheme
    (RFC 8252 §7.1), an https one and a loopback one — and is redirected to the first."""
    inst, server = served
    flow = Flow(server.url, redirect_uri=CURSOR_REDIRECTS[0])
    registered = flow.register(redirect_uris=CURSOR_REDIRECTS, client_name="Cursor")
    assert registered.status_code == 201, registered.text
    assert registered.json()["redirect_uris"] == CURSOR_REDIRECTS
    flow.login("admin", inst.admin_password)
    tokens = flow.signed_in()
    assert flow.mcp(tokens["access_token"], INITIALIZE).status_code == 200


@pytest.mark.parametrize(
    "uri", ["javascript:alert(1)", "http://example.com/callback", "data:text/html,x", "https://a.example/cb#frag"]
)
def test_a_redirect_uri_of_the_web_that_is_not_https_is_refused_at_registration(
    served: tuple[Instance, Server], uri: str
) -> None:
    flow = Flow(served[1].url)
    refused = flow.register(redirect_uris=["http://127.0.0.1/cb", uri])
    assert refused.status_code == 400 and refused.json()["error"] == "invalid_redirect_uri"


def test_a_refresh_token_just_rotated_refreshes_once_more_then_its_replay_revokes_the_family() -> None:
    """Two refreshes at once with one refresh token (a client whose two requests found the
    access token expired): within the grace window the second gets a new pair of the same
    family — not empty tokens, not a 500; a third use is a replay, and the family goes."""
    with instance() as inst:
        server = inst.serve(public=True, DISPATCH_OAUTH_REFRESH_GRACE_SECONDS="60")
        flow = Flow(server.url)
        flow.login("admin", inst.admin_password)
        first = flow.signed_in()

        def refresh(token: str) -> httpx.Response:
            return flow.token(grant_type="refresh_token", refresh_token=token)

        rotated = refresh(first["refresh_token"])
        again = refresh(first["refresh_token"])
        assert rotated.status_code == 200 and again.status_code == 200, again.text
        pairs = [rotated.json(), again.json()]
        assert pairs[0]["access_token"] != pairs[1]["access_token"] and all(p["access_token"] for p in pairs)
        assert all(flow.mcp(p["access_token"], INITIALIZE).status_code == 200 for p in pairs)
        replayed = refresh(first["refresh_token"])
        assert replayed.status_code == 400 and replayed.json()["error"] == "invalid_grant"
        assert all(flow.mcp(p["access_token"], INITIALIZE).status_code == 401 for p in pairs)
        assert all(refresh(p["refresh_token"]).status_code == 400 for p in pairs)


@pytest.mark.parametrize("postgres", [False, pytest.param(True, marks=pytest.mark.postgres)])
def test_refreshes_sent_together_get_at_most_two_pairs_and_a_third_use_revokes_the_family(postgres: bool) -> None:
    """Five refreshes with one refresh token at the same instant all pass validation before
    any is saved; the rotation's row lock orders them: one rotation, one second pair, and
    the others are third uses, refused, and the family goes with every pair issued."""
    with instance(postgres=postgres) as inst:
        server = inst.serve(public=True, DISPATCH_OAUTH_REFRESH_GRACE_SECONDS="60")
        flow = Flow(server.url)
        flow.login("admin", inst.admin_password)
        first = flow.signed_in()
        racers = 5
        barrier = threading.Barrier(racers)
        answers: list[httpx.Response] = []

        def refresh() -> None:
            barrier.wait()
            answers.append(flow.token(grant_type="refresh_token", refresh_token=first["refresh_token"]))

        threads = [threading.Thread(target=refresh) for _ in range(racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)

        statuses = sorted(answer.status_code for answer in answers)
        assert statuses == [200, 200, 400, 400, 400], [answer.text[:200] for answer in answers]
        assert all(a.json()["error"] == "invalid_grant" for a in answers if a.status_code == 400)
        pairs = [answer.json() for answer in answers if answer.status_code == 200]
        assert all(flow.mcp(pair["access_token"], INITIALIZE).status_code == 401 for pair in pairs)
        refreshed = [flow.token(grant_type="refresh_token", refresh_token=pair["refresh_token"]) for pair in pairs]
        assert [answer.status_code for answer in refreshed] == [400, 400]


def test_a_deactivated_users_refresh_token_gets_nothing(served: tuple[Instance, Server]) -> None:
    inst, server = served
    inst.manage(
        "shell",
        "-c",
        "from django.contrib.auth.models import User; User.objects.create_user('dave', password='dave-secret-9')",
    )
    flow = Flow(server.url)
    flow.login("dave", "dave-secret-9")
    pair = flow.signed_in()
    inst.manage(
        "shell",
        "-c",
        "from django.contrib.auth.models import User; User.objects.filter(username='dave').update(is_active=False)",
    )
    refused = flow.token(grant_type="refresh_token", refresh_token=pair["refresh_token"])
    assert refused.status_code == 400 and refused.json()["error"] == "invalid_grant", refused.text
    inst.manage(
        "shell",
        "-c",
        "from django.contrib.auth.models import User; User.objects.filter(username='dave').update(is_active=True)",
    )
    assert flow.mcp(pair["access_token"], INITIALIZE).status_code == 200  # the refusal revoked nothing


@pytest.mark.parametrize(
    "grant_types", [["client_credentials"], ["authorization_code", "password"], ["implicit"], ["device_code"]]
)
def test_a_client_registers_for_the_authorization_code_grant_only(
    served: tuple[Instance, Server], grant_types: list[str]
) -> None:
    """A grant whose tokens name no person (client credentials) or that RFC 9700 retires
    would let a stranger mint token rows without signing anyone in."""
    refused = Flow(served[1].url).register(grant_types=grant_types, token_endpoint_auth_method="client_secret_basic")
    assert refused.status_code == 400 and refused.json()["error"] == "invalid_client_metadata", refused.text


def test_a_code_exchanged_twice_revokes_what_its_first_exchange_issued(served: tuple[Instance, Server]) -> None:
    """RFC 6749 §4.1.2: a code used twice is refused, and the tokens issued with it are revoked."""
    inst, server = served
    flow = Flow(server.url)
    assert flow.register().status_code == 201
    flow.login("admin", inst.admin_password)
    from tests.oauth.flow import pkce_pair

    verifier, challenge = pkce_pair()
    code = flow.code(challenge)
    first = flow.exchange(code, verifier)
    assert first.status_code == 200
    tokens = first.json()
    assert flow.mcp(tokens["access_token"], INITIALIZE).status_code == 200
    replayed = flow.exchange(code, verifier)
    assert replayed.status_code == 400 and replayed.json()["error"] == "invalid_grant"
    assert flow.mcp(tokens["access_token"], INITIALIZE).status_code == 401
    refreshed = flow.token(grant_type="refresh_token", refresh_token=tokens["refresh_token"])
    assert refreshed.status_code == 400
