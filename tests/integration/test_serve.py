"""One real ``manage.py serve`` (SQLite, in-memory channel layer) driven over real sockets.

docs/ws-protocol.md (the ``/ws`` session and remotes), docs/deployment.md#what-runs-where.
Every test talks to subprocesses, never to the test database. Most tests share one server
(``live``); the ones that stop or kill a server start their own instance.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from examples.weather_service import get_forecast
from tests.infra import PYTHON, Instance, Server, instance, wait_until
from tests.live_clients import LiveSession

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MiB = 1024 * 1024
AUTH_TIMEOUT = 1  # DISPATCH_WS_AUTH_TIMEOUT of the shared instance, seconds


@dataclass
class Live:
    instance: Instance
    server: Server
    token: str  # an API token of ``admin``


@pytest.fixture(scope="module")
def shared() -> Iterator[Live]:
    with instance(DISPATCH_WS_AUTH_TIMEOUT=AUTH_TIMEOUT) as inst:
        server = inst.serve()
        yield Live(instance=inst, server=server, token=inst.admin_token)


@pytest.fixture
def live(shared: Live) -> Iterator[Live]:
    """The shared server; after the test, every remote it connected has gone with its session."""
    yield shared
    assert shared.server.running, shared.server.log()
    wait_until(
        lambda: shared.server.remote_names(shared.token) == [],
        timeout=5,
        what="the remotes of closed sessions to disconnect",
    )


def connect_body(remotename: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {"remotename": remotename, "tools": tools}


def call_body(remotename: str, city: str) -> dict[str, Any]:
    return {"remotename": remotename, "function": "get_forecast", "args": {"city": city}}


def ping_frame(size: int) -> str:
    """A ``ping`` request padded to exactly ``size`` bytes of JSON text."""
    head, tail = '{"action": "ping", "nonce": 1, "body": {"pad": "', '"}}'
    frame = head + "x" * (size - len(head) - len(tail)) + tail
    assert len(frame.encode()) == size
    return frame


# --- the README walkthrough -------------------------------------------------------------


def test_the_readme_walkthrough_serves_and_calls_the_weather_service(live: Live) -> None:
    server, token = live.server, live.instance.token("admin")  # manage.py issue_token admin
    connection = ["--url", server.ws_url, "--token", token]
    serving = live.instance.spawn(
        [PYTHON, "-m", "remotes.client", "serve", "examples/weather_service.py:remote", *connection],
        name="weather-service",
    )
    try:

        def forecast_call() -> Any:
            done = live.instance.client("call", "weather-service", "get_forecast", '{"city": "Rome"}', *connection)
            if done.returncode == 0:
                return done
            assert serving.running, f"the remote's client exited:\n{serving.log()}"
            # Until the client has registered, the only acceptable failure:
            assert done.returncode == 1 and "no connected remote named 'weather-service'" in done.stderr, done
            return None

        done = wait_until(forecast_call, timeout=10, interval=0.2, what="the weather-service remote to answer")
        assert json.loads(done.stdout) == get_forecast("Rome")

        listed = live.instance.client("list", *connection)
        assert listed.returncode == 0, listed
        [function] = json.loads(listed.stdout)
        assert (function["remotename"], function["name"]) == ("weather-service", "get_forecast")
        assert function["parameters"]["required"] == ["city"]

        unknown = live.instance.client("call", "no-such-remote", "get_forecast", '{"city": "Rome"}', *connection)
        assert unknown.returncode == 1
        assert unknown.stdout == ""
        assert unknown.stderr.strip() == "error: no connected remote named 'no-such-remote'"
    finally:
        serving.stop()


# --- the wire -----------------------------------------------------------------------------


async def test_a_remote_call_crosses_real_sockets_in_the_documented_frames(
    live: Live, weather_tools: list[dict[str, Any]]
) -> None:
    ws_url, token = live.server.ws_url, live.token
    forecast = {"city": "Rome", "forecast": "sunny", "temperature_c": 21}
    async with LiveSession.open(ws_url, token) as serving, LiveSession.open(ws_url, token) as caller:
        # The frames of the README's "On the wire" section.
        connect = {"action": "remote-connect", "nonce": 1, "body": connect_body("weather-service", weather_tools)}
        await serving.send(connect)
        assert await serving.reply(1) == {"message": "remote connected", "remotename": "weather-service", "nonce": 1}

        await caller.send({"action": "remote-call", "nonce": "c1", "body": call_body("weather-service", "Rome")})
        first = await serving.next_event()
        request_id = first.pop("requestId")
        assert re.fullmatch(r"weather-service#[0-9]+", request_id)  # opaque (docs/ws-protocol.md#request-ids)
        assert first == {
            "action": "remote-call",
            "remotename": "weather-service",
            "function": "get_forecast",
            "args": {"city": "Rome"},
        }
        await serving.send({"action": "remote-call-result", "requestId": request_id, "result": forecast})
        assert await caller.reply("c1") == {"result": forecast, "nonce": "c1"}

        # The next call gets another request id; a result under ``body`` is accepted too.
        await caller.send({"action": "remote-call", "nonce": "n2", "body": call_body("weather-service", "Oslo")})
        second = await serving.next_event()
        assert second["requestId"].startswith("weather-service#") and second["requestId"] != request_id
        await serving.send({"action": "remote-call-result", "body": {"requestId": second["requestId"], "result": 3}})
        assert await caller.reply("n2") == {"result": 3, "nonce": "n2"}

        # remote-call-result gets no reply: the serving socket saw nothing but these frames.
        await serving.send({"action": "ping", "nonce": "p"})
        assert await serving.reply("p") == {"pong": True, "nonce": "p"}
        assert [frame.get("action", frame.get("message")) for frame in serving.frames] == [
            "remote connected",
            "remote-call",
            "remote-call",
            None,
        ]


async def test_it_closes_1009_on_a_frame_over_1_mib_through_daphne(live: Live) -> None:
    async with LiveSession.open(live.server.ws_url, live.token, max_size=None) as session:
        await session.send(ping_frame(MiB))  # exactly at the limit: answered
        assert await session.reply(1) == {"pong": True, "nonce": 1}

        await session.send(ping_frame(MiB + 1))
        assert await session.closed(timeout=5) == 1009
        assert session.frames == [{"pong": True, "nonce": 1}]


# --- authentication over a real socket -----------------------------------------------------


async def test_it_authenticates_a_first_frame_token_or_password(live: Live) -> None:
    async with LiveSession.open(live.server.ws_url) as session:
        await session.send({"token": live.token})
        assert await session.next_event() == {"ok": True, "user": "admin"}
        assert await session.request("remote-list") == {"remotes": [], "nonce": 1}

    async with LiveSession.open(live.server.ws_url) as session:
        await session.send({"username": "admin", "password": live.instance.admin_password})
        assert await session.next_event() == {"ok": True, "user": "admin"}
        assert await session.request("ping") == {"pong": True, "nonce": 1}


async def test_it_closes_4401_after_a_bad_first_frame_token(live: Live) -> None:
    async with LiveSession.open(live.server.ws_url) as session:
        await session.send({"token": live.token + "x"})
        assert await session.next_event() == {"error": "authentication failed"}
        assert await session.closed(timeout=5) == 4401


async def test_it_closes_4401_after_a_bad_header_token(live: Live) -> None:
    async with LiveSession.open(live.server.ws_url, "not-a-token") as session:
        assert await session.next_event() == {"error": "authentication failed"}
        assert await session.closed(timeout=5) == 4401


async def test_it_closes_4408_when_no_credentials_arrive_in_time(live: Live) -> None:
    async with LiveSession.open(live.server.ws_url) as session:
        assert await session.next_event(timeout=AUTH_TIMEOUT + 5) == {"error": "authentication timed out"}
        assert await session.closed(timeout=5) == 4408


# --- load ------------------------------------------------------------------------------------


# DISPATCH_REMOTE_CALLS_PER_SESSION's default: a session may have this many calls in flight
# (docs/operating.md#bounds); all of them are sent before the first reply is read.
CALLS_PER_SESSION = 64


async def test_a_busy_remote_answers_as_many_calls_in_flight_as_one_session_may_have(
    live: Live, weather_tools: list[dict[str, Any]]
) -> None:
    ws_url, token = live.server.ws_url, live.token
    async with LiveSession.open(ws_url, token) as serving, LiveSession.open(ws_url, token) as caller:
        connected = await serving.request("remote-connect", connect_body("busy-weather", weather_tools))
        assert connected["message"] == "remote connected"
        request_ids: list[str] = []

        async def answer_each_call_as_it_arrives() -> None:
            while True:
                call = await serving.next_event(timeout=30)
                request_ids.append(call["requestId"])
                result = {"city": call["args"]["city"], "requestId": call["requestId"]}
                await serving.send({"action": "remote-call-result", "requestId": call["requestId"], "result": result})

        answering = asyncio.create_task(answer_each_call_as_it_arrives())
        try:
            cities = {}
            for index in range(CALLS_PER_SESSION):  # all sent before the first reply is read
                cities[await caller.send_request("remote-call", call_body("busy-weather", f"city-{index}"))] = (
                    f"city-{index}"
                )
            replies = await asyncio.gather(*(caller.reply(nonce, timeout=20) for nonce in cities))
        finally:
            answering.cancel()

        for (nonce, city), reply in zip(cities.items(), replies, strict=True):
            assert reply.keys() == {"result", "nonce"}, reply  # no "rate limited", no other error
            assert reply["nonce"] == nonce and reply["result"]["city"] == city
        answered_ids = [reply["result"]["requestId"] for reply in replies]
        assert sorted(answered_ids) == sorted(request_ids)
        assert len(set(request_ids)) == CALLS_PER_SESSION and all(
            rid.startswith("busy-weather#") for rid in request_ids
        )

        pong = await caller.request("ping")
        assert caller.reply_counts == Counter({**dict.fromkeys(cities, 1), pong["nonce"]: 1})  # nothing duplicated


# --- health and the API -----------------------------------------------------------------------


async def test_healthz_and_the_remotes_api_describe_a_live_server(
    live: Live, weather_tools: list[dict[str, Any]]
) -> None:
    health = live.server.get("/healthz")
    assert health.status_code == 200
    body = health.json()
    assert body == {
        "status": "ok",
        "process_id": body["process_id"],
        "database": "ok",
        "database_writable": True,
        "channel_layer": "ok",
        "failing": [],
        "errors": {},
    }
    assert re.fullmatch(r"proc_[0-9a-f]{16}", body["process_id"])
    assert f"(process {body['process_id']}," in live.server.log()  # the serving process's own id

    async with LiveSession.open(live.server.ws_url, live.token) as serving:
        await serving.request("remote-connect", connect_body("weather-service", weather_tools))
        response = live.server.get("/api/v1/remotes", live.token)
        assert response.status_code == 200
        [remote] = response.json()["remotes"]
        assert remote["remotename"] == "weather-service"
        assert remote["functions"] == weather_tools
    assert live.server.get("/api/v1/remotes").status_code == 401


# Found by schemathesis: an empty multipart body (its closing boundary alone) on
# POST /api/v1/agents/{id}/messages, with an agent id it generated. twisted parsed the form
# before daphne and answered a bare "400 Bad Request" with no headers and no body.
SCHEMATHESIS_BOUNDARY = "e584996c2ee01d4debe27470e75f0d0b"
UNPARSABLE_FORMS = [
    (f"multipart/form-data; boundary={SCHEMATHESIS_BOUNDARY}", f"--{SCHEMATHESIS_BOUNDARY}--\r\n".encode()),
    ("multipart/form-data", b"content=hello"),  # no boundary at all
]


@pytest.mark.parametrize(("content_type", "body"), UNPARSABLE_FORMS, ids=["closing-boundary-only", "no-boundary"])
def test_a_form_body_twisted_cannot_parse_gets_the_api_error_shape(live: Live, content_type: str, body: bytes) -> None:
    headers = {"Authorization": f"Bearer {live.token}", "Content-Type": content_type}
    agent_id = "%F0%A9%88%90%C3%BB%0E%F3%BE%BC%8F%F1%8A%8C%86"  # schemathesis's agent id
    answers = {
        path: httpx.post(f"{live.server.url}{path}", headers=headers, content=body, timeout=10)
        for path in (f"/api/v1/agents/{agent_id}/messages", "/api/v1/agents")
    }
    for path, response in answers.items():
        assert response.headers.get("content-type") == "application/json", (path, response.headers)
        assert set(response.json()["error"]) == {"code", "message", "details"}, path
    # Django answered: the agent is looked up before the body is read (404); a launch reads
    # the form and refuses it (an empty form lacks the fields, a boundless one is unreadable).
    assert answers[f"/api/v1/agents/{agent_id}/messages"].status_code == 404
    launch = answers["/api/v1/agents"]
    assert launch.status_code == 400 and launch.json()["error"]["code"] in ("VALIDATION_ERROR", "INVALID_REQUEST")


# --- stopping and crashing -------------------------------------------------------------------


async def test_sigterm_fails_a_pending_call_closes_both_sockets_and_exits_0(
    weather_tools: list[dict[str, Any]],
) -> None:
    with instance() as inst:
        server, token = inst.serve(), inst.admin_token
        async with LiveSession.open(server.ws_url, token) as serving, LiveSession.open(server.ws_url, token) as caller:
            await serving.request("remote-connect", connect_body("weather-service", weather_tools))
            nonce = await caller.send_request("remote-call", call_body("weather-service", "Rome"))
            assert (await serving.next_event())["requestId"].startswith("weather-service#")  # pending, never answered

            signalled = time.monotonic()
            exit_code = await asyncio.to_thread(server.stop)
            elapsed = time.monotonic() - signalled

            reply = await caller.reply(nonce, timeout=1)
            assert reply["error"] in ("server shutting down", "remote 'weather-service' disconnected"), reply
            assert await caller.closed(timeout=1) in (1001, 1012)
            assert await serving.closed(timeout=1) in (1001, 1012)
        assert exit_code == 0, server.log()
        assert elapsed < 10


@pytest.mark.parametrize("reaper", ["dispatch_worker", "serve"])
async def test_a_killed_no_background_server_leaves_no_ghost_remote(
    reaper: str, weather_tools: list[dict[str, Any]]
) -> None:
    """Two servers on one SQLite file; the reaper runs in ``dispatch_worker`` or the other ``serve``."""
    with instance() as inst:
        doomed = inst.serve("--no-background", wait=False)
        survivor = inst.serve(*(["--no-background"] if reaper == "dispatch_worker" else []), wait=False)
        if reaper == "dispatch_worker":
            inst.worker()
        doomed.wait_healthy(), survivor.wait_healthy()
        token = inst.admin_token
        async with LiveSession.open(doomed.ws_url, token) as serving:
            await serving.request("remote-connect", connect_body("weather-service", weather_tools))
            assert survivor.remote_names(token) == ["weather-service"]  # one registry: the database

            await asyncio.to_thread(doomed.kill)
            await serving.closed(timeout=5)

        wait_until(
            lambda: survivor.remote_names(token) == [],
            timeout=10,
            what="the dead process's remote to be reaped",
            details=lambda: "\n".join(process.log() for process in [survivor, *inst.processes]),
        )
        assert survivor.running


def test_it_warns_when_the_public_url_names_another_local_port() -> None:
    with instance(DISPATCH_PUBLIC_URL="http://127.0.0.1:9") as inst:
        server = inst.serve()
        server.wait_for_log("Warning: DISPATCH_PUBLIC_URL is http://127.0.0.1:9", timeout=10)
    with instance(DISPATCH_PUBLIC_URL="https://dispatch.example.org") as inst:  # a real name: no warning
        server = inst.serve()
        assert "Warning: DISPATCH_PUBLIC_URL" not in server.log()
