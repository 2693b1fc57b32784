"""``/metrics`` (docs/metrics.md): the exposition, the connection gauges, remote calls,
background loops, and who may read it. Machine operations and the outbox are counted in
tests/machines/test_machine_metrics.py and tests/peers/test_outbox_metrics.py."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterator
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from agents.models import Agent
from agents.services import agent_create
from agents.tokens import agent_token_mint
from core.conf import env_networks
from core.models import ServerProcess
from core.presence import current_process_id
from core.realtime import LoopHealth
from dispatch import background
from dispatch import metrics as metrics_view
from remotes.models import WsSession
from tests.infra import eventually
from tests.scrape import parse, scrape, scrape_sync, value

pytestmark = pytest.mark.django_db(transaction=True)

OUTSIDE = "203.0.113.7"  # TEST-NET-3: never in the default allow-list
WEATHER = "weather-service"


def families(text: str) -> dict[str, str]:
    """Family name → type."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}


# --- the exposition -------------------------------------------------------------------------


def test_every_documented_family_is_exposed_with_its_type(db: None) -> None:
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    found = families(response.content.decode())
    expected = {
        "dispatch_ws_sessions": "gauge",
        "dispatch_remotes_served": "gauge",
        "dispatch_shims_connected": "gauge",
        "dispatch_remote_calls": "counter",
        "dispatch_remote_call_duration_seconds": "histogram",
        "dispatch_machine_operations": "counter",
        "dispatch_machine_operation_duration_seconds": "histogram",
        "dispatch_outbox_depth": "gauge",
        "dispatch_outbox_oldest_age_seconds": "gauge",
        "dispatch_outbox_dead": "gauge",
        "dispatch_background_loop_errors": "counter",
        "dispatch_server_process_info": "gauge",
        "dispatch_metrics_database_up": "gauge",
        "process_resident_memory_bytes": "gauge",
    }
    assert {name: found.get(name) for name in expected} == expected
    samples = parse(response.content.decode())
    assert value(samples, "dispatch_server_process_info", process_id=current_process_id(), hostname=_hostname()) == 1
    assert value(samples, "dispatch_metrics_database_up") == 1


def test_a_scraper_asking_for_openmetrics_gets_it(db: None) -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    response = Client().get("/metrics", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    found = {family.name: family.type for family in openmetrics_families(response.content.decode())}
    assert found["dispatch_remote_calls"] == "counter"
    assert found["dispatch_outbox_depth"] == "gauge"


def test_a_malformed_accept_gets_the_default_format(db: None) -> None:
    response = Client().get("/metrics", HTTP_ACCEPT="application/openmetrics-text; version=abc")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "dispatch_metrics_database_up" in {f.name for f in text_string_to_metric_families(response.content.decode())}


def _hostname() -> str:
    from core.presence import HOSTNAME

    return HOSTNAME


def test_an_unreadable_database_leaves_the_row_gauges_out_and_says_so(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable() -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(metrics_view, "held_rows", unreachable)
    response = Client().get("/metrics")
    assert response.status_code == 200
    samples = parse(response.content.decode())
    assert value(samples, "dispatch_metrics_database_up") == 0
    assert "dispatch_ws_sessions" not in families(response.content.decode())
    assert "dispatch_remote_calls" in families(response.content.decode())


# --- connections this process holds ---------------------------------------------------------


async def test_the_connection_gauges_count_the_sessions_and_remotes_of_this_process_only(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: Any
) -> None:
    # A session row of another (live) process is not this process's to count.
    await database_sync_to_async(_session_of_another_process)(owner)
    before = await scrape()
    assert value(before, "dispatch_ws_sessions") == 0
    assert value(before, "dispatch_remotes_served") == 0
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token):
        reply = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        assert reply["message"] == "remote connected", reply
        during = await scrape()
    assert value(during, "dispatch_ws_sessions") == 2
    assert value(during, "dispatch_remotes_served") == 1
    after = await scrape()
    assert value(after, "dispatch_ws_sessions") == 0
    assert value(after, "dispatch_remotes_served") == 0


def _session_of_another_process(user: Any) -> None:
    other = ServerProcess.objects.create(id="proc_0000000000000000", kind="serve", hostname="elsewhere", pid=1)
    WsSession.objects.create(user=user, channel_name="elsewhere.1", server_process=other, auth_method="header")


# --- remote calls ---------------------------------------------------------------------------


async def test_remote_calls_are_counted_by_result_and_timed(
    ws_connect: Any, owner_token: str, weather_tools: Any
) -> None:
    before = await scrape()
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        call = {"remotename": WEATHER, "function": "get_forecast", "args": {"city": "Rome"}}
        await caller.send({"action": "remote-call", "nonce": "ok", "body": call})
        event = await server.next_event()
        await asyncio.sleep(0.05)  # the call waits a measurable time
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "sunny"})
        assert await caller.reply("ok") == {"result": "sunny", "nonce": "ok"}

        await caller.send({"action": "remote-call", "nonce": "err", "body": call})
        event = await server.next_event()
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "error": "no such city"})
        assert (await caller.reply("err"))["error"] == "no such city"

        missing = {**call, "remotename": "no-such-remote"}
        assert "no connected remote" in (await caller.request("remote-call", missing))["error"]
    after = await scrape()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("dispatch_remote_calls_total", result="ok") == 1
    assert delta("dispatch_remote_calls_total", result="REMOTE_ERROR") == 1
    assert delta("dispatch_remote_calls_total", result="REMOTE_NOT_CONNECTED") == 1
    assert delta("dispatch_remote_call_duration_seconds_count", outcome="ok") == 1
    assert delta("dispatch_remote_call_duration_seconds_count", outcome="error") == 2
    assert delta("dispatch_remote_call_duration_seconds_sum", outcome="ok") >= 0.05
    # The 0.05 s call is above the 0.025 s bucket and inside the 5 s one.
    assert delta("dispatch_remote_call_duration_seconds_bucket", outcome="ok", le="0.025") == 0
    assert delta("dispatch_remote_call_duration_seconds_bucket", outcome="ok", le="5.0") == 1


