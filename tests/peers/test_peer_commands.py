"""``manage.py peer_offer`` and ``peer_link`` (docs/peers.md#headless)."""

from __future__ import annotations

import re
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from peers.models import PairingOffer
from peers.services.identity import identity_get

CODE = re.compile(r"^code: ([BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4})$", re.MULTILINE)


@pytest.fixture
def admin_user(db: None) -> Any:
    return get_user_model().objects.create_superuser("root", password="x")


def offer(*args: str) -> str:
    out = StringIO()
    call_command("peer_offer", *args, stdout=out)
    return out.getvalue()


def test_peer_offer_prints_the_code_the_address_and_the_fingerprint(admin_user: Any) -> None:
    printed = offer()
    identity = identity_get()
    assert CODE.search(printed)
    assert f"address: {identity.url}\n" in printed
    assert f"fingerprint: {identity.fingerprint}\n" in printed
    made = PairingOffer.objects.get()
    assert made.link_user == admin_user and made.created_by == admin_user  # --as-user defaults to the first superuser


def test_peer_offer_flags_set_the_offers_capabilities_and_the_link_user(admin_user: Any, member: Any) -> None:
    offer("--no-launch", "--no-message", "--full-access", "--no-events", "--as-user", "bob")
    made = PairingOffer.objects.get()
    assert (made.allow_launch, made.allow_message, made.allow_full_access, made.allow_events) == (
        False,
        False,
        True,
        False,
    )
    assert made.link_user == member and made.created_by == admin_user


def test_a_sixth_live_offer_exits_with_the_message(admin_user: Any) -> None:
    for _ in range(5):
        offer()
    with pytest.raises(CommandError, match="at most 5 pairing codes can be live at once"):
        offer()
    assert PairingOffer.objects.count() == 5


def test_an_unknown_as_user_is_refused(admin_user: Any) -> None:
    with pytest.raises(CommandError, match="no user named 'nobody'"):
        offer("--as-user", "nobody")


def test_without_a_superuser_the_commands_say_how_to_make_one(db: None) -> None:
    with pytest.raises(CommandError, match="ensure_admin"):
        offer()


def test_peer_link_refuses_a_malformed_code_before_calling_anyone(admin_user: Any) -> None:
    with pytest.raises(CommandError, match="8 letters"):
        call_command("peer_link", "http://127.0.0.1:9", "AEIO-U123", stdout=StringIO())


@pytest.mark.django_db(transaction=True)  # peer_link's queries run on another thread
def test_peer_link_names_an_unreachable_address(admin_user: Any) -> None:
    with pytest.raises(CommandError, match=r"could not reach http://127\.0\.0\.1:9"):
        call_command("peer_link", "http://127.0.0.1:9", "BBBB-BBBB", stdout=StringIO())


def test_peer_link_warns_when_nothing_answers_on_this_instances_public_url(settings: Any) -> None:
    from peers.management.commands.peer_link import Command

    settings.PUBLIC_URL = "http://127.0.0.1:9"  # nothing listens on the discard port
    err = StringIO()
    command = Command(stdout=StringIO(), stderr=err)
    command._check_public_url()
    assert "nothing answers on this instance's DISPATCH_PUBLIC_URL (http://127.0.0.1:9)" in err.getvalue()
