"""``manage.py peer_offer [--no-launch] [--no-message] [--full-access] [--no-events] [--as-user USERNAME]``.

Makes a pairing offer (docs/peers.md#headless) and prints the code, this
instance's address and fingerprint. A sixth live offer exits 1 with the message.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from core.errors import DispatchError
from peers.management.commands._pairing_options import add_capability_flags, capabilities_from, console_users
from peers.services.pairing import offer_create


class Command(BaseCommand):
    help = "Show a pairing code another Dispatch instance can link with (valid 10 minutes, usable once)."

    def add_arguments(self, parser: CommandParser) -> None:
        add_capability_flags(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        actor, link_user = console_users(options["as_user"])
        try:
            issued = offer_create(user=actor, link_user=link_user, **capabilities_from(options))
        except DispatchError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"code: {issued.code}")
        self.stdout.write(f"address: {issued.address}")
        self.stdout.write(f"fingerprint: {issued.fingerprint}")
        self.stdout.write(f"expires: {issued.expires_at.isoformat()} (acts as {link_user.get_username()})")
