"""A real ``manage.py serve`` as ``make run`` starts it (docs/operating.md#settings, docs/operating.md#logs):

- the commands run in a second terminal (``peer_offer``) print the public URL that server
  hands out, not the default, and stop doing so once it has exited;
- its log holds one line for a refused ``Host`` header and none for the client errors of
  a normal day (a device login's polls, an MCP client's OAuth probes);
- those probes (``/.well-known/…``, ``POST /register``) answer the API's JSON 404.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.infra import Instance, instance

PUBLIC_URL = "http://dispatch-c1.lan:9123"
GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"


@pytest.fixture(scope="module")
def inst() -> Iterator[Instance]:
    with instance() as started:
        yield started


def offered_address(inst: Instance) -> str:
    lines = inst.manage("peer_offer").stdout.splitlines()
    return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("address:"))


def test_commands_beside_a_server_use_its_public_url_and_its_log_stays_quiet(inst: Instance) -> None:
    assert "DISPATCH_PUBLIC_URL" not in inst.env
    assert offered_address(inst) == "http://127.0.0.1:8000"
    server = inst.serve(DISPATCH_PUBLIC_URL=PUBLIC_URL, DISPATCH_LOG_LEVEL="INFO")
    record = Path(inst.env["DISPATCH_DATA_DIR"]) / "public_url.json"
    assert json.loads(record.read_text()) == {"url": PUBLIC_URL, "pid": server.pid}

    # A second terminal, no DISPATCH_PUBLIC_URL in its environment: the server's URL.
    assert offered_address(inst) == PUBLIC_URL

    with httpx.Client(base_url=server.url, timeout=10) as http:
        refused = http.get("/", headers={"Host": "laptop.lan"})
        assert refused.status_code == 400
        code = http.post(
            "/api/v1/machines/device/code",
            json={"machine_id": "m1", "hostname": "h", "platform": "linux", "arch": "x86_64"},
        )
        device_code = code.json()["device_code"]
        for expected in ("authorization_pending", "slow_down"):
            polled = http.post(
                "/api/v1/machines/device/token", json={"grant_type": GRANT_TYPE, "device_code": device_code}
            )
            assert polled.status_code == 400 and polled.json()["error"] == expected
            assert polled.headers["Pragma"] == "no-cache"
        for method, path in (
            ("GET", "/.well-known/oauth-protected-resource/mcp"),
            ("GET", "/.well-known/oauth-authorization-server"),
            ("POST", "/register"),
        ):
            probed = http.request(method, path, json={"client_name": "mcp-remote"} if method == "POST" else None)
            assert probed.status_code == 404, (path, probed.text[:200])
            assert probed.headers["Content-Type"] == "application/json"
            assert probed.json()["error"]["code"] == "NOT_FOUND"

    assert server.stop() == 0
    log = server.log()
    host_lines = [line for line in log.splitlines() if "Invalid HTTP_HOST header: 'laptop.lan'" in line]
    assert len(host_lines) == 1, log
    assert "WARNING django.security.DisallowedHost" in host_lines[0]
    assert "ALLOWED_HOSTS" in host_lines[0] and "DISPATCH_PUBLIC_URL" in host_lines[0]
    assert "Traceback" not in log, log
    assert "django.request" not in log, log  # no "Bad Request: …" / "Not Found: …" lines

    # Its record is gone with it: commands fall back to the default again.
    assert not record.exists()
    assert offered_address(inst) == "http://127.0.0.1:8000"
