"""The metadata-document fetcher's deadline over several addresses, and the cap on
registered clients for a client first seen by its metadata document
(docs/mcp.md#oauth-clients)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from oauth2_provider import cimd
from oauth2_provider.models import get_application_model
from oauth2_provider.settings import oauth2_settings

from oauth import registration
from oauth.models import OAuthPolicy
from oauth.validators import DispatchOAuth2Validator

pytestmark = pytest.mark.django_db


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never says anything (not even TLS's hello)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(listener.getsockname()[1])
    stop.set()
    thread.join(2)
    for connection in held:
        connection.close()
    listener.close()


def test_a_host_whose_first_address_takes_the_whole_deadline_is_refused_in_time(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = OAuthPolicy.current()
    policy.cimd_private_addresses = True
    policy.save()
    monkeypatch.setattr(oauth2_settings, "CIMD_FETCH_TIMEOUT_SECONDS", 0.5)
    monkeypatch.setattr(registration, "_resolve_any", lambda host, port: ["127.0.0.1", "127.0.0.1"])
    start = time.monotonic()
    with pytest.raises(cimd.CIMDError, match="could not fetch client_id document"):
        registration.MetadataDocumentFetcher().fetch(f"https://silent.example:{silent_port}/client.json")
    assert time.monotonic() - start < 2


def test_a_metadata_client_stored_past_the_cap_is_deleted_and_unknown(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look before the fetch found room; other registrations filled the cap meanwhile."""
    Application = get_application_model()
    settings.OAUTH_DCR_MAX_CLIENTS = 1
    Application.objects.create(
        name="earlier",
        client_type=Application.CLIENT_PUBLIC,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris="http://127.0.0.1/cb",
        registration_source=Application.RegistrationSource.DCR,
    )
    url = "https://client.example/metadata.json"

    def stored_on_first_sight(client_id: str, request: Any) -> Any:
        return Application.objects.create(
            client_id=client_id,
            name="newcomer",
            client_type=Application.CLIENT_PUBLIC,
            authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
            redirect_uris="http://127.0.0.1/cb",
            registration_source=Application.RegistrationSource.CIMD,
        )

    monkeypatch.setattr(cimd, "resolve_cimd_application", stored_on_first_sight)
    request = type("Request", (), {"client": None})()

    assert DispatchOAuth2Validator()._load_application(url, request) is None
    assert request.client is None
    assert not Application.objects.filter(client_id=url).exists()
    settings.OAUTH_DCR_MAX_CLIENTS = 2
    assert DispatchOAuth2Validator()._load_application(url, request).client_id == url
