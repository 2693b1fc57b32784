"""``/metrics`` of real ``manage.py serve`` processes over real sockets (docs/metrics.md).

Two servers of one instance: ``open_server`` with the default allow-list (loopback reads
without a token), ``token_server`` with ``DISPATCH_METRICS_ALLOW`` empty (a staff user's
token only). Each counts only what it holds itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.infra import Instance, Server, instance
from tests.live_clients import LiveSession
from tests.scrape import Samples, parse, value

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@dataclass
class Deployment:
    instance: Instance
    open_server: Server
    token_server: Server


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    with instance() as inst:
        open_server = inst.serve(wait=False)
        token_server = inst.serve(wait=False, DISPATCH_METRICS_ALLOW="")
        yield Deployment(inst, open_server.wait_healthy(), token_server.wait_healthy())


async def scrape(server: Server, token: str | None = None) -> Samples:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(f"{server.url}/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.text)


async def test_loopback_reads_a_process_s_own_sessions_and_calls(deployment: Deployment) -> None:
    server, token = deployment.open_server, deployment.instance.admin_token
    process_id = httpx.get(f"{server.url}/healthz", timeout=5).json()["process_id"]
    before = await scrape(server)  # no token: 127.0.0.1 is in the default allow-list
    hostname = next(dict(labels)["hostname"] for name, labels in before if name == "dispatch_server_process_info")
    assert value(before, "dispatch_server_process_info", process_id=process_id, hostname=hostname) == 1
    assert value(before, "dispatch_ws_sessions") == 0

    async with LiveSession.open(server.ws_url, token) as session:
        call = {"remotename": "no-such-remote", "function": "f", "args": {}}
        reply = await session.request("remote-call", call)
        assert reply["error"] == "no connected remote named 'no-such-remote'"
        during = await scrape(server)
        elsewhere = await scrape(deployment.token_server, token)

    assert value(during, "dispatch_ws_sessions") == 1
    calls, missing = "dispatch_remote_calls_total", "REMOTE_NOT_CONNECTED"
    assert value(during, calls, result=missing) - value(before, calls, result=missing) == 1
    # The other process neither holds the session nor made the call.
    assert value(elsewhere, "dispatch_ws_sessions") == 0
    assert value(elsewhere, calls, result=missing) == 0
    assert value(elsewhere, "dispatch_metrics_database_up") == 1


async def test_without_an_allowed_address_only_a_staff_token_reads(deployment: Deployment) -> None:
    server, inst = deployment.token_server, deployment.instance
    async with httpx.AsyncClient(timeout=10) as client:
        refused = await client.get(f"{server.url}/metrics")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "NOT_AUTHENTICATED"
        assert refused.headers["www-authenticate"] == "Bearer"

        inst.create_user("bob")
        bob = inst.token("bob")
        forbidden = await client.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {bob}"})
        assert forbidden.status_code == 403
        assert forbidden.json()["error"]["code"] == "PERMISSION_DENIED"

    samples = await scrape(server, inst.admin_token)  # admin is a superuser, hence staff
    assert value(samples, "dispatch_metrics_database_up") == 1
