"""Options shared by ``peer_offer`` and ``peer_link`` (docs/peers.md#headless)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import CommandError, CommandParser


def add_capability_flags(parser: CommandParser) -> None:
    """``--no-launch --no-message --full-access --no-events --as-user USERNAME``."""
    parser.add_argument("--no-launch", action="store_true", help="the other instance may not launch agents here")
    parser.add_argument("--no-message", action="store_true", help="the other instance may not message agents here")
    parser.add_argument("--full-access", action="store_true", help="allow launches with full access (off by default)")
    parser.add_argument("--no-events", action="store_true", help="do not share the latest event of agents")
    parser.add_argument("--as-user", default=None, help="the user the link acts as here (default: the first superuser)")


def capabilities_from(options: dict[str, Any]) -> dict[str, bool]:
    """The four ``allow_*`` flags (docs/peers.md#permissions) from the parsed options."""
    return {
        "allow_launch": not options["no_launch"],
        "allow_message": not options["no_message"],
        "allow_full_access": bool(options["full_access"]),
        "allow_events": not options["no_events"],
    }


def console_users(as_user: str | None) -> tuple[User, User]:
    """``(actor, link_user)``: the console acts as the first superuser; the link as
    ``--as-user`` (default that superuser). ``CommandError`` when either is missing."""
    actor = User.objects.filter(is_superuser=True, is_active=True).order_by("pk").first()
    if actor is None:
        raise CommandError("no active superuser: create one first (manage.py ensure_admin)")
    if not as_user:
        return actor, actor
    link_user = User.objects.filter(username=as_user).first()
    if link_user is None:
        raise CommandError(f"no user named {as_user!r}")
    if not link_user.is_active:
        raise CommandError(f"user {as_user!r} is inactive")
    return actor, link_user
