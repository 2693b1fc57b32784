"""The consent page of ``/oauth/authorize/`` and the OAuth section of ``/settings/``
(docs/mcp.md#oauth-consent, docs/mcp.md#oauth-connected-applications), through Django's
test client: what the user is shown, that the checked boxes decide the token's scope, CSRF
and framing, errors that never redirect, connected applications and their revocation, the
admin's switches."""

from __future__ import annotations

import html
import json
import re
import time
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.contrib import admin
from django.test import Client
from django.utils import timezone
from oauth2_provider.models import (
    get_access_token_model,
    get_application_model,
    get_grant_model,
    get_refresh_token_model,
)
from starlette.datastructures import Headers

from core.models import ServerProcess
from dispatch.mcp.app import authenticate_oauth
from dispatch.mcp.server import Caller
from dispatch.models import McpStream
from oauth.models import OAuthPolicy
from tests.infra import instance
from tests.oauth.flow import EventStream, Flow, form_fields, pkce_pair

pytestmark = pytest.mark.django_db

REDIRECT_URI = "http://127.0.0.1:33418/callback"
HOST = {"HTTP_HOST": "127.0.0.1:8000"}

Application = get_application_model()
AccessToken = get_access_token_model()
RefreshToken = get_refresh_token_model()
Grant = get_grant_model()


def text_of(response: Any) -> str:
    return html.unescape(response.content.decode())


@pytest.fixture
def application() -> Any:
    """A public client registered by DCR, as an MCP client registers itself."""
    return Application.objects.create(
        name="Claude Code",
        client_type=Application.CLIENT_PUBLIC,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=REDIRECT_URI,
        registration_source=Application.RegistrationSource.DCR,
        client_secret="",
    )


@pytest.fixture
def alice(client: Client, owner: Any) -> Client:
    client.force_login(owner)
    return client


@pytest.fixture
def bob(member: Any) -> Client:
    browser = Client()
    browser.force_login(member)
    return browser


def authorize_query(application: Any, challenge: str, **extra: str | None) -> dict[str, str]:
    query: dict[str, str | None] = {
        "response_type": "code",
        "client_id": application.client_id,
        "redirect_uri": REDIRECT_URI,
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "state": "st",
        "scope": "mcp",
        "resource": settings.MCP_OAUTH_RESOURCE,
        **extra,
    }
    return {key: value for key, value in query.items() if value is not None}


def consent_page(browser: Client, application: Any, challenge: str = "x" * 43, **extra: str | None) -> Any:
    return browser.get("/oauth/authorize/", authorize_query(application, challenge, **extra), **HOST)


def post_consent(browser: Client, page: Any, **changes: Any) -> Any:
    fields = {**form_fields(page.content.decode()), **changes}
    return browser.post("/oauth/authorize/", fields, **HOST)


def redirect_query(response: Any) -> dict[str, list[str]]:
    assert response.status_code == 302, text_of(response)[:800]
    location = response["Location"]
    assert location.startswith(REDIRECT_URI), location
    return parse_qs(urlsplit(location).query)


def signed_in(browser: Client, application: Any, scopes: list[str], requested: str = "mcp") -> dict[str, Any]:
    """Consent with ``scopes`` checked, exchange the code at the token endpoint; the token response."""
    verifier, challenge = pkce_pair()
    page = consent_page(browser, application, challenge, scope=requested)
    assert page.status_code == 200, text_of(page)[:800]
    code = redirect_query(post_consent(browser, page, allow="Authorize", scopes=scopes))["code"][0]
    answer = Client().post(
        "/oauth/token/",
        {
            "grant_type": "authorization_code",
            "client_id": application.client_id,
            "code": code,
            "redirect_uri": REDIRECT_URI,
            "code_verifier": verifier,
            "resource": settings.MCP_OAUTH_RESOURCE,
        },
        **HOST,
    )
    assert answer.status_code == 200, answer.content
    return dict(answer.json())


# --- the consent page ------------------------------------------------------------------------


def test_it_sends_a_signed_out_user_to_the_login_page_first(client: Client, application: Any) -> None:
    response = consent_page(client, application)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=/oauth/authorize/")


