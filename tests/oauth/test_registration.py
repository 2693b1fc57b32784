"""Who may become an OAuth client of Dispatch, against strangers (docs/mcp.md#oauth-clients),
over a real ``manage.py serve``: open Dynamic Client Registration (RFC 7591) with its redirect
URI rules, per-address rate, cap and cleanup, and admin switch; Client ID Metadata Documents
fetched from a TLS server of the test's own (a CA trusted through ``SSL_CERT_FILE``), with
private addresses, size, time, identity and redirect URIs checked.

Each refusal is checked for its status and error code and for what was not stored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.infra import Instance, Server, instance
from tests.oauth.flow import Flow, pkce_pair
from tests.oauth.hostile_support import (
    MetadataCA,
    MetadataServer,
    elapsed,
    make_ca,
    metadata_server,
    set_policy,
    shell_json,
    tcp_listener,
    temp_folder,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

DCR_CLIENT_IDS = (
    "import json; from oauth2_provider.models import Application; "
    "print(json.dumps(sorted(Application.objects.filter(registration_source='dcr')"
    ".values_list('client_id', flat=True))))"
)


def dcr_client_ids(inst: Instance) -> list[str]:
    """The client ids of every DCR-registered application, sorted."""
    return list(shell_json(inst, DCR_CLIENT_IDS))


def application_exists(inst: Instance, client_id: str) -> bool:
    return bool(
        shell_json(
            inst,
            "import json; from oauth2_provider.models import Application; "
            f"print(json.dumps(Application.objects.filter(client_id={client_id!r}).exists()))",
        )
    )


def metadata(server: Server) -> dict[str, Any]:
    return dict(httpx.get(f"{server.url}/.well-known/oauth-authorization-server/oauth", timeout=10).json())


def assert_registration_error(answer: httpx.Response, status: int, error: str) -> None:
    """An RFC 7591 §3.2.2 error: ``status``, ``{"error": error}``, no client."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["error"] == error, body
    assert "client_id" not in body


# --- Dynamic Client Registration --------------------------------------------------------------


@pytest.fixture(scope="module")
def dcr() -> Iterator[tuple[Instance, Server]]:
    with instance() as inst:
        yield inst, inst.serve(public=True, DISPATCH_OAUTH_DCR_RATE="1000/hour")


def test_registration_takes_https_and_loopback_redirect_uris_only(dcr: tuple[Instance, Server]) -> None:
    inst, server = dcr
    flow = Flow(server.url)
    accepted = [
        flow.register(redirect_uris=["https://app.example/cb"]),
        flow.register(redirect_uris=["http://localhost:1234/cb"]),
        flow.register(redirect_uris=["http://127.0.0.1/callback"]),
    ]
    assert [answer.status_code for answer in accepted] == [201, 201, 201]
    registered = {answer.json()["client_id"] for answer in accepted}
    refused = [
        "http://example.com/cb",  # http off loopback: anyone on the path reads the code
        "https://app.example/cb#fragment",  # RFC 6749 §3.1.2
        "javascript:alert(document.domain)",
        "data:text/html,<script>alert(1)</script>",
        "https:///cb",  # no host
        "http://127.0.0.1.evil.example/cb",  # looks like loopback, is not
        "http://127.0.0.1:70000/cb",  # no such port (the settings page would fail to show it)
        "https://app.example:abc/cb",
    ]
    for uri in refused:
        answer = flow.register(redirect_uris=[uri])
        assert_registration_error(answer, 400, "invalid_redirect_uri")
        # One bad URI refuses the registration, good ones beside it or not.
        answer = flow.register(redirect_uris=["https://app.example/cb", uri])
        assert_registration_error(answer, 400, "invalid_redirect_uri")
    assert set(dcr_client_ids(inst)) == registered