# --- background loops -----------------------------------------------------------------------


async def test_a_failing_background_loop_is_counted_by_its_name(monkeypatch: pytest.MonkeyPatch, db: None) -> None:
    before = await scrape()
    failed = asyncio.Event()

    def reap_fails() -> None:
        failed.set()
        raise RuntimeError("the reaper broke")

    errors = "dispatch_background_loop_errors_total"

    async def counted() -> bool:
        return value(await scrape(), errors, loop="reaper") - value(before, errors, loop="reaper") >= 1

    monkeypatch.setattr(background, "reap_once", reap_fails)
    reaper = asyncio.ensure_future(background.reaper_loop())
    try:
        await asyncio.wait_for(failed.wait(), 5)
        # Counted once the failure is back on the loop, a moment after reap_once raised.
        await eventually(counted, timeout=5, interval=0.01, what="the reaper's failure counted")
    finally:
        reaper.cancel()
        await asyncio.gather(reaper, return_exceptions=True)


def test_a_loop_named_with_an_id_is_counted_under_its_fixed_metric_name(db: None) -> None:
    before = scrape_sync()
    LoopHealth("the tool-change relay of user 7", metric_name="tool-change relay").failed(RuntimeError("x"))
    after = scrape_sync()
    errors = "dispatch_background_loop_errors_total"
    assert value(after, errors, loop="tool-change relay") - value(before, errors, loop="tool-change relay") == 1
    assert value(after, errors, loop="the tool-change relay of user 7") == 0


# --- access ---------------------------------------------------------------------------------


def error_of(response: Any) -> dict[str, Any]:
    assert response["Content-Type"] == "application/json", response.content
    body: dict[str, Any] = response.json()
    assert set(body["error"]) == {"code", "message", "details"}
    return body["error"]


def test_loopback_reads_without_a_token_by_default(db: None) -> None:
    assert Client().get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
    assert Client().get("/metrics", REMOTE_ADDR="::1").status_code == 200
    # A dual-stack listener shows an IPv4 client as an IPv4-mapped IPv6 address.
    assert Client().get("/metrics", REMOTE_ADDR="::ffff:127.0.0.1").status_code == 200


