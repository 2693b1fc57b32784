"""Bad input to the OAuth endpoints and pages gets a clear 4xx and changes nothing
(docs/mcp.md#oauth-clients, docs/mcp.md#oauth-connected-applications): what a breaker sent
that used to get a 500, a misleading page, or another user's application name."""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib import messages
from django.test import Client
from django.utils import timezone
from oauth2_provider import cimd
from oauth2_provider.models import (
    get_access_token_model,
    get_application_model,
    get_refresh_token_model,
    set_token_value,
)

from oauth import registration
from oauth.models import OAuthPolicy
from oauth.validators import DispatchOAuth2Validator
from tests.oauth.test_consent_pages import HOST, REDIRECT_URI, consent_page, text_of

pytestmark = pytest.mark.django_db

Application = get_application_model()
AccessToken = get_access_token_model()
RefreshToken = get_refresh_token_model()


@pytest.fixture
def application(member: Any) -> Any:
    """An application only ``member`` (bob) is connected to, with a name of its own."""
    made = Application.objects.create(
        name="Bob-Private-Tool",
        client_type=Application.CLIENT_PUBLIC,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=REDIRECT_URI,
        registration_source=Application.RegistrationSource.DCR,
        client_secret="",
    )
    AccessToken.objects.create(
        user=member, application=made, token="bobs", expires=timezone.now() + timedelta(hours=1), scope="mcp"
    )
    return made


def said(response: Any) -> list[str]:
    return [str(message) for message in messages.get_messages(response.wsgi_request)]


def register(body: bytes | dict[str, Any]) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    address = f"10.7.{secrets.randbelow(250)}.{secrets.randbelow(250) + 1}"
    return Client(REMOTE_ADDR=address).post("/oauth/register/", raw, content_type="application/json", **HOST)


def test_revoking_an_application_one_is_not_connected_to_names_nothing(
    client: Client, outsider: Any, application: Any
) -> None:
    client.force_login(outsider)
    response = client.post(f"/settings/oauth/{application.pk}/revoke/", **HOST)
    assert response.status_code == 302
    assert said(response) == ["No such application."]
    assert AccessToken.objects.filter(application=application).exists()


@pytest.mark.parametrize("application_id", ["99999999999999999999", "9223372036854775808"])
def test_an_id_past_what_a_database_holds_is_no_such_application(
    client: Client, outsider: Any, application_id: str
) -> None:
    client.force_login(outsider)
    for path in (f"/settings/oauth/{application_id}/revoke/", f"/settings/oauth/users/{application_id}/1/revoke/"):
        response = client.post(path, **HOST)
        assert response.status_code in (302, 403), (path, response.status_code)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"redirect_uris": ["https://a.example/\\ud800"]}', "Unicode"),
        ({"redirect_uris": ["https://a.example/cb"], "client_name": "\udc00"}, "Unicode"),
        ({"redirect_uris": ["https://a.example/cb"], "response_types": "token"}, "response_types must be a list"),
        ({"redirect_uris": ["https://a.example/cb"], "client_name": ["<b>x</b>", 1]}, "client_name must be a string"),
    ],
)
def test_a_registration_body_dispatch_cannot_store_or_show_is_refused(body: Any, says: str) -> None:
    if isinstance(body, dict):
        body = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as \\udc00
    before = Application.objects.count()
    answer = register(body)
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"] == "invalid_client_metadata" and says in answer.json()["error_description"]
    assert Application.objects.count() == before


@pytest.mark.parametrize(
    "uri",
    [
        "https://a.example\\@trusted.example/cb",  # browsers go to a.example, Python reads trusted.example
        "https://user@a.example/cb",
        "https://a.example/c b",
        "https://a.example/\tcb",
    ],
)
def test_a_redirect_uri_read_differently_by_browsers_is_refused(uri: str) -> None:
    answer = register({"redirect_uris": [uri]})
    assert answer.status_code == 400 and answer.json()["error"] == "invalid_redirect_uri", answer.content


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"code_challenge_method": "plain"}, "S256"),
        ({"code_challenge_method": None}, "S256"),
        ({"code_challenge": "abc"}, "43 base64url"),
    ],
)
def test_a_pkce_challenge_that_can_never_be_redeemed_goes_back_to_the_client_before_the_consent_page(
    client: Client, owner: Any, application: Any, extra: dict[str, Any], says: str
) -> None:
    client.force_login(owner)
    page = consent_page(client, application, **extra)
    assert page.status_code == 302, text_of(page)[:300]
    location = page["Location"]
    assert location.startswith(REDIRECT_URI)
    query = parse_qs(urlsplit(location).query)
    assert query["error"] == ["invalid_request"] and says in query["error_description"][0]
    assert query["state"] == ["st"] and "code" not in query and query["iss"]