def test_a_registration_update_takes_no_redirect_uri_registration_refuses(dcr: tuple[Instance, Server]) -> None:
    inst, server = dcr
    flow = Flow(server.url)
    created = flow.register()
    assert created.status_code == 201
    body = created.json()
    update = {
        "client_id": body["client_id"],
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
        "token_endpoint_auth_method": "none",
    }
    answer = httpx.put(
        body["registration_client_uri"],
        json={**update, "redirect_uris": ["http://evil.example/cb"]},
        headers={"Authorization": f"Bearer {body['registration_access_token']}"},
        timeout=10,
    )
    stored_uris = shell_json(
        inst,
        "import json; from oauth2_provider.models import Application; "
        f"print(json.dumps(Application.objects.get(client_id={flow.client_id!r}).redirect_uris))",
    )
    assert stored_uris == flow.redirect_uri
    assert_registration_error(answer, 400, "invalid_redirect_uri")


def test_the_admin_switch_turns_registration_off(dcr: tuple[Instance, Server]) -> None:
    inst, server = dcr
    flow = Flow(server.url)
    before = dcr_client_ids(inst)
    set_policy(inst, dcr_enabled=False)
    try:
        assert "registration_endpoint" not in metadata(server)
        answer = httpx.post(f"{server.url}/oauth/register/", json={"redirect_uris": ["https://app.example/cb"]})
        assert_registration_error(answer, 403, "access_denied")
        assert dcr_client_ids(inst) == before
    finally:
        set_policy(inst, dcr_enabled=True)
    assert metadata(server)["registration_endpoint"] == f"{server.url}/oauth/register/"
    assert flow.register().status_code == 201


def test_an_address_registering_too_often_is_told_to_slow_down() -> None:
    with instance() as inst:
        server = inst.serve(public=True, DISPATCH_OAUTH_DCR_RATE="3/hour")
        flow = Flow(server.url)
        assert [flow.register().status_code for _ in range(3)] == [201, 201, 201]
        answer = flow.register()
        assert_registration_error(answer, 429, "slow_down")
        assert int(answer.headers["retry-after"]) > 0
        assert len(dcr_client_ids(inst)) == 3


def test_the_cap_on_registered_clients_makes_room_only_from_unused_ones() -> None:
    with instance() as inst:
        server = inst.serve(public=True, DISPATCH_OAUTH_DCR_MAX_CLIENTS="2", DISPATCH_OAUTH_DCR_UNUSED_SECONDS="60")
        unused = Flow(server.url)
        used = Flow(server.url)
        assert unused.register().status_code == 201 and used.register().status_code == 201
        used.login("admin", inst.admin_password)
        verifier, challenge = pkce_pair()
        assert used.exchange(used.code(challenge), verifier).status_code == 200

        full = Flow(server.url).register()
        assert_registration_error(full, 503, "temporarily_unavailable")
        assert int(full.headers["retry-after"]) > 0
        assert sorted(dcr_client_ids(inst)) == sorted([unused.client_id, used.client_id])

        # Both an hour old: only the one that never got a token may go.
        shell_json(
            inst,
            "import json, datetime; from django.utils import timezone; "
            "from oauth2_provider.models import Application; "
            "n = Application.objects.update(created=timezone.now() - datetime.timedelta(hours=1)); "
            "print(json.dumps(n))",
        )
        newcomer = Flow(server.url)
        answer = newcomer.register()
        assert answer.status_code == 201, answer.text
        assert sorted(dcr_client_ids(inst)) == sorted([used.client_id, newcomer.client_id])
        # Full again, and nothing unused is old enough.
        assert_registration_error(Flow(server.url).register(), 503, "temporarily_unavailable")


# --- Client ID Metadata Documents ---------------------------------------------------------------


@dataclass
class Cimd:
    inst: Instance
    server: Server
    documents: MetadataServer

    def signed_in(self, client_id: str, redirect_uri: str = "http://127.0.0.1:9/callback") -> Flow:
        flow = Flow(self.server.url, redirect_uri=redirect_uri, client_id=client_id)
        flow.login("admin", self.inst.admin_password)
        return flow


def client_document(url: str, **changes: Any) -> dict[str, Any]:
    return {
        "client_id": url,
        "client_name": "Metadata Document Client",
        "redirect_uris": ["http://127.0.0.1/callback"],
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
        "token_endpoint_auth_method": "none",
        **changes,
    }


@pytest.fixture(scope="module")
def ca() -> MetadataCA:
    return make_ca(temp_folder())


