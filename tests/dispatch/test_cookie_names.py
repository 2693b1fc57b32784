"""Each instance's cookies carry its own names: browsers keep cookies per host, not per
port, so two instances on one host sharing ``sessionid`` and ``csrftoken`` logged each other
out in one browser.

The names are ``<prefix>sessionid`` and ``<prefix>csrftoken``; the prefix defaults to
``dispatch_<hash>_`` with the same short hash of the database that defaults
``DISPATCH_REDIS_PREFIX``, and ``DISPATCH_COOKIE_PREFIX`` sets it. Settings are loaded in a
child process per environment (they are read once, at start). Two real instances in one
Chromium context: tests/browser/test_two_instances_browser.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import SESSION_KEY
from django.test import Client

from core.services import api_token_create
from tests.conftest import PASSWORD
from tests.infra import REPO, base_env

PRINT_NAMES = (
    "import json; from dispatch import settings as s; "
    "print(json.dumps([s.SESSION_COOKIE_NAME, s.CSRF_COOKIE_NAME, s.REDIS_PREFIX]))"
)


def names_at_start(tmp_path: Path, **env: str) -> tuple[str, str, str]:
    """``(SESSION_COOKIE_NAME, CSRF_COOKIE_NAME, REDIS_PREFIX)`` of a process started with ``env``."""
    data_dir = tmp_path / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-c", PRINT_NAMES],
        env=base_env(DISPATCH_DATA_DIR=str(data_dir), SECRET_KEY="k" * 50, **env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    session, csrf, redis = json.loads(done.stdout.strip().splitlines()[-1])
    return session, csrf, redis


def test_two_databases_give_two_sets_of_names_from_the_hash_of_the_redis_prefix(tmp_path: Path) -> None:
    first = names_at_start(tmp_path / "a")
    second = names_at_start(tmp_path / "b")

    for session, csrf, redis in (first, second):
        digest = redis.removeprefix("dispatch-")
        assert re.fullmatch(r"[0-9a-f]{10}", digest), redis
        assert (session, csrf) == (f"dispatch_{digest}_sessionid", f"dispatch_{digest}_csrftoken")
    assert first[0] != second[0] and first[1] != second[1]


def test_the_processes_of_one_instance_agree_on_the_names(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    assert names_at_start(tmp_path / "a", DATABASE_URL=database) == names_at_start(
        tmp_path / "b", DATABASE_URL=database
    )


def test_dispatch_cookie_prefix_sets_the_prefix(tmp_path: Path) -> None:
    session, csrf, _redis = names_at_start(tmp_path, DISPATCH_COOKIE_PREFIX="lab2_")
    assert (session, csrf) == ("lab2_sessionid", "lab2_csrftoken")


def refused_at_start(tmp_path: Path, **env: str) -> str:
    """The stderr of a process whose settings ``env`` refuses (it must not start)."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", PRINT_NAMES],
        env=base_env(DISPATCH_DATA_DIR=str(data_dir), SECRET_KEY="k" * 50, **env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    return done.stderr


@pytest.mark.parametrize("prefix", ["two words", "semi;colon", "é_", "x" * 65])
def test_a_prefix_that_cannot_be_a_cookie_name_stops_the_process(tmp_path: Path, prefix: str) -> None:
    stderr = refused_at_start(tmp_path, DISPATCH_COOKIE_PREFIX=prefix)
    assert "ImproperlyConfigured: DISPATCH_COOKIE_PREFIX must be" in stderr


@pytest.mark.parametrize("prefix", ["a*", "lab[1]", "what?", "two words", "x" * 101])
def test_a_redis_prefix_with_glob_characters_stops_the_process(tmp_path: Path, prefix: str) -> None:
    # A reset of this instance's rate-limit counts deletes "<prefix>:limits:*": a glob in
    # the prefix would match another instance's keys.
    stderr = refused_at_start(tmp_path, DISPATCH_REDIS_PREFIX=prefix)
    assert "ImproperlyConfigured: DISPATCH_REDIS_PREFIX must be" in stderr


# --- the names in use -------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_login_and_a_csrf_checked_post_use_this_instances_names_only(owner: Any) -> None:
    browser = Client(enforce_csrf_checks=True)
    assert settings.SESSION_COOKIE_NAME != "sessionid" and settings.CSRF_COOKIE_NAME != "csrftoken"

    browser.get("/login/")
    token = browser.cookies[settings.CSRF_COOKIE_NAME].value
    form = {"username": owner.username, "password": PASSWORD, "csrfmiddlewaretoken": token}
    logged_in = browser.post("/login/", form)
    assert logged_in.status_code == 302, logged_in.content
    token = browser.cookies[settings.CSRF_COOKIE_NAME].value  # a login rotates it
    issued = api_token_create(user=owner, name="to revoke")
    revoked = browser.post(f"/settings/tokens/{issued.token.pk}/revoke", {"csrfmiddlewaretoken": token})
    assert revoked.status_code == 302
    page = browser.get("/settings/").content.decode()

    assert "revoked." in page  # the flash message crossed the redirect in the session
    assert set(browser.cookies) == {settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME}


@pytest.mark.django_db
def test_a_session_under_another_name_is_not_read(owner: Any) -> None:
    """A ``sessionid`` cookie (another instance's, or this one's before the rename) logs no one in."""
    elsewhere = Client()
    elsewhere.force_login(owner)
    session_key = elsewhere.cookies[settings.SESSION_COOKIE_NAME].value
    assert elsewhere.session[SESSION_KEY] == str(owner.pk)

    stranger = Client()
    stranger.cookies["sessionid"] = session_key

    assert stranger.get("/").status_code == 302  # to the login page
