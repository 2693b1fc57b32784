"""Behind a real nginx (docs/operating.md#behind-a-proxy): the address and scheme Dispatch
sees, and event streams that are not held back.

The topology is ``tests.cluster`` (nginx with TLS in front of two ``serve`` processes on
PostgreSQL + Redis, ``DISPATCH_BEHIND_PROXY=1``). Clients on loopback take distinct
addresses by binding their socket (127.0.0.2, 127.0.0.3, …): nginx sees each as its
``$remote_addr`` and overwrites ``X-Forwarded-For`` with it, whatever the client sent.

- a client forging ``X-Forwarded-For`` (naming another client's address) is counted under
  its real address: its five bad passwords lock it out, not the client it named nor
  anyone else (the throttle lives in Redis, shared by both processes);
- a websocket session's recorded address is its real one, forged header or not;
- a request that reached nginx over HTTPS is HTTPS to Django (its CSRF check asks for a Referer);
- the first event of ``/api/v1/events`` and ``GET /mcp`` arrives while the stream is still
  open, through the topology's nginx and through one with nginx's default
  ``proxy_buffering on`` (where only ``X-Accel-Buffering: no`` lets it through).
"""

from __future__ import annotations

import re
import ssl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest
from websockets.asyncio.client import connect

import deploy.nginx
from deploy.cluster import Nginx, body_cap, free_port
from tests.cluster import MARKS, Cluster, cluster
from tests.infra import wait_until
from tests.live_clients import LiveSession

pytestmark = [*(getattr(pytest.mark, mark) for mark in MARKS), pytest.mark.timeout(180)]

FIRST_EVENT_WITHIN = 5.0  # seconds: a stream's first event, not a performance bound


@pytest.fixture(scope="module")
def topo() -> Iterator[Cluster]:
    with cluster(servers=2, tls=True, worker=False) as running:
        yield running


def client_from(topo: Cluster, address: str) -> httpx.Client:
    """An httpx client of nginx whose socket is bound to ``address`` (a loopback address)."""
    transport = httpx.HTTPTransport(local_address=address, verify=_verify(topo))
    return httpx.Client(base_url=topo.url, transport=transport, timeout=30)


def _verify(topo: Cluster) -> ssl.SSLContext | bool:
    context = topo.ssl_context()
    return context if context is not None else True


def token_attempt(client: httpx.Client, username: str, password: str, forged: str | None = None) -> int:
    headers = {"X-Forwarded-For": forged} if forged else {}
    answer = client.post(
        "/api/v1/auth/token", json={"username": username, "password": password, "name": "t"}, headers=headers
    )
    return answer.status_code


def test_a_forged_forwarded_address_is_overwritten_and_clients_are_throttled_apart(topo: Cluster) -> None:
    password = topo.instance.admin_password
    with (
        client_from(topo, "127.0.0.2") as mallory,
        client_from(topo, "127.0.0.3") as alice,
        client_from(topo, "127.0.0.1") as local,
    ):
        # Five bad passwords, each for another unknown user (no per-username count builds
        # up), each claiming to come from alice's address.
        for _ in range(5):
            assert token_attempt(mallory, f"nobody-{uuid.uuid4().hex[:8]}", "wrong", forged="127.0.0.3") == 401
        # mallory is locked out under its real address, whatever it claims now ...
        assert token_attempt(mallory, "admin", password) == 429
        assert token_attempt(mallory, "admin", password, forged="10.9.9.9") == 429
        # ... and nobody else is: not the address it named, not nginx's own.
        assert token_attempt(alice, "admin", password) == 201
        assert token_attempt(local, "admin", password) == 201

    def addresses() -> set[str]:
        lines = topo.nginx.access_log().splitlines()
        return {line.split(" ", 1)[0] for line in lines if "/api/v1/auth/token" in line}

    # The attempts did go through nginx (it logs a request once answered: the last line may
    # come a moment after its answer).
    wanted = {"127.0.0.1", "127.0.0.2", "127.0.0.3"}
    wait_until(
        lambda: addresses() == wanted,
        timeout=5,
        what="the three addresses in nginx's log",
        details=lambda: str(addresses()),
    )


