"""``manage.py issue_token USERNAME [--name N]``: print a new API token on the last line."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from core.errors import DispatchError
from core.services import api_token_create


class Command(BaseCommand):
    help = "Create an API token for USERNAME and print it (alone, on the last line). It is shown only once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="", help="a label shown on the Settings page")

    def handle(self, *args: Any, username: str, name: str, **options: Any) -> None:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}")
        if not user.is_active:
            raise CommandError(f"user {username!r} is inactive")
        try:
            issued = api_token_create(user=user, name=name)
        except DispatchError as exc:
            raise CommandError(exc.message) from None
        self.stderr.write(f"Token {issued.token.prefix}… for {username} (shown once):")
        self.stdout.write(issued.raw)