@pytest.fixture(scope="module")
def cimd(ca: MetadataCA) -> Iterator[Cimd]:
    with instance() as inst, metadata_server(ca) as documents:
        server = inst.serve(public=True, SSL_CERT_FILE=str(ca.ca_file), DISPATCH_OAUTH_CIMD_TIMEOUT="1")
        yield Cimd(inst, server, documents)


def assert_unknown_client(answer: httpx.Response) -> None:
    """The authorization endpoint's answer to a client it does not know: an error page, no redirect."""
    assert answer.status_code == 400, answer.text[:300]
    assert "location" not in answer.headers
    assert "invalid_client_id" in answer.text or "invalid_request" in answer.text


def test_a_metadata_document_on_a_private_address_is_not_fetched(cimd: Cimd) -> None:
    set_policy(cimd.inst, cimd_enabled=True, cimd_private_addresses=False)
    with tcp_listener() as listener:
        client_id = f"https://127.0.0.1:{listener.port}/client.json"
        flow = cimd.signed_in(client_id)
        _verifier, challenge = pkce_pair()
        assert_unknown_client(flow.authorize_page(challenge))
        assert listener.accepted == 0
    assert not application_exists(cimd.inst, client_id)


def test_a_valid_metadata_document_names_the_client_on_the_consent_page(cimd: Cimd) -> None:
    set_policy(cimd.inst, cimd_enabled=True, cimd_private_addresses=True)
    url = cimd.documents.url("/valid.json")
    cimd.documents.publish("/valid.json", client_document(url, client_name="Doc <b>Client</b>"))
    flow = cimd.signed_in(url)
    verifier, challenge = pkce_pair()
    page = flow.authorize_page(challenge)
    assert page.status_code == 200, page.text[:500]
    assert "Doc &lt;b&gt;Client&lt;/b&gt;" in page.text and "<b>Client</b>" not in page.text
    assert cimd.documents.hits["/valid.json"] >= 1
    tokens = flow.exchange(flow.code(challenge), verifier)
    assert tokens.status_code == 200, tokens.text


def test_a_metadata_document_over_16_kib_is_refused(cimd: Cimd) -> None:
    set_policy(cimd.inst, cimd_enabled=True, cimd_private_addresses=True)
    url = cimd.documents.url("/large.json")
    cimd.documents.publish("/large.json", client_document(url, padding="x" * (16 * 1024)))
    flow = cimd.signed_in(url)
    _verifier, challenge = pkce_pair()
    assert_unknown_client(flow.authorize_page(challenge))
    assert cimd.documents.hits["/large.json"] == 1
    assert not application_exists(cimd.inst, url)


def test_a_slow_metadata_document_is_given_up_on(cimd: Cimd) -> None:
    set_policy(cimd.inst, cimd_enabled=True, cimd_private_addresses=True)
    url = cimd.documents.url("/slow.json")
    cimd.documents.publish("/slow.json", client_document(url), delay=8)
    flow = cimd.signed_in(url)
    _verifier, challenge = pkce_pair()
    start = time.monotonic()
    answer = flow.authorize_page(challenge)
    took = elapsed(start)
    assert_unknown_client(answer)
    assert cimd.documents.hits["/slow.json"] == 1
    # DISPATCH_OAUTH_CIMD_TIMEOUT=1: refused well before the document would have come.
    assert took < 5, took
    assert not application_exists(cimd.inst, url)


@pytest.mark.parametrize(
    "dripping",
    [
        # Headers at once, then ~250 bytes at one every 0.1 s: 25 s for the whole document.
        pytest.param({"drip": 0.1}, id="the-document"),
        # ~400 bytes of status line and headers at one every 0.05 s: 20 s before the body.
        pytest.param({"header_drip": 0.05}, id="the-headers"),
    ],
)
def test_a_metadata_server_sending_a_byte_at_a_time_is_given_up_on(cimd: Cimd, dripping: dict[str, float]) -> None:
    """Each byte comes well within a socket timeout; only a deadline on the whole fetch,
    from the connection to the last byte, ends it."""
    set_policy(cimd.inst, cimd_enabled=True, cimd_private_addresses=True)
    path = f"/drip-{'-'.join(dripping)}.json"
    url = cimd.documents.url(path)
    cimd.documents.publish(path, client_document(url), **dripping)
    flow = cimd.signed_in(url)
    _verifier, challenge = pkce_pair()
    start = time.monotonic()
    try:
        answer = flow.authorize_page(challenge)
    except httpx.TimeoutException:
        pytest.fail(f"the authorization request was still held after {elapsed(start):.0f} s")
    took = elapsed(start)
    assert_unknown_client(answer)
    assert took < 5, took  # DISPATCH_OAUTH_CIMD_TIMEOUT=1
    assert not application_exists(cimd.inst, url)


