"""Device login: the OAuth 2.0 device authorization grant (RFC 8628; docs/shim-protocol.md#getting-a-token).

``POST {server}/api/v1/machines/device/code {machine_id, hostname, platform, arch}`` →
``{device_code, user_code, verification_uri, verification_uri_complete, expires_in,
interval}``; the user approves the code in a browser while the shim polls ``POST
{server}/api/v1/machines/device/token {device_code}`` every ``interval`` seconds until it
gets ``{access_token, token_type: "Bearer"}`` or a final error (RFC 8628 §3.5).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from .operations import MachineIdentity
from .state import ShimState, StateStore

DEVICE_CODE_PATH = "/api/v1/machines/device/code"
DEVICE_TOKEN_PATH = "/api/v1/machines/device/token"
DEVICE_GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
DEFAULT_INTERVAL = 5.0
"""Seconds between polls when the platform names no interval (RFC 8628 §3.2)."""
SLOW_DOWN_STEP = 5.0
"""Seconds added to the interval on every ``slow_down`` (RFC 8628 §3.5)."""


def show_at_once(text: str) -> None:
    """Print ``text`` on stdout and flush it: when stdout is a pipe, a log file or ssh
    without ``-t``, Python buffers it in blocks, and the user would not see the code to
    type until the login is over (docs/shim-protocol.md#getting-a-token)."""
    print(text, flush=True)


class LoginError(Exception):
    """The device login failed: denied, expired, unreachable platform or a bad answer."""


@dataclass(frozen=True)
class DeviceAuthorization:
    """The platform's device authorization response (RFC 8628 §3.2); seconds for times."""

    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str | None
    expires_in: float
    interval: float


def base_url(server: str) -> str:
    """The server's base URL without a trailing slash. Raises ``LoginError`` unless it is
    an ``http(s)://`` URL with a host."""
    url = httpx.URL(server.strip())
    if url.scheme not in ("http", "https") or not url.host:
        raise LoginError(f"expected the server's base URL, http(s)://host:port, got {server!r}")
    return str(url).rstrip("/")


def request_device_code(client: httpx.Client, server: str, identity: MachineIdentity) -> DeviceAuthorization:
    """Start a device login for ``identity`` at ``server`` (a base URL).

    Raises ``LoginError`` when the platform cannot be reached or answers with anything
    but a well-formed device authorization.
    """
    body = {
        "machine_id": identity.machine_id,
        "hostname": identity.hostname,
        "platform": identity.platform,
        "arch": identity.arch,
    }
    response = _post(client, base_url(server) + DEVICE_CODE_PATH, body)
    answer = _json_object(response)
    if response.status_code != 200:
        raise LoginError(f"the platform refused the device login (HTTP {response.status_code}): {_reason(answer)}")
    try:
        device_code, user_code = answer["device_code"], answer["user_code"]
        verification_uri = answer["verification_uri"]
        if not all(isinstance(value, str) and value for value in (device_code, user_code, verification_uri)):
            raise TypeError
        complete = answer.get("verification_uri_complete")
        return DeviceAuthorization(
            device_code=device_code,
            user_code=user_code,
            verification_uri=verification_uri,
            verification_uri_complete=complete if isinstance(complete, str) else None,
            expires_in=float(answer.get("expires_in") or 600),
            interval=max(float(DEFAULT_INTERVAL if answer.get("interval") is None else answer["interval"]), 0.0),
        )
    except (KeyError, TypeError, ValueError):
        raise LoginError(f"the platform's device authorization is malformed: {answer!r:.300}") from None


def poll_for_token(
    client: httpx.Client,
    server: str,
    authorization: DeviceAuthorization,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Poll the token endpoint until the user decides; return the access token.

    Waits ``interval`` seconds before each poll; ``authorization_pending`` polls again,
    ``slow_down`` adds 5 s to the interval; ``access_denied``, ``expired_token`` (or
    ``expires_in`` running out) and any other error raise ``LoginError``. Network errors
    and 5xx answers are retried until the code expires.
    """
    url = base_url(server) + DEVICE_TOKEN_PATH
    interval = authorization.interval
    deadline = clock() + authorization.expires_in
    while True:
        sleep(interval)
        if clock() > deadline:
            raise LoginError("the code expired before it was approved; run login again")
        try:
            response = client.post(
                url, json={"device_code": authorization.device_code, "grant_type": DEVICE_GRANT_TYPE}
            )
        except httpx.TransportError:
            continue
        if response.status_code >= 500:
            continue
        answer = _json_object(response)
        if response.status_code == 200:
            token = answer.get("access_token")
            if not isinstance(token, str) or not token:
                raise LoginError("the platform's token response has no access_token")
            if str(answer.get("token_type", "Bearer")).lower() != "bearer":
                raise LoginError(f"unexpected token_type {answer.get('token_type')!r}")
            return token
        error = answer.get("error")
        if error == "authorization_pending":
            continue
        if error == "slow_down":
            interval += SLOW_DOWN_STEP
            continue
        if error == "access_denied":
            raise LoginError("the login was denied in the browser")
        if error == "expired_token":
            raise LoginError("the code expired before it was approved; run login again")
        raise LoginError(f"the platform refused the login (HTTP {response.status_code}): {_reason(answer)}")


def device_login(
    server: str,
    store: StateStore,
    *,
    client: httpx.Client | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    show: Callable[[str], None] = show_at_once,
) -> ShimState:
    """The whole login: request a code, ``show`` the user what to open and type, poll,
    then store ``server``, the token and the machine_id in the state file (mode 0600).

    Returns the saved state. Raises ``LoginError``; ``OSError`` if the state file cannot
    be written.
    """
    server = base_url(server)
    state = store.ensure_machine_id()
    assert state.machine_id is not None
    identity = MachineIdentity.detect(state.machine_id)
    owns_client = client is None
    http = client or httpx.Client(timeout=30.0)
    try:
        authorization = request_device_code(http, server, identity)
        direct = authorization.verification_uri_complete
        show(
            f"To connect {identity.hostname} to Dispatch, open\n\n    {authorization.verification_uri}\n\n"
            f"and enter the code {authorization.user_code}"
            + (f"\n(or open {direct})" if direct else "")
            + f"\n\nWaiting for approval (the code expires in {authorization.expires_in / 60:.0f} minutes)..."
        )
        token = poll_for_token(http, server, authorization, sleep=sleep, clock=clock)
    finally:
        if owns_client:
            http.close()
    state = store.load()
    state.server, state.token = server, token
    state.machine_id = state.machine_id or identity.machine_id
    store.save(state)
    return state


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response:
    try:
        return client.post(url, json=body)
    except httpx.TransportError as error:
        raise LoginError(f"cannot reach {url}: {error}") from None


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        answer = response.json()
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _reason(answer: dict[str, Any]) -> str:
    error = answer.get("error")
    if isinstance(error, dict):  # Dispatch's own error shape {"error": {code, message}}
        return f"{error.get('code')}: {error.get('message')}"
    description = answer.get("error_description")
    return f"{error}: {description}" if description else str(error or "no reason given")
