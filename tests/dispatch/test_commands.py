"""Management commands: issue_token, ensure_admin, and a clean ``check``."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth import authenticate, get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from core.models import ApiToken
from core.services import api_token_authenticate

pytestmark = pytest.mark.django_db


def run(*args: str) -> tuple[str, str]:
    stdout, stderr = StringIO(), StringIO()
    call_command(*args, stdout=stdout, stderr=stderr)
    return stdout.getvalue(), stderr.getvalue()


def test_issue_token_prints_a_working_token_alone_on_the_last_line(owner):
    stdout, stderr = run("issue_token", "alice", "--name", "ci")
    last_line = stdout.rstrip("\n").splitlines()[-1]
    assert last_line == last_line.strip() and " " not in last_line
    token = api_token_authenticate(last_line)
    assert token.user == owner
    assert token.name == "ci"
    # The secret appears once, on stdout; stderr only shows the prefix.
    assert last_line not in stderr
    assert token.prefix in stderr


def test_issue_token_refuses_an_unknown_user(owner):
    with pytest.raises(CommandError, match="nobody"):
        run("issue_token", "nobody")
    assert ApiToken.objects.count() == 0


def test_issue_token_refuses_an_inactive_user(owner):
    owner.is_active = False
    owner.save()
    with pytest.raises(CommandError):
        run("issue_token", "alice")
    assert ApiToken.objects.count() == 0


def test_ensure_admin_creates_the_admin_once_and_prints_the_password():
    stdout, _ = run("ensure_admin")
    password = next(
        line.split(":", 1)[1].strip() for line in stdout.splitlines() if line.strip().startswith("password:")
    )
    admin = authenticate(username="admin", password=password)
    assert admin is not None and admin.is_superuser and admin.is_staff

    again, _ = run("ensure_admin")
    assert again == ""
    assert get_user_model().objects.filter(username="admin").count() == 1
    assert authenticate(username="admin", password=password) is not None


def test_ensure_admin_does_nothing_when_a_superuser_exists():
    get_user_model().objects.create_superuser(username="root", password="correct horse battery")
    stdout, _ = run("ensure_admin")
    assert stdout == ""
    assert not get_user_model().objects.filter(username="admin").exists()


def test_check_is_clean():
    stdout, _ = run("check")
    assert "no issues" in stdout
