"""An OAuth 2.1 client written out step by step over httpx (docs/mcp.md#oauth), for the
tests that must send what no well-behaved client sends (a wrong verifier, a reused code,
a reused refresh token). The real clients' runs are in ``test_oauth_clients.py``."""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from html import unescape
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

REDIRECT_URI = "http://127.0.0.1:9/callback"
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "flow", "version": "1"}},
}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def pkce_pair() -> tuple[str, str]:
    """``(verifier, S256 challenge)`` (RFC 7636 §4.1–4.2)."""
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    return verifier, challenge


def form_fields(html: str) -> dict[str, str | list[str]]:
    """The named inputs of a page, with their values, as a browser would post them: a
    checkbox only when checked, and the values of checked boxes sharing a name as a list
    (the consent page's ``scopes``)."""
    fields: dict[str, str | list[str]] = {}
    for tag in re.findall(r"<input[^>]*>", html):
        name = re.search(r'name="([^"]*)"', tag)
        value = re.search(r'value="([^"]*)"', tag)
        if not name:
            continue
        key = unescape(name.group(1))
        text = unescape(value.group(1)) if value else ""
        if re.search(r'type="checkbox"', tag):
            if re.search(r"\schecked[\s>=/]", tag):
                checked = fields.setdefault(key, [])
                assert isinstance(checked, list)
                checked.append(text or "on")
            continue
        fields[key] = text
    return fields


@dataclass
class Flow:
    """One client's sign-in against the server at ``base``."""

    base: str
    redirect_uri: str = REDIRECT_URI
    client_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    browser: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.browser = httpx.Client(base_url=self.base, follow_redirects=False, timeout=20)
        self.metadata = httpx.get(f"{self.base}/.well-known/oauth-authorization-server/oauth", timeout=10).json()

    @property
    def resource(self) -> str:
        return f"{self.base}/mcp/oauth"

    def register(self, **overrides: Any) -> httpx.Response:
        body = {
            "client_name": "Flow test client",
            "redirect_uris": [self.redirect_uri],
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
            **overrides,
        }
        answer = httpx.post(self.metadata["registration_endpoint"], json=body, timeout=10)
        if answer.status_code == 201:
            self.client_id = answer.json()["client_id"]
        return answer

    def login(self, username: str, password: str) -> None:
        page = self.browser.get("/login/")
        csrf = form_fields(page.text)["csrfmiddlewaretoken"]
        login = {"username": username, "password": password, "csrfmiddlewaretoken": csrf}
        answer = self.browser.post("/login/", data=login)
        assert answer.status_code == 302, answer.text[:500]

    def authorize_page(self, challenge: str, *, state: str = "st", scope: str = "mcp", **extra: str) -> httpx.Response:
        params = {
            "response_type": "code",
            "client_id": self.client_id,
            "redirect_uri": self.redirect_uri,
            "code_challenge": challenge,
            "code_challenge_method": "S256",
            "state": state,
            "scope": scope,
            "resource": self.resource,
            **extra,
        }
        return self.browser.get("/oauth/authorize/", params={k: v for k, v in params.items() if v is not None})

    def approve(self, page: httpx.Response, **changes: str | list[str]) -> httpx.Response:
        """Submit the consent form of ``page`` as its Allow button does (the boxes as checked
        on the page; ``scopes=[…]`` to check others)."""
        fields = {**form_fields(page.text), **changes}
        fields.setdefault("allow", "Authorize")
        return self.browser.post("/oauth/authorize/", data=fields)

    def code(self, challenge: str, **extra: str) -> str:
        """Authorize (the user consents) and return the code the redirect carries."""
        page = self.authorize_page(challenge, **extra)
        assert page.status_code == 200, page.text[:500]
        answer = self.approve(page)
        assert answer.status_code == 302, answer.text[:500]
        query = parse_qs(urlsplit(answer.headers["location"]).query)
        assert "code" in query, answer.headers["location"]
        return query["code"][0]

    def token(self, **data: str) -> httpx.Response:
        return httpx.post(self.metadata["token_endpoint"], data={"client_id": self.client_id, **data}, timeout=10)

    def exchange(self, code: str, verifier: str) -> httpx.Response:
        return self.token(
            grant_type="authorization_code",
            code=code,
            redirect_uri=self.redirect_uri,
            code_verifier=verifier,
            resource=self.resource,
        )

    def signed_in(self) -> dict[str, Any]:
        """The whole flow: register (unless done), authorize, exchange; the token response."""
        if not self.client_id:
            assert self.register().status_code == 201
        verifier, challenge = pkce_pair()
        answer = self.exchange(self.code(challenge), verifier)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def mcp(self, access_token: str, message: dict[str, Any], path: str = "/mcp/oauth") -> httpx.Response:
        headers = {**MCP_HEADERS, "Authorization": f"Bearer {access_token}"}
        return httpx.post(f"{self.base}{path}", json=message, headers=headers, timeout=20)


class EventStream:
    """``GET <url>``, an MCP event stream, read in a thread with ``access_token``: ``opened`` is
    set once it answered 200, ``ended`` holds the monotonic time it closed (empty while open)."""

    def __init__(self, url: str, access_token: str) -> None:
        self.url = url
        self.headers = {"Accept": "text/event-stream", "Authorization": f"Bearer {access_token}"}
        self.opened = threading.Event()
        self.ended: list[float] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            with httpx.stream("GET", self.url, headers=self.headers, timeout=httpx.Timeout(10, read=60)) as response:
                assert response.status_code == 200
                self.opened.set()
                for _line in response.iter_lines():
                    pass
        except httpx.HTTPError:
            pass
        finally:
            self.ended.append(time.monotonic())
