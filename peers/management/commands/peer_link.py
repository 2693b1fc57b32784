"""``manage.py peer_link URL CODE [--label L] [--no-launch] [--no-message] [--full-access] [--no-events]
[--as-user USERNAME]``.

Links this instance to the one at URL with its pairing code (docs/peers.md#headless)
and prints both fingerprints. Any refusal exits 1 with its message.
"""

from __future__ import annotations

from typing import Any

import httpx
from asgiref.sync import async_to_sync
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from core.errors import DispatchError
from peers.management.commands._pairing_options import add_capability_flags, capabilities_from, console_users
from peers.pairing_exchange import peer_link


class Command(BaseCommand):
    help = "Link this instance to another Dispatch instance with the pairing code it shows."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("url", help="the other instance's address, e.g. https://dispatch.example.org")
        parser.add_argument("code", help="the pairing code it shows (XXXX-XXXX)")
        parser.add_argument("--label", default=None, help="what this instance calls it (default: its name)")
        add_capability_flags(parser)

    def handle(self, *args: Any, url: str, code: str, label: str | None, **options: Any) -> None:
        actor, link_user = console_users(options["as_user"])
        try:
            result = async_to_sync(peer_link)(
                user=actor, url=url, code=code, label=label, as_user=link_user, **capabilities_from(options)
            )
        except DispatchError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"linked: {result.peer.label} ({result.peer.instance_id}) as {link_user.get_username()}")
        self.stdout.write(f"our fingerprint: {result.our_fingerprint}")
        self.stdout.write(f"their fingerprint: {result.their_fingerprint}")
        self._check_public_url()

    def _check_public_url(self) -> None:
        """Warn when nothing answers on this instance's ``DISPATCH_PUBLIC_URL``: the peer was
        just told to call us back there (its mirror and messages would fail quietly)."""
        try:
            answered = httpx.get(f"{settings.PUBLIC_URL}/healthz", timeout=3.0).status_code == 200
        except httpx.HTTPError:
            answered = False
        if not answered:
            self.stderr.write(
                f"warning: nothing answers on this instance's DISPATCH_PUBLIC_URL ({settings.PUBLIC_URL}); the "
                "other instance will call it to mirror agents and deliver messages. Run this command with the "
                "same DISPATCH_PUBLIC_URL as the server, or start the server there."
            )