def test_it_names_the_client_unverified_the_redirect_host_the_user_and_the_scopes(
    alice: Client, application: Any
) -> None:
    response = consent_page(alice, application)
    assert response.status_code == 200
    page = text_of(response)
    assert '<span id="consent-client-name">Claude Code</span>' in page
    assert 'id="consent-unverified"' in page and "unverified" in page
    assert '<strong id="consent-redirect-host">127.0.0.1:33418</strong>' in page
    assert "You are signed in as <strong>alice</strong>" in page
    assert "dynamic client registration" in page
    fields = form_fields(response.content.decode())
    assert fields["scopes"] == ["mcp"]  # asked for everything: only "Everything" is checked
    for scope in ("mcp", "mcp:agents", "mcp:remotes", "mcp:machines:read", "mcp:machines:write", "mcp:machines:shell"):
        assert f'name="scopes" value="{scope}"' in page
    assert "Everything: every MCP tool" in page
    assert "uncheck “Everything”" in page
    assert '<button type="submit" name="allow" value="Authorize" id="consent-allow">Allow</button>' in page
    assert 'id="consent-deny"' in page
    assert "csrfmiddlewaretoken" in fields


def test_a_metadata_document_client_shows_the_host_of_its_client_id(alice: Client) -> None:
    cimd_client = Application.objects.create(
        client_id="https://client.example.org/oauth/metadata.json",
        name="Some Editor",
        client_type=Application.CLIENT_PUBLIC,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=REDIRECT_URI,
        registration_source=Application.RegistrationSource.CIMD,
        client_secret="",
    )
    page = text_of(consent_page(alice, cimd_client))
    assert '<strong id="consent-client-id-host">client.example.org</strong>' in page
    assert "Some Editor" in page and 'id="consent-unverified"' in page


def test_a_narrow_request_shows_only_the_requested_scopes_checked(alice: Client, application: Any) -> None:
    response = consent_page(alice, application, scope="mcp:remotes mcp:machines:read")
    page = text_of(response)
    assert form_fields(response.content.decode())["scopes"] == ["mcp:remotes", "mcp:machines:read"]
    assert 'value="mcp"' not in page and 'value="mcp:machines:shell"' not in page
    assert "Call the functions of your connected remotes" in page


def test_granting_only_remotes_gives_a_token_for_remotes_only(alice: Client, application: Any) -> None:
    tokens = signed_in(alice, application, ["mcp:remotes"])
    assert tokens["scope"] == "mcp:remotes"
    assert tokens["token_type"] == "Bearer" and tokens["refresh_token"]
    assert AccessToken.objects.get().scope == "mcp:remotes"


def test_everything_but_a_shell_is_granted_as_checked(alice: Client, application: Any) -> None:
    checked = ["mcp:agents", "mcp:remotes", "mcp:machines:read", "mcp:machines:write"]
    tokens = signed_in(alice, application, checked)
    assert tokens["scope"].split() == checked


def test_everything_checked_with_narrow_boxes_is_an_error_not_everything(alice: Client, application: Any) -> None:
    """A user who checked "remotes" but left "Everything" checked meant to narrow the grant
    (or not): the page asks, it does not silently give everything."""
    page = consent_page(alice, application)
    response = post_consent(alice, page, allow="Authorize", scopes=["mcp", "mcp:remotes"])
    assert response.status_code == 400
    assert "uncheck “Everything”" in text_of(response)
    assert 'id="consent-allow"' in text_of(response)
    assert not Grant.objects.exists()


def test_it_refuses_to_grant_a_scope_the_client_did_not_request(alice: Client, application: Any) -> None:
    page = consent_page(alice, application, scope="mcp:remotes")
    for wider in (["mcp"], ["mcp:remotes", "mcp:machines:shell"]):
        response = post_consent(alice, page, allow="Authorize", scopes=wider)
        assert response.status_code == 400
        assert "was not requested by this application" in text_of(response)
        assert 'id="consent-allow"' in text_of(response)  # the page again, nothing issued
    assert not Grant.objects.exists()


def test_it_refuses_an_unknown_scope(alice: Client, application: Any) -> None:
    page = consent_page(alice, application)
    response = post_consent(alice, page, allow="Authorize", scopes=["mcp:remotes", "mcp:everything-else"])
    assert response.status_code == 400
    assert "mcp:everything-else" in text_of(response)
    assert not Grant.objects.exists()


def test_allow_with_nothing_checked_is_an_error_and_issues_nothing(alice: Client, application: Any) -> None:
    page = consent_page(alice, application)
    fields = {key: value for key, value in form_fields(page.content.decode()).items() if key != "scopes"}
    response = alice.post("/oauth/authorize/", {**fields, "allow": "Authorize"}, **HOST)
    assert response.status_code == 400
    assert 'id="consent-error"' in response.content.decode()
    assert "Check at least one permission" in text_of(response)
    assert not Grant.objects.exists()


