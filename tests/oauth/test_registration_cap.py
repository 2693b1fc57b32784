"""The cap on registered clients holds when registrations arrive together
(docs/mcp.md#oauth-clients): the count before the insert is only a first look, and the
registrations that pass it together are ordered by the policy row's lock after their insert,
where the last ones over the cap undo their own row."""

from __future__ import annotations

import json
import secrets
import threading

import pytest
from django.db import connection
from django.test import Client
from oauth2_provider.models import get_application_model

from oauth import registration

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

BODY = json.dumps({"redirect_uris": ["http://127.0.0.1/callback"], "client_name": "racer"})


def register() -> int:
    """One registration from an address of its own (the per-address rate is not what is tested)."""
    address = f"10.{secrets.randbelow(250)}.{secrets.randbelow(250)}.{secrets.randbelow(250) + 1}"
    answer = Client(REMOTE_ADDR=address).post("/oauth/register/", BODY, content_type="application/json")
    return answer.status_code


def registered() -> int:
    Application = get_application_model()
    return Application.objects.filter(registration_source=Application.RegistrationSource.DCR).count()


def test_a_registration_that_passed_the_first_count_is_undone_once_the_cap_is_full(
    settings: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.OAUTH_DCR_MAX_CLIENTS = 2  # type: ignore[attr-defined]
    assert [register(), register()] == [201, 201]
    # What a registration racing the second one saw: room left.
    monkeypatch.setattr(registration, "registered_clients_at_cap", lambda: False)

    assert register() == 503
    assert registered() == 2
    monkeypatch.undo()
    assert register() == 503
    assert registered() == 2


def test_registrations_arriving_together_never_pass_the_cap(settings: object) -> None:
    racers = 6
    settings.OAUTH_DCR_MAX_CLIENTS = 2  # type: ignore[attr-defined]
    assert register() == 201
    barrier = threading.Barrier(racers)
    statuses: list[int] = []
    errors: list[BaseException] = []

    def racer() -> None:
        try:
            barrier.wait()
            statuses.append(register())
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=racer) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert not errors, errors
    assert sorted(statuses) == [201] + [503] * (racers - 1)
    assert registered() == 2
