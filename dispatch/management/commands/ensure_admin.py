"""``manage.py ensure_admin``: create user ``admin`` with a one-time password if no superuser exists."""

from __future__ import annotations

import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Create the first admin (user 'admin', random password printed once) when there is no superuser."

    def handle(self, *args: Any, **options: Any) -> None:
        users = get_user_model().objects
        if users.filter(is_superuser=True).exists():
            return
        if users.filter(username="admin").exists():
            raise CommandError("a non-superuser named 'admin' exists; create a superuser with createsuperuser")
        password = secrets.token_urlsafe(12).lstrip("-") or secrets.token_hex(8)
        users.create_superuser(username="admin", email="", password=password)
        self.stdout.write("Created the first admin. Log in with:")
        self.stdout.write("  username: admin")
        self.stdout.write(f"  password: {password}")
        self.stdout.write("This password is shown only once; change it on /admin/password_change/.")