def test_another_address_without_a_token_is_refused_401(db: None) -> None:
    response = Client().get("/metrics", REMOTE_ADDR=OUTSIDE)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
    assert error_of(response)["code"] == "NOT_AUTHENTICATED"
    assert b"dispatch_" not in response.content
    # A forwarded header claiming loopback changes nothing: only the TCP peer counts.
    forwarded = Client().get("/metrics", REMOTE_ADDR=OUTSIDE, HTTP_X_FORWARDED_FOR="127.0.0.1")
    assert forwarded.status_code == 401


def test_a_staff_users_token_reads_from_any_address(owner: Any, owner_token: str) -> None:
    assert owner.is_staff
    response = Client().get("/metrics", REMOTE_ADDR=OUTSIDE, HTTP_AUTHORIZATION=f"Bearer {owner_token}")
    assert response.status_code == 200
    assert "dispatch_remote_calls" in families(response.content.decode())


def test_a_token_of_a_user_who_is_not_staff_is_refused_403(member: Any, member_token: str) -> None:
    response = Client().get("/metrics", REMOTE_ADDR=OUTSIDE, HTTP_AUTHORIZATION=f"Bearer {member_token}")
    assert response.status_code == 403
    assert error_of(response)["code"] == "PERMISSION_DENIED"


def test_an_unknown_token_is_refused_401(db: None) -> None:
    response = Client().get("/metrics", REMOTE_ADDR=OUTSIDE, HTTP_AUTHORIZATION="Bearer not-a-token")
    assert response.status_code == 401
    assert error_of(response)["code"] == "AUTHENTICATION_FAILED"


def test_an_agent_token_is_refused_403_even_of_a_staff_users_agent(owner: Any, tmp_path: Any) -> None:
    agent = agent_create(owner=owner, type="expert", name="helper", cwd=str(tmp_path))
    Agent.objects.filter(pk=agent.pk).update(status="running")
    raw = agent_token_mint(agent=agent)
    response = Client().get("/metrics", REMOTE_ADDR=OUTSIDE, HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert response.status_code == 403
    assert error_of(response)["code"] == "PERMISSION_DENIED"


def test_the_allow_list_is_the_setting(db: None, settings: Any) -> None:
    settings.METRICS_ALLOW = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8::/32")]
    assert Client().get("/metrics", REMOTE_ADDR="10.20.30.40").status_code == 200
    assert Client().get("/metrics", REMOTE_ADDR="2001:db8::5").status_code == 200
    assert Client().get("/metrics", REMOTE_ADDR="11.0.0.1").status_code == 401
    assert Client().get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 401  # loopback no longer listed
    settings.METRICS_ALLOW = []
    assert Client().get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 401


def test_only_get_and_head_are_answered(db: None) -> None:
    assert Client().head("/metrics").status_code == 200
    response = Client(enforce_csrf_checks=True).post("/metrics")  # 405 in the API's shape, not a CSRF page
    assert response.status_code == 405
    assert response["Allow"] == "GET, HEAD"
    assert error_of(response)["code"] == "METHOD_NOT_ALLOWED"


# --- the setting ----------------------------------------------------------------------------


@pytest.fixture
def allow_variable(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def set_to(text: str | None) -> list[Any]:
        if text is None:
            monkeypatch.delenv("DISPATCH_METRICS_ALLOW", raising=False)
        else:
            monkeypatch.setenv("DISPATCH_METRICS_ALLOW", text)
        return env_networks("DISPATCH_METRICS_ALLOW", ["127.0.0.0/8", "::1"])

    yield set_to


def test_the_allow_variable_reads_addresses_and_networks(allow_variable: Any) -> None:
    loopback = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1")]
    assert allow_variable(None) == loopback
    assert allow_variable("") == []
    assert allow_variable(" 10.0.0.0/8, 192.0.2.7 ,fd00::/8") == [
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("192.0.2.7/32"),
        ipaddress.ip_network("fd00::/8"),
    ]


@pytest.mark.parametrize("text", ["10.0.0.5/8", "localhost", "10.0.0.0/33", "127.0.0.1,nope"])
def test_a_bad_allow_variable_stops_the_start_naming_it(allow_variable: Any, text: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="DISPATCH_METRICS_ALLOW"):
        allow_variable(text)
