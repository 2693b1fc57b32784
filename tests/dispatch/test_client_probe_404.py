"""What OAuth and MCP clients get for the paths they probe (docs/mcp.md#connecting-a-client):
``/.well-known/…`` and ``/register`` answer a JSON 404 in the API's error shape
unless a browser asks for a page, and a refused ``Host`` header is one log line."""

from __future__ import annotations

import logging

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

PROBED = [
    ("get", "/.well-known/oauth-protected-resource"),
    ("get", "/.well-known/oauth-protected-resource/mcp"),
    ("get", "/.well-known/oauth-authorization-server"),
    ("get", "/.well-known/openid-configuration"),
    ("get", "/.well-known"),
    ("post", "/register"),
    ("post", "/register/"),
    ("post", "/register/client"),
    ("get", "/register"),
]


@pytest.fixture
def strict_client() -> Client:
    # Like a real client: no CSRF token, no session.
    return Client(enforce_csrf_checks=True)


@pytest.mark.parametrize("accept", [None, "application/json", "application/json, text/event-stream", "*/*"])
@pytest.mark.parametrize(("method", "path"), PROBED)
def test_a_probed_path_answers_a_json_404(strict_client, method, path, accept):
    headers = {"HTTP_ACCEPT": accept} if accept else {}
    body = {"client_name": "mcp-remote", "redirect_uris": ["http://localhost:1/cb"]}
    if method == "post":
        response = strict_client.post(path, body, content_type="application/json", **headers)
    else:
        response = strict_client.get(path, **headers)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "NOT_FOUND"
    assert path in error["message"]
    assert error["details"] == {}


def test_a_browser_asking_for_the_page_gets_the_404_page(strict_client):
    response = strict_client.get("/.well-known/security.txt", HTTP_ACCEPT="text/html,application/xhtml+xml,*/*;q=0.8")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


def test_a_page_and_an_api_route_keep_their_404s(strict_client):
    page = strict_client.get("/no-such-page", HTTP_ACCEPT="application/json")
    assert page.status_code == 404 and page["Content-Type"].startswith("text/html")
    api = strict_client.get("/api/v1/no-such-route")
    assert api.status_code == 404 and api.json()["error"]["code"] == "NOT_FOUND"


def test_a_probe_logs_nothing_at_info(strict_client, caplog):
    with caplog.at_level(logging.INFO):
        strict_client.post("/register", {}, content_type="application/json")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []


def test_a_refused_host_is_one_warning_line_without_a_traceback(strict_client, caplog):
    with caplog.at_level(logging.INFO):
        response = strict_client.get("/healthz", HTTP_HOST="laptop.lan")
    assert response.status_code == 400
    logged = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    (record,) = logged
    assert record.name == "django.security.DisallowedHost"
    assert record.levelno == logging.WARNING
    assert record.exc_info is None and record.exc_text is None
    message = record.getMessage()
    assert message.startswith("Invalid HTTP_HOST header: 'laptop.lan'.")
    assert "ALLOWED_HOSTS" in message and "DISPATCH_PUBLIC_URL" in message
    assert "\n" not in message


def test_a_server_error_is_still_logged_as_an_error():
    from dispatch.log_filters import ClientErrorsAtDebug

    record = logging.LogRecord("django.request", logging.ERROR, __file__, 1, "Internal Server Error: /x", None, None)
    record.status_code = 500
    assert ClientErrorsAtDebug().filter(record) is True
    assert record.levelno == logging.ERROR


def test_client_errors_still_show_at_debug_level():
    from dispatch.log_filters import ClientErrorsAtDebug

    def bad_request() -> logging.LogRecord:
        record = logging.LogRecord("django.request", logging.WARNING, __file__, 1, "Bad Request: /x", None, None)
        record.status_code = 400
        return record

    logger = logging.getLogger("django.request")
    before = logger.level
    try:
        logger.setLevel(logging.INFO)
        assert ClientErrorsAtDebug().filter(bad_request()) is False
        logger.setLevel(logging.DEBUG)
        shown = bad_request()
        assert ClientErrorsAtDebug().filter(shown) is True
        assert shown.levelname == "DEBUG"
    finally:
        logger.setLevel(before)