def test_the_discovery_documents_answer_other_methods_405() -> None:
    for path in ("/.well-known/oauth-authorization-server/oauth", "/.well-known/oauth-protected-resource/mcp/oauth"):
        for method in ("post", "put", "delete"):
            assert getattr(Client(enforce_csrf_checks=True), method)(path, **HOST).status_code == 405, (path, method)


def test_a_malformed_metadata_document_url_is_an_unknown_client_without_an_error_in_the_log(
    client: Client, owner: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client.force_login(owner)
    query = {
        "response_type": "code",
        "client_id": "https://[::1/x",
        "redirect_uri": REDIRECT_URI,
        "code_challenge": "x" * 43,
        "code_challenge_method": "S256",
    }
    with caplog.at_level(logging.INFO):
        page = client.get("/oauth/authorize/", query, **HOST)
    assert page.status_code == 400
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


def test_a_refresh_whose_sign_in_is_revoked_while_it_runs_gets_a_json_invalid_grant_and_nothing(
    owner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disconnect landing between the refresh's validation and its save: refused under the
    lock, in the token endpoint's JSON (RFC 6749 §5.2), and no token is left alive."""
    made = Application.objects.create(
        name="racer",
        client_type=Application.CLIENT_PUBLIC,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=REDIRECT_URI,
        client_secret="",
    )
    access = AccessToken(
        user=owner, application=made, expires=timezone.now() + timedelta(hours=1), scope="mcp", resource=[]
    )
    set_token_value(access, "access-raw")
    access.save()
    refresh = RefreshToken(user=owner, application=made, access_token=access, token_family=uuid.uuid4())
    set_token_value(refresh, "refresh-raw")
    refresh.save()
    # Rotated once already (within the grace window), so this request is a second use.
    first = Client().post(
        "/oauth/token/",
        {"grant_type": "refresh_token", "refresh_token": "refresh-raw", "client_id": made.client_id},
        **HOST,
    )
    assert first.status_code == 200, first.content
    validate = DispatchOAuth2Validator.validate_refresh_token

    def disconnected_meanwhile(self: Any, *args: Any, **kwargs: Any) -> bool:
        valid = bool(validate(self, *args, **kwargs))
        RefreshToken.revoke_family(refresh.token_family)
        return valid

    monkeypatch.setattr(DispatchOAuth2Validator, "validate_refresh_token", disconnected_meanwhile)
    answer = Client().post(
        "/oauth/token/",
        {"grant_type": "refresh_token", "refresh_token": "refresh-raw", "client_id": made.client_id},
        **HOST,
    )
    assert answer.status_code == 400 and answer.json()["error"] == "invalid_grant"
    assert answer["Content-Type"] == "application/json" and answer["Cache-Control"] == "no-store"
    assert not AccessToken.objects.filter(application=made).exists()
    assert not RefreshToken.objects.filter(application=made, revoked__isnull=True).exists()


def test_optional_registration_fields_sent_as_null_are_taken_as_absent() -> None:
    body = {"redirect_uris": ["https://a.example/cb"], "client_uri": None, "logo_uri": None, "contacts": None}
    answer = register(body)
    assert answer.status_code == 201, answer.content


@pytest.mark.parametrize("name", ["nul\x00name", "\udc00"])
def test_a_metadata_document_holding_what_no_database_stores_is_refused(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "https://client.example/metadata.json"
    document = {"client_id": url, "client_name": name, "redirect_uris": ["https://client.example/cb"]}
    monkeypatch.setattr(registration, "_resolve_any", lambda host, port: ["192.0.2.1"])
    monkeypatch.setattr(registration.MetadataDocumentFetcher, "_fetch_from", lambda self, *args: (document, 300))
    policy = OAuthPolicy.current()
    policy.cimd_private_addresses = True
    policy.save()
    with pytest.raises(cimd.CIMDError, match="NUL character or a lone surrogate"):
        registration.MetadataDocumentFetcher().fetch(url)