def test_cancel_sends_the_user_back_with_access_denied(alice: Client, application: Any) -> None:
    page = consent_page(alice, application)
    query = redirect_query(post_consent(alice, page))  # no "allow": the Cancel button
    assert query["error"] == ["access_denied"] and query["state"] == ["st"]
    issuer = Client().get("/.well-known/oauth-authorization-server/oauth", **HOST).json()["issuer"]
    assert query["iss"] == [issuer]  # RFC 9207 on error responses too
    assert not Grant.objects.exists()


def test_cancel_does_not_follow_a_tampered_redirect_uri(alice: Client, application: Any) -> None:
    page = consent_page(alice, application)
    response = post_consent(alice, page, redirect_uri="https://attacker.example/steal")
    assert response.status_code == 400
    assert "Location" not in response
    assert 'id="oauth-error"' in response.content.decode()


def test_a_post_without_the_csrf_token_is_refused(owner: Any, application: Any) -> None:
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(owner)
    page = consent_page(browser, application)
    fields = {key: value for key, value in form_fields(page.content.decode()).items() if key != "csrfmiddlewaretoken"}
    response = browser.post("/oauth/authorize/", {**fields, "allow": "Authorize"}, **HOST)
    assert response.status_code == 403
    assert not Grant.objects.exists()
    # The same form with its token goes through: the 403 was the missing token.
    assert post_consent(browser, page, allow="Authorize", scopes=["mcp"]).status_code == 302


def test_the_consent_page_cannot_be_framed(alice: Client, application: Any) -> None:
    response = consent_page(alice, application)
    assert response["X-Frame-Options"] == "DENY"
    assert "frame-ancestors 'none'" in response["Content-Security-Policy"]
    assert "no-store" in response["Cache-Control"] or "no-cache" in response["Cache-Control"]


def test_an_unknown_client_gets_an_error_page_and_no_redirect(alice: Client, application: Any) -> None:
    response = alice.get(
        "/oauth/authorize/", authorize_query(application, "x" * 43, client_id="no-such-client"), **HOST
    )
    assert response.status_code in (400, 401)
    assert "Location" not in response
    assert 'id="oauth-error"' in response.content.decode()
    assert "consent-allow" not in response.content.decode()


def test_an_unregistered_redirect_uri_gets_an_error_page_and_no_redirect(alice: Client, application: Any) -> None:
    response = alice.get(
        "/oauth/authorize/",
        authorize_query(application, "x" * 43, redirect_uri="https://attacker.example/callback"),
        **HOST,
    )
    assert response.status_code == 400
    assert "Location" not in response
    assert 'id="oauth-error"' in response.content.decode()


def test_a_resource_of_another_server_is_invalid_target_before_consent(alice: Client, application: Any) -> None:
    response = consent_page(alice, application, resource="https://elsewhere.example/mcp")
    assert response.status_code == 400
    assert "Location" not in response
    assert '<code id="oauth-error-code">invalid_target</code>' in response.content.decode()
    assert "consent-allow" not in response.content.decode()


def test_approval_prompt_auto_does_not_skip_the_page(alice: Client, application: Any) -> None:
    signed_in(alice, application, ["mcp"])
    response = consent_page(alice, application, approval_prompt="auto")
    assert response.status_code == 200
    assert 'id="consent-allow"' in response.content.decode()


# --- connected applications on /settings/ ----------------------------------------------------


def test_settings_lists_a_connected_application_with_its_scopes_and_last_use(alice: Client, application: Any) -> None:
    signed_in(alice, application, ["mcp:remotes", "mcp:machines:read"])
    page = alice.get("/settings/")
    assert page.status_code == 200
    text = text_of(page)
    assert 'id="oauth-app-list"' in text
    row = text[text.index(f'data-application-id="{application.pk}"') :]
    row = row[: row.index("</tr>")]
    assert "Claude Code" in row and "unverified" in row and "registered itself (DCR)" in row
    assert '<code class="oauth-scope">mcp:remotes</code> <code class="oauth-scope">mcp:machines:read</code>' in row
    used = AccessToken.objects.get().updated
    assert used.strftime("%Y-%m-%d %H:%M") in row


def test_settings_without_connections_says_so(alice: Client) -> None:
    assert 'id="no-oauth-apps"' in alice.get("/settings/").content.decode()