async def test_a_websocket_session_records_its_real_address(topo: Cluster) -> None:
    headers = {"Authorization": f"Bearer {topo.token}", "X-Forwarded-For": "10.8.8.8"}
    async with connect(
        topo.ws_url, additional_headers=headers, open_timeout=10, ssl=topo.ssl_context(), local_addr=("127.0.0.4", 0)
    ) as connection:
        session = LiveSession(connection)
        try:
            reply = await session.request("remote-list", {})
            assert "error" not in reply, reply
            rows = topo.rows("SELECT client_address FROM remotes_wssession")
            assert rows == [("127.0.0.4",)]
        finally:
            session._reader.cancel()


def test_a_request_that_reached_nginx_over_https_is_https_to_dispatch(topo: Cluster) -> None:
    assert topo.url.startswith("https://")
    with client_from(topo, "127.0.0.5") as browser:
        page = browser.get("/login/")
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert csrf is not None, page.text[:500]
        # Django demands a Referer (or Origin) on a form POST only from a request it sees as
        # HTTPS; over plain http the same POST would reach the login view.
        form = {"username": "admin", "password": topo.instance.admin_password, "csrfmiddlewaretoken": csrf.group(1)}
        bare = browser.post("/login/", data=form)
        assert bare.status_code == 403, bare.text[:500]
        logged_in = browser.post(
            "/login/",
            data=form,
            headers={"Origin": topo.url, "Referer": f"{topo.url}/login/"},
        )
        assert logged_in.status_code == 302, logged_in.text[:500]
        # The pages give the public https address to serve a remote with.
        page = browser.get("/remotes/")
        assert page.status_code == 200
        assert f"--server {topo.url}" in page.text


# --- event streams ---------------------------------------------------------------------------------


def first_event_after(url: str, path: str, token: str, verify: Any) -> float:
    """Seconds from opening ``GET path`` until its first non-comment line arrived; the
    stream is still open then (these streams never end on their own)."""
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    started = time.monotonic()
    with (
        httpx.Client(base_url=url, verify=verify, timeout=httpx.Timeout(30, read=FIRST_EVENT_WITHIN)) as client,
        client.stream("GET", path, headers=headers) as stream,
    ):
        assert stream.status_code == 200, stream.read()
        # nginx acts on X-Accel-Buffering and never passes it on: its effect is the test.
        assert "x-accel-buffering" not in stream.headers
        try:
            for line in stream.iter_lines():
                if line and not line.startswith(":"):
                    return time.monotonic() - started
        except httpx.ReadTimeout:
            raise AssertionError(f"no event of {path} within {FIRST_EVENT_WITHIN} s: held back by nginx") from None
    raise AssertionError(f"{path} ended without an event")


@pytest.fixture(scope="module")
def buffering_nginx(topo: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    """A second nginx before the same processes with nginx's default ``proxy_buffering on``."""
    workdir = tmp_path_factory.mktemp("buffering-nginx")
    template = workdir / "nginx.conf.in"
    text = deploy.nginx.TEMPLATE.read_text()
    assert "proxy_buffering off;" in text
    template.write_text(text.replace("proxy_buffering off;", "proxy_buffering on;"))
    with mock.patch.object(deploy.nginx, "TEMPLATE", template):  # nginx_conf reads it there
        nginx = Nginx.start(
            workdir / "prefix",
            port=free_port(),
            upstreams=[server.port for server in topo.servers],
            max_body_bytes=body_cap(topo.env),
            tls=topo.certificate,
        )
    try:
        assert "proxy_buffering on;" in Path(nginx.conf_path).read_text()
        yield nginx
    finally:
        nginx.stop()


@pytest.mark.parametrize("path", ["/api/v1/events", "/mcp"])
def test_an_event_stream_through_nginx_delivers_its_first_event_at_once(topo: Cluster, path: str) -> None:
    assert first_event_after(topo.url, path, topo.token, _verify(topo)) < FIRST_EVENT_WITHIN


@pytest.mark.parametrize("path", ["/api/v1/events", "/mcp"])
def test_an_event_stream_is_not_held_back_by_a_buffering_nginx(
    topo: Cluster, buffering_nginx: Nginx, path: str
) -> None:
    assert first_event_after(buffering_nginx.url, path, topo.token, _verify(topo)) < FIRST_EVENT_WITHIN