def test_a_metadata_document_naming_another_client_id_is_refused(cimd: Cimd) -> None:
    set_policy(cimd.inst, cimd_enabled=True, cimd_private_addresses=True)
    url = cimd.documents.url("/impostor.json")
    other = cimd.documents.url("/valid.json")
    cimd.documents.publish("/impostor.json", client_document(other))
    flow = cimd.signed_in(url)
    _verifier, challenge = pkce_pair()
    assert_unknown_client(flow.authorize_page(challenge))
    assert cimd.documents.hits["/impostor.json"] == 1
    assert not application_exists(cimd.inst, url)


def test_a_metadata_document_with_a_plain_http_redirect_uri_is_refused(cimd: Cimd) -> None:
    set_policy(cimd.inst, cimd_enabled=True, cimd_private_addresses=True)
    url = cimd.documents.url("/http-redirect.json")
    document = client_document(url, redirect_uris=["http://127.0.0.1/callback", "http://evil.example/cb"])
    cimd.documents.publish("/http-redirect.json", document)
    _verifier, challenge = pkce_pair()
    to_http = cimd.signed_in(url, redirect_uri="http://evil.example/cb").authorize_page(challenge)
    assert to_http.status_code == 400 and "location" not in to_http.headers
    # One refused URI refuses the document, as it refuses a DCR registration.
    assert_unknown_client(cimd.signed_in(url).authorize_page(challenge))
    assert not application_exists(cimd.inst, url)


def test_a_token_request_from_an_unseen_metadata_document_client_fetches_nothing(cimd: Cimd) -> None:
    set_policy(cimd.inst, cimd_enabled=True, cimd_private_addresses=True)
    url = cimd.documents.url("/token-first.json")
    cimd.documents.publish("/token-first.json", client_document(url))
    # No session, no code of this client can exist: a stranger's request, not a sign-in.
    answer = httpx.post(
        f"{cimd.server.url}/oauth/token/",
        data={
            "grant_type": "authorization_code",
            "client_id": url,
            "code": "made-up",
            "redirect_uri": "http://127.0.0.1:9/callback",
            "code_verifier": "v" * 50,
        },
        timeout=20,
    )
    assert answer.status_code in (400, 401) and "access_token" not in answer.json()
    revoke_url = cimd.documents.url("/revoke-first.json")
    cimd.documents.publish("/revoke-first.json", client_document(revoke_url))
    revoked = httpx.post(
        f"{cimd.server.url}/oauth/revoke/", data={"token": "made-up", "client_id": revoke_url}, timeout=20
    )
    assert revoked.status_code in (200, 400, 401)
    assert cimd.documents.hits.get("/token-first.json", 0) == 0
    assert cimd.documents.hits.get("/revoke-first.json", 0) == 0
    assert not application_exists(cimd.inst, url) and not application_exists(cimd.inst, revoke_url)


def test_with_metadata_documents_off_a_url_client_id_is_an_unknown_client(cimd: Cimd) -> None:
    set_policy(cimd.inst, cimd_enabled=False, cimd_private_addresses=True)
    try:
        assert metadata(cimd.server)["client_id_metadata_document_supported"] is False
        url = cimd.documents.url("/off.json")
        cimd.documents.publish("/off.json", client_document(url))
        flow = cimd.signed_in(url)
        _verifier, challenge = pkce_pair()
        assert_unknown_client(flow.authorize_page(challenge))
        assert cimd.documents.hits.get("/off.json", 0) == 0
        assert not application_exists(cimd.inst, url)
    finally:
        set_policy(cimd.inst, cimd_enabled=True)