def test_revoke_deletes_the_tokens_and_ends_the_open_streams(alice: Client, owner: Any, application: Any) -> None:
    signed_in(alice, application, ["mcp"])
    signed_in(alice, application, ["mcp:remotes"])
    token = AccessToken.objects.filter(user=owner).first()
    process = ServerProcess.objects.create(id="consent-test", kind="test", hostname="here", pid=1)
    stream = McpStream.objects.create(user=owner, server_process=process, oauth_token=token)
    Grant.objects.create(
        application=application, user=owner, code="pending", redirect_uri=REDIRECT_URI, expires=token.expires
    )
    # A token with no refresh token (an admin-made one, say) goes too.
    AccessToken.objects.create(user=owner, application=application, token="bare", expires=_later(), scope="mcp")

    response = alice.post(f"/settings/oauth/{application.pk}/revoke/", **HOST)
    assert response.status_code == 302 and response["Location"] == "/settings/"
    assert not AccessToken.objects.filter(user=owner).exists()
    assert RefreshToken.objects.filter(user=owner).count() == 2
    assert not RefreshToken.objects.filter(user=owner, revoked__isnull=True).exists()
    assert not Grant.objects.filter(user=owner).exists()
    assert not McpStream.objects.filter(pk=stream.pk).exists()
    later = alice.get("/settings/")
    assert "Disconnected Claude Code" in text_of(later)
    assert 'id="no-oauth-apps"' in later.content.decode()


@pytest.mark.django_db(transaction=True)
def test_a_tokens_caller_names_its_application_in_the_machine_audit(alice: Client, application: Any) -> None:
    token = signed_in(alice, application, ["mcp:machines:read"])["access_token"]
    caller = async_to_sync(authenticate_oauth)(Headers({"authorization": f"Bearer {token}"}))
    assert caller.oauth_application_id == application.pk and caller.scopes == frozenset(["mcp:machines:read"])
    assert caller.audit_caller == f"mcp oauth {application.pk}: Claude Code"
    assert Caller(user=caller.user).audit_caller == "mcp"  # a header token


def test_the_settings_page_shows_where_each_client_returns_even_a_uri_stored_before_ports_were_checked(
    alice: Client, owner: Any
) -> None:
    application = Application.objects.create(
        name="Odd",
        client_type=Application.CLIENT_PUBLIC,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=(
            "http://127.0.0.1:70000/cb https://app.example:8443/cb http://[::1]:5000/cb "
            "https://[2001:db8::1]:8443/cb cursor://anysphere.cursor-mcp/oauth/callback"
        ),
        registration_source=Application.RegistrationSource.DCR,
        client_secret="",
    )
    AccessToken.objects.create(user=owner, application=application, token="odd", expires=_later(), scope="mcp")
    response = alice.get("/settings/")
    assert response.status_code == 200
    page = text_of(response)
    assert "returns to app.example:8443, [::1], [2001:db8::1]:8443, anysphere.cursor-mcp" in page


def test_revoke_is_a_post_with_a_csrf_token(owner: Any, application: Any) -> None:
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(owner)
    AccessToken.objects.create(user=owner, application=application, token="t1", expires=_later(), scope="mcp")
    assert browser.get(f"/settings/oauth/{application.pk}/revoke/", **HOST).status_code == 405
    assert browser.post(f"/settings/oauth/{application.pk}/revoke/", **HOST).status_code == 403
    assert AccessToken.objects.filter(user=owner).exists()


def test_a_user_sees_and_revokes_only_their_own_applications(
    alice: Client, bob: Client, owner: Any, member: Any, application: Any
) -> None:
    signed_in(alice, application, ["mcp"])
    page = bob.get("/settings/").content.decode()
    assert f'data-application-id="{application.pk}"' not in page
    assert 'id="oauth-all-app-list"' not in page and 'id="oauth-policy-form"' not in page
    # bob's own revoke route touches bob's tokens only; the other-user route is admin-only.
    bob.post(f"/settings/oauth/{application.pk}/revoke/", **HOST)
    assert AccessToken.objects.filter(user=owner).exists()
    response = bob.post(f"/settings/oauth/users/{owner.pk}/{application.pk}/revoke/", **HOST)
    assert response.status_code == 403
    assert AccessToken.objects.filter(user=owner).exists()


