"""API tokens: hashed at rest, expiry, revocation, last use (docs/ws-protocol.md#authentication)."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from core.errors import InvalidRequest, NotFound
from core.models import ApiToken
from core.services import AuthenticationFailed, api_token_authenticate, api_token_create, api_token_revoke

pytestmark = pytest.mark.django_db


def test_a_token_is_stored_only_as_its_digest_and_prefix(owner):
    issued = api_token_create(user=owner, name="laptop")
    raw = issued.raw
    assert len(raw) == 43  # secrets.token_urlsafe(32): 256 bits
    row = ApiToken.objects.filter(pk=issued.token.pk).values().get()
    assert row["digest"] == hashlib.sha256(raw.encode()).hexdigest()
    assert row["prefix"] == raw[:8]
    for column, value in row.items():
        assert raw not in str(value), f"the raw token is stored in {column}"
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM dispatch_apitoken")
        assert all(raw not in str(value) for record in cursor.fetchall() for value in record)


def test_tokens_are_random(owner):
    raws = {api_token_create(user=owner).raw for _ in range(20)}
    assert len(raws) == 20
    assert len({raw[:8] for raw in raws}) == 20


def test_a_token_authenticates_its_user(owner, member):
    raw = api_token_create(user=owner).raw
    api_token_create(user=member)
    assert api_token_authenticate(raw).user == owner


@pytest.mark.parametrize("raw", ["", "x", "a" * 43, "a" * 201])
def test_it_refuses_an_unknown_token(owner, raw):
    api_token_create(user=owner)
    with pytest.raises(AuthenticationFailed) as raised:
        api_token_authenticate(raw)
    assert raised.value.message == "authentication failed"


def test_it_refuses_a_token_that_differs_in_one_character(owner):
    raw = api_token_create(user=owner).raw
    altered = raw[:-1] + ("A" if raw[-1] != "A" else "B")
    with pytest.raises(AuthenticationFailed):
        api_token_authenticate(altered)


def test_last_used_at_is_written_at_most_once_a_minute(owner):
    raw = api_token_create(user=owner).raw
    assert ApiToken.objects.get().last_used_at is None
    api_token_authenticate(raw)
    first = ApiToken.objects.get().last_used_at
    assert first is not None and timezone.now() - first < timedelta(seconds=5)

    with CaptureQueriesContext(connection) as queries:
        api_token_authenticate(raw)
    assert not [query for query in queries if query["sql"].lstrip().upper().startswith("UPDATE")]
    assert ApiToken.objects.get().last_used_at == first

    # 30 s ago: still within the minute, left alone.
    half_minute_ago = timezone.now() - timedelta(seconds=30)
    ApiToken.objects.update(last_used_at=half_minute_ago)
    api_token_authenticate(raw)
    assert ApiToken.objects.get().last_used_at == half_minute_ago

    # Over a minute ago: written again.
    long_ago = timezone.now() - timedelta(seconds=61)
    ApiToken.objects.update(last_used_at=long_ago)
    api_token_authenticate(raw)
    assert ApiToken.objects.get().last_used_at > long_ago + timedelta(seconds=60)


def test_an_expired_token_is_refused(owner):
    raw = api_token_create(user=owner, expires_at=timezone.now() + timedelta(minutes=5)).raw
    assert api_token_authenticate(raw).user == owner
    ApiToken.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(AuthenticationFailed):
        api_token_authenticate(raw)


def test_it_refuses_to_create_a_token_already_expired(owner):
    with pytest.raises(InvalidRequest):
        api_token_create(user=owner, expires_at=timezone.now() - timedelta(seconds=1))
    assert ApiToken.objects.count() == 0


def test_it_refuses_a_name_over_100_characters(owner):
    with pytest.raises(InvalidRequest):
        api_token_create(user=owner, name="n" * 101)
    assert api_token_create(user=owner, name="n" * 100).token.name == "n" * 100


def test_a_revoked_token_is_refused_and_revoking_again_changes_nothing(owner):
    issued = api_token_create(user=owner)
    revoked = api_token_revoke(user=owner, token_id=issued.token.pk)
    assert revoked.revoked_at is not None
    with pytest.raises(AuthenticationFailed):
        api_token_authenticate(issued.raw)
    again = api_token_revoke(user=owner, token_id=issued.token.pk)
    assert again.revoked_at == revoked.revoked_at


def test_another_users_token_cannot_be_revoked(owner, member):
    issued = api_token_create(user=owner)
    with pytest.raises(NotFound):
        api_token_revoke(user=member, token_id=issued.token.pk)
    assert ApiToken.objects.get(pk=issued.token.pk).revoked_at is None
    assert api_token_authenticate(issued.raw).user == owner


def test_it_refuses_a_token_of_an_inactive_user(owner):
    raw = api_token_create(user=owner).raw
    owner.is_active = False
    owner.save()
    with pytest.raises(AuthenticationFailed):
        api_token_authenticate(raw)
