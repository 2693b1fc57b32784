"""Device login (RFC 8628; docs/shim-protocol.md#getting-a-token): request a code, poll through pending
and slow_down, store the token in a 0600 state file."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from machines.shim import LoginError, StateStore, device_login

REPO = Path(__file__).resolve().parents[3]

DEVICE_AUTHORIZATION = {
    "device_code": "dc-secret",
    "user_code": "BCDF-GHJK",
    "verification_uri": "http://dispatch.test/machines/activate",
    "verification_uri_complete": "http://dispatch.test/machines/activate?code=BCDFGHJK",
    "expires_in": 600,
    "interval": 5,
}


class FakeDeviceEndpoints:
    """The two RFC 8628 endpoints; the token endpoint answers from ``token_answers``."""

    def __init__(self, token_answers: list[tuple[int, dict[str, Any]]]) -> None:
        self.token_answers = list(token_answers)
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((request.url.path, body))
        if request.url.path == "/api/v1/machines/device/code":
            return httpx.Response(200, json=DEVICE_AUTHORIZATION)
        if request.url.path == "/api/v1/machines/device/token":
            status, answer = self.token_answers.pop(0)
            return httpx.Response(status, json=answer)
        return httpx.Response(404, json={"error": "not_found"})


def login(
    tmp_path: Path, answers: list[tuple[int, dict[str, Any]]]
) -> tuple[FakeDeviceEndpoints, list[float], list[str], StateStore]:
    endpoints = FakeDeviceEndpoints(answers)
    sleeps: list[float] = []
    shown: list[str] = []
    store = StateStore(tmp_path / "state")
    client = httpx.Client(transport=httpx.MockTransport(endpoints.handle))
    try:
        device_login("http://dispatch.test/", store, client=client, sleep=sleeps.append, show=shown.append)
    finally:
        client.close()
    return endpoints, sleeps, shown, store


def test_it_polls_through_pending_and_slow_down_and_stores_the_token(tmp_path: Path) -> None:
    endpoints, sleeps, shown, store = login(
        tmp_path,
        [
            (400, {"error": "authorization_pending"}),
            (400, {"error": "slow_down"}),
            (400, {"error": "authorization_pending"}),
            (200, {"access_token": "machine-token-1", "token_type": "Bearer"}),
        ],
    )
    assert sleeps == [5, 5, 10, 10]  # slow_down adds 5 s to the interval, for good
    path, body = endpoints.requests[0]
    assert path == "/api/v1/machines/device/code"
    assert set(body) == {"machine_id", "hostname", "platform", "arch"}
    assert body["hostname"] == socket.gethostname()
    assert all(
        request == ("/api/v1/machines/device/token", endpoints.requests[1][1]) for request in endpoints.requests[1:]
    )
    assert endpoints.requests[1][1]["device_code"] == "dc-secret"
    assert "BCDF-GHJK" in shown[0] and "http://dispatch.test/machines/activate" in shown[0]
    state = store.load()
    assert (state.server, state.token, state.machine_id) == (
        "http://dispatch.test",
        "machine-token-1",
        body["machine_id"],
    )
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.state_dir.stat().st_mode) == 0o700


def test_it_keeps_its_machine_id_across_logins(tmp_path: Path) -> None:
    success = [(200, {"access_token": "t1", "token_type": "Bearer"})]
    first, *_ = login(tmp_path, success)
    second, *_, store = login(tmp_path, [(200, {"access_token": "t2", "token_type": "bearer"})])
    assert first.requests[0][1]["machine_id"] == second.requests[0][1]["machine_id"] == store.load().machine_id
    assert store.load().token == "t2"


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"error": "access_denied"}, "denied"),
        ({"error": "expired_token"}, "expired"),
        ({"error": "invalid_grant", "error_description": "unknown device code"}, "unknown device code"),
    ],
)
def test_it_gives_up_on_a_final_error_and_stores_no_token(tmp_path: Path, answer: dict, message: str) -> None:
    with pytest.raises(LoginError, match=message):
        login(tmp_path, [(400, {"error": "authorization_pending"}), (400, answer)])
    assert StateStore(tmp_path / "state").load().token is None


def test_it_stops_polling_when_the_code_expires(tmp_path: Path) -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    endpoints = FakeDeviceEndpoints([(400, {"error": "authorization_pending"})] * 200)
    client = httpx.Client(transport=httpx.MockTransport(endpoints.handle))
    with pytest.raises(LoginError, match="expired"):
        device_login(
            "http://dispatch.test", StateStore(tmp_path), client=client, sleep=sleep, clock=lambda: now[0], show=print
        )
    assert len(endpoints.requests) - 1 == 600 // 5  # polled for expires_in, then stopped


def test_it_reports_a_platform_that_refuses_the_code_request(tmp_path: Path) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"code": "THROTTLED", "message": "slow down"}})

    client = httpx.Client(transport=httpx.MockTransport(refuse))
    with pytest.raises(LoginError, match="HTTP 429"):
        device_login("http://dispatch.test", StateStore(tmp_path), client=client, show=print)


@pytest.fixture
def device_server() -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server in a thread: code, then one pending poll, then a token."""
    polls: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/api/v1/machines/device/code":
                status, answer = 200, {**DEVICE_AUTHORIZATION, "interval": 0.05}
            else:
                polls.append(body["device_code"])
                if len(polls) == 1:
                    status, answer = 400, {"error": "authorization_pending"}
                else:
                    status, answer = 200, {"access_token": "cli-token", "token_type": "Bearer"}
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", polls
    finally:
        server.shutdown()
        server.server_close()


def test_the_login_command_prints_the_code_and_stores_the_token(
    tmp_path: Path, device_server: tuple[str, list[str]]
) -> None:
    url, polls = device_server
    state_dir = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "machines.shim", "login", "--server", url, "--state-dir", str(state_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "BCDF-GHJK" in done.stdout and "/machines/activate" in done.stdout
    assert polls == ["dc-secret", "dc-secret"]
    state = json.loads((state_dir / "state.json").read_text())
    assert state["token"] == "cli-token" and state["server"] == url
    assert stat.S_IMODE((state_dir / "state.json").stat().st_mode) == 0o600

    status = subprocess.run(
        [sys.executable, "-m", "machines.shim", "status", "--state-dir", str(state_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0
    assert "token:      stored" in status.stdout and state["machine_id"] in status.stdout
    assert "cli-token" not in status.stdout

    logout = subprocess.run(
        [sys.executable, "-m", "machines.shim", "logout", "--state-dir", str(state_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert logout.returncode == 0
    after = json.loads((state_dir / "state.json").read_text())
    assert after == {**state, "token": None}


def test_after_approval_login_prints_the_next_command_with_its_own_options(
    tmp_path: Path, device_server: tuple[str, list[str]]
) -> None:
    url, _ = device_server
    state_dir = tmp_path / "my state"
    done = subprocess.run(
        [sys.executable, "-m", "machines.shim", "login", "--server", url, "--state-dir", str(state_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 0, done.stderr
    assert f"Next: python -m machines.shim run --root <dir> --state-dir '{state_dir}' --server {url}\n" in done.stdout