def test_an_admin_sees_every_users_connections_and_revokes_one(
    alice: Client, bob: Client, owner: Any, member: Any, application: Any
) -> None:
    signed_in(bob, application, ["mcp:agents"])
    page = text_of(alice.get("/settings/"))
    assert 'id="oauth-all-app-list"' in page
    row = page[page.index(f'data-user-id="{member.pk}"') :]
    row = row[: row.index("</tr>")]
    assert "bob" in row and "Claude Code" in row and "mcp:agents" in row
    assert application.client_id[:20] in row and "returns to 127.0.0.1" in row
    # The admin's own connection is in their own table only, not again among the others'.
    signed_in(alice, application, ["mcp"])
    page = text_of(alice.get("/settings/"))
    others = page[page.index('id="oauth-all-app-list"') :]
    assert f'data-user-id="{owner.pk}"' not in others
    assert page.count(f'data-application-id="{application.pk}"') == 2  # alice's row, and bob's
    response = alice.post(f"/settings/oauth/users/{member.pk}/{application.pk}/revoke/", **HOST)
    assert response.status_code == 302
    assert not AccessToken.objects.filter(user=member).exists()


# --- the admin's switches ---------------------------------------------------------------------


def test_a_non_admin_cannot_change_the_policy(bob: Client) -> None:
    response = bob.post("/settings/oauth/policy/", {"cimd_enabled": "on"}, **HOST)
    assert response.status_code == 403
    assert OAuthPolicy.current().dcr_enabled is True


def test_an_admin_turns_registration_off(alice: Client, owner: Any) -> None:
    assert "registration_endpoint" in Client().get("/.well-known/oauth-authorization-server/oauth", **HOST).json()
    page = text_of(alice.get("/settings/"))
    assert 'id="oauth-policy-form"' in page and 'name="dcr_enabled" id="policy-dcr" checked' in page

    response = alice.post("/settings/oauth/policy/", {"cimd_enabled": "on"}, **HOST)
    assert response.status_code == 302
    policy = OAuthPolicy.current()
    assert (policy.dcr_enabled, policy.cimd_enabled, policy.cimd_private_addresses) == (False, True, False)
    assert policy.updated_by == owner

    metadata = Client().get("/.well-known/oauth-authorization-server/oauth", **HOST).json()
    assert "registration_endpoint" not in metadata
    body = {"client_name": "x", "redirect_uris": [REDIRECT_URI], "token_endpoint_auth_method": "none"}
    refused = Client().post("/oauth/register/", json.dumps(body), content_type="application/json", **HOST)
    assert refused.status_code == 403
    assert 'name="dcr_enabled" id="policy-dcr">' in text_of(alice.get("/settings/"))


def test_the_policy_is_in_the_django_admin() -> None:
    assert OAuthPolicy in admin.site._registry


def _later() -> Any:
    return timezone.now() + timedelta(hours=1)


# --- live: Revoke on the settings page ends an open /mcp/oauth stream ------------------------


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_revoke_on_the_settings_page_ends_an_open_event_stream() -> None:
    with instance() as inst:
        server = inst.serve(public=True)
        flow = Flow(server.url)
        assert flow.register(client_name="Stream client").status_code == 201
        flow.login("admin", inst.admin_password)
        verifier, challenge = pkce_pair()
        page = flow.authorize_page(challenge)
        assert page.status_code == 200, page.text[:500]
        answer = flow.approve(page, scopes=["mcp:remotes"])
        code = parse_qs(urlsplit(answer.headers["location"]).query)["code"][0]
        tokens = flow.exchange(code, verifier).json()
        assert tokens["scope"] == "mcp:remotes"

        stream = EventStream(f"{server.url}/mcp/oauth", tokens["access_token"])
        assert stream.opened.wait(20), "the stream did not open"
        assert not stream.ended

        settings_page = flow.browser.get("/settings/")
        text = html.unescape(settings_page.text)
        assert "Stream client" in text and "mcp:remotes" in text
        action = re.search(r'action="(/settings/oauth/\d+/revoke/)"', settings_page.text)
        assert action, "no Revoke button"
        csrf = form_fields(settings_page.text)["csrfmiddlewaretoken"]
        revoked_at = time.monotonic()
        answer = flow.browser.post(action.group(1), data={"csrfmiddlewaretoken": csrf})
        assert answer.status_code == 302
        stream.reader.join(15)
        assert stream.ended, "the stream is still open 15 s after Revoke"
        assert stream.ended[0] - revoked_at < 10
        assert flow.mcp(tokens["access_token"], {"jsonrpc": "2.0", "id": 1, "method": "ping"}).status_code == 401
