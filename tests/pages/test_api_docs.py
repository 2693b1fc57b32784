"""The API's two readers, Swagger UI (``/api/docs/``) and Redoc (``/api/redoc/``), work
without internet (docs/agents.md#the-rest-api): every script,
stylesheet, font and image they name is this server's own static file
(drf-spectacular-sidecar, served by whitenoise), never a CDN's.

tests/browser/test_api_docs_browser.py loads both in Chromium with every other host blocked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import Client, override_settings

pytestmark = pytest.mark.django_db

PAGES = ["/api/docs/", "/api/redoc/"]
# Where a page names something to fetch: src=/href= attributes, and url(...) in inline CSS.
_REFERENCE = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']|\burl\(\s*["']?([^"')]+)""")
_ANY_URL = re.compile(r"(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}")


@pytest.fixture
def browser(owner: Any) -> Client:
    client = Client()
    client.force_login(owner)
    return client


def references(page: str) -> list[str]:
    return [first or second for first, second in _REFERENCE.findall(page)]


@pytest.mark.parametrize("path", PAGES)
def test_the_docs_pages_need_a_login_or_a_token(client: Client, path: str) -> None:
    response = client.get(path)  # a browser without a session goes to the login page and back
    assert response.status_code == 302
    assert response["Location"] == f"/login/?next={path}"
    assert client.get(path, HTTP_AUTHORIZATION="Bearer not-a-token").status_code == 401


@pytest.mark.parametrize("path", PAGES)
def test_a_docs_page_opens_with_a_token(client: Client, owner_token: str, path: str) -> None:
    assert client.get(path, HTTP_AUTHORIZATION=f"Bearer {owner_token}").status_code == 200


@pytest.mark.parametrize("path", PAGES)
def test_a_docs_page_names_no_other_host_and_serves_every_file_it_names(browser: Client, path: str) -> None:
    response = browser.get(path)
    assert response.status_code == 200
    page = response.content.decode()

    assert _ANY_URL.findall(page) == []  # no CDN, no web fonts, no validator badge
    named = references(page)
    assert any(ref.endswith(".js") for ref in named), named
    for ref in named:
        assert ref.startswith(settings.STATIC_URL), ref
        served = browser.get(ref)
        assert served.status_code == 200, ref
        assert b"".join(served.streaming_content if served.streaming else [served.content]), ref


def test_swagger_ui_comes_from_the_sidecar_with_its_validator_badge_off(browser: Client) -> None:
    page = browser.get("/api/docs/").content.decode()
    assert f"{settings.STATIC_URL}drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in page
    assert '"validatorUrl": null' in page  # else Swagger UI fetches a badge from validator.swagger.io


def test_redoc_comes_from_the_sidecar_without_web_fonts(browser: Client) -> None:
    page = browser.get("/api/redoc/").content.decode()
    assert f"{settings.STATIC_URL}drf_spectacular_sidecar/redoc/bundles/redoc.standalone.js" in page
    assert "fonts.googleapis.com" not in page and "fonts.gstatic.com" not in page
    # The bundle's sidebar shows Redocly's logo from its CDN: the page's policy forbids it.
    assert """<meta http-equiv="Content-Security-Policy" content="default-src 'self' """ in page
    assert 'spec-url="/api/schema/"' in page


def test_collectstatic_gathers_the_docs_files(tmp_path: Path) -> None:
    with override_settings(STATIC_ROOT=tmp_path):
        call_command("collectstatic", interactive=False, verbosity=0)
    sidecar = tmp_path / "drf_spectacular_sidecar"
    assert (sidecar / "swagger-ui-dist" / "swagger-ui-bundle.js").stat().st_size > 0
    assert (sidecar / "redoc" / "bundles" / "redoc.standalone.js").stat().st_size > 0
