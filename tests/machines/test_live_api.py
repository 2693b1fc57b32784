"""The live-operation REST edges (docs/live-operations.md), with the services replaced:
what each route validates, what it calls, and the exact wire it answers — the JSON
errors before a stream, the server-sent events of a stream, and the cancel a client
causes by closing one. The same routes against real shims: tests/integration/test_live_edges.py.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from django.test import AsyncClient

from machines import api as machines_api
from machines.services import live
from machines.services.errors import MachineError

pytestmark = pytest.mark.django_db(transaction=True)

OPS = "/api/v1/sessions/s1/ops"
RID = "3f2b9c1e-8d4a-4c3b-9f00-5e6d7c8b9a01"


class Api:
    """An ``AsyncClient`` speaking JSON with a bearer token."""

    def __init__(self, token: str) -> None:
        self.client = AsyncClient()
        self.headers = {"authorization": f"Bearer {token}"}

    async def get(self, path: str) -> Any:
        return await self.client.get(path, headers=self.headers)

    async def post(self, path: str, body: Any = None) -> Any:
        data = json.dumps(body if body is not None else {})
        return await self.client.post(path, data, content_type="application/json", headers=self.headers)


@pytest.fixture
def api(owner_token: str) -> Api:
    return Api(owner_token)


def events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``(event, data)`` of each server-sent event in ``text`` (comments skipped)."""
    found = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        fields = dict(line.split(": ", 1) for line in lines)
        assert set(fields) == {"event", "data"}, block
        found.append((fields["event"], json.loads(fields["data"])))
    return found


async def body_of(response: Any) -> str:
    return b"".join([chunk async for chunk in response.streaming_content]).decode()


def started(machine: str = "m1", name: str = "laptop") -> live.Started:
    return live.Started(request_id=RID, machine_id=machine, name=name)


def output(data: str, seq: int, machine: str = "m1", name: str = "laptop") -> live.Output:
    return live.Output(
        request_id=RID, machine_id=machine, name=name, stream="stdout", data=data, encoding="utf-8", seq=seq
    )


def result(machine: str = "m1", name: str = "laptop", exit_code: int = 0) -> live.Result:
    payload = {"exit_code": exit_code, "stdout": "", "stderr": "", "stdout_bytes": 6, "cancelled": False}
    return live.Result(request_id=RID, machine_id=machine, name=name, type="COMMAND_RESULT", payload=payload)


class FakeStream:
    """``operation_stream`` replaced: records its arguments, yields ``events`` (an exception
    in the list is raised there), then waits on ``hold`` if given; ``closed`` is set when
    the generator is closed (the service's cancel point)."""

    def __init__(self, events: list[Any], hold: bool = False) -> None:
        self.events = events
        self.hold = hold
        self.calls: list[dict[str, Any]] = []
        self.closed = asyncio.Event()

    def __call__(self, **kwargs: Any) -> AsyncIterator[live.LiveEvent]:
        self.calls.append(kwargs)
        return self._run()

    async def _run(self) -> AsyncIterator[live.LiveEvent]:
        try:
            for event in self.events:
                if isinstance(event, BaseException):
                    raise event
                yield event
            if self.hold:
                await asyncio.Event().wait()
        finally:
            self.closed.set()


@pytest.fixture
def stream(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    fake = FakeStream([started(), output("hello\n", 0), result()])
    monkeypatch.setattr(live, "operation_stream", fake)
    return fake


async def test_a_streamed_command_answers_started_output_and_result_as_server_sent_events(api, stream):
    response = await api.post(OPS, {"op": "EXECUTE_COMMAND", "payload": {"argv": ["echo"]}, "stream": True})
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream; charset=utf-8"
    # X-Accel-Buffering is added at the ASGI edge (dispatch.sse): tests/dispatch/test_behind_proxy.py
    assert response["Cache-Control"] == "no-cache"
    events = events_of(await body_of(response))
    assert [name for name, _ in events] == ["started", "output", "result"]
    assert events[0][1] == {"request_id": RID, "machine_id": "m1", "name": "laptop"}
    assert events[1][1] == {
        "request_id": RID,
        "machine_id": "m1",
        "name": "laptop",
        "stream": "stdout",
        "data": "hello\n",
        "encoding": "utf-8",
        "seq": 0,
    }
    assert events[2][1]["type"] == "COMMAND_RESULT" and events[2][1]["payload"]["exit_code"] == 0
    [call] = stream.calls
    assert call["op"] == "EXECUTE_COMMAND" and call["session_id"] == "s1" and call["caller"] == "api"
    assert call["target_machines"] is None and call["request_id"] is None
    assert stream.closed.is_set()


async def test_a_streamed_fan_out_names_each_machine_then_sends_done_with_every_result(api, monkeypatch):
    unreachable = live.Failed(
        request_id=RID, machine_id="m2", name="buildbox", code="MACHINE_UNREACHABLE", message="gone", details={}
    )
    fake = FakeStream([started(), unreachable, output("hi\n", 0), result()])
    monkeypatch.setattr(live, "operation_stream", fake)
    body = {"op": "EXECUTE_COMMAND", "payload": {"argv": ["x"]}, "stream": True, "target_machines": "*"}
    response = await api.post(OPS, {**body, "request_id": RID.upper()})
    events = events_of(await body_of(response))
    assert [name for name, _ in events] == ["started", "error", "output", "result", "done"]
    assert events[1][1]["code"] == "MACHINE_UNREACHABLE" and events[1][1]["name"] == "buildbox"
    assert events[-1][1] == {
        "results": [
            {
                "machine_id": "m2",
                "name": "buildbox",
                "ok": False,
                "error": {"code": "MACHINE_UNREACHABLE", "message": "gone", "details": {}},
            },
            {"machine_id": "m1", "name": "laptop", "ok": True, "result": {"machine_id": "m1", **_typed(result())}},
        ]
    }
    assert fake.calls[0]["target_machines"] == "*"
    assert fake.calls[0]["request_id"] == RID  # canonical form


def _typed(event: live.Result) -> dict[str, Any]:
    return {"type": event.type, "payload": event.payload}


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (MachineError("MACHINE_NOT_ATTACHED", "no machine is attached"), 404),
        (MachineError("UNSUPPORTED_OPERATION", "machine 'laptop' runs shim 0.1.0 (protocol 2.0)"), 409),
        (MachineError("OPERATION_EXISTS", "already in flight"), 409),
    ],
)
async def test_an_error_before_the_first_event_is_a_json_error_not_a_stream(api, monkeypatch, error, status):
    fake = FakeStream([error])
    monkeypatch.setattr(live, "operation_stream", fake)
    response = await api.post(OPS, {"op": "EXECUTE_COMMAND", "payload": {"argv": ["x"]}, "stream": True})
    assert response.status_code == status
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"error": {"code": error.code, "message": error.message, "details": {}}}
    assert fake.closed.is_set()


async def test_an_error_after_the_first_event_is_an_error_event(api, monkeypatch):
    monkeypatch.setattr(live, "operation_stream", FakeStream([started(), MachineError("OUTPUT_LOST", "lost")]))
    response = await api.post(OPS, {"op": "EXECUTE_COMMAND", "payload": {"argv": ["x"]}, "stream": True})
    events = events_of(await body_of(response))
    assert events[-1] == (
        "error",
        {"request_id": RID, "machine_id": None, "name": None, "code": "OUTPUT_LOST", "message": "lost", "details": {}},
    )


async def test_closing_the_stream_closes_the_services_iterator(api, monkeypatch):
    fake = FakeStream([started()], hold=True)
    monkeypatch.setattr(live, "operation_stream", fake)
    response = await api.post(OPS, {"op": "EXECUTE_COMMAND", "payload": {"argv": ["sleep"]}, "stream": True})
    chunks = response.streaming_content
    first = await anext(chunks)
    assert events_of(first.decode())[0][0] == "started"
    assert not fake.closed.is_set()
    reading = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0.05)
    reading.cancel()  # the ASGI handler cancels the response when the client disconnects
    await asyncio.gather(reading, return_exceptions=True)
    await chunks.aclose()
    async with asyncio.timeout(2):
        await fake.closed.wait()


async def test_a_silent_stream_sends_keep_alive_comments(api, monkeypatch):
    monkeypatch.setattr(machines_api, "KEEPALIVE_SECONDS", 0.05)
    monkeypatch.setattr(live, "operation_stream", FakeStream([started()], hold=True))
    response = await api.post(OPS, {"op": "EXECUTE_COMMAND", "payload": {"argv": ["sleep"]}, "stream": True})
    chunks = response.streaming_content
    await anext(chunks)
    assert await anext(chunks) == b": keep-alive\n\n"
    await chunks.aclose()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"op": "FILE_STAT", "payload": {"path": "/x"}, "target_machine": "a", "target_machines": ["b"]},
            "target_machine and target_machines are exclusive: give one of them",
        ),
        ({"op": "FILE_STAT", "payload": {"path": "/x"}, "stream": True}, "stream: true is for EXECUTE_COMMAND only"),
        ({"op": "EXECUTE_COMMAND", "stream": "yes"}, "stream must be true or false"),
        ({"op": "EXECUTE_COMMAND", "request_id": "42"}, "request_id must be a UUID"),
        ({"op": "EXECUTE_COMMAND", "request_id": 42}, "request_id must be a string"),
        ({"op": 3}, "op must be a string"),
        ({"payload": {}}, "op is required"),
        ({"op": "FILE_STAT", "payload": [], "target_machine": "a"}, "payload must be an object"),
        ({"op": "FILE_STAT", "payload": {"path": "/x"}, "target_machine": 3}, "target_machine must be a string"),
        ({"op": "EXECUTE_COMMAND", "target_machines": []}, "target_machines must be a non-empty list"),
        ({"op": "EXECUTE_COMMAND", "target_machines": "all"}, "target_machines must be a non-empty list"),
        ({"op": "EXECUTE_COMMAND", "target_machines": ["a", ""]}, "target_machines entries must be non-empty"),
        ({"op": "EXECUTE_COMMAND", "target_machines": ["a", "a"]}, "target_machines names a machine twice"),
    ],
)
async def test_bad_live_fields_are_refused_with_400_naming_the_field(api, stream, body, message):
    response = await api.post(OPS, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "INVALID_REQUEST" and error["message"].startswith(message), error
    assert stream.calls == []


async def test_a_fan_out_without_stream_answers_the_per_machine_results(api, monkeypatch):
    calls: list[dict[str, Any]] = []

    async def machine_op(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return {"results": [{"machine_id": "m1", "name": "laptop", "ok": False, "error": {"code": "X", "message": ""}}]}

    monkeypatch.setattr(machines_api, "machine_op", machine_op)
    body = {"op": "FILE_STAT", "payload": {"path": "/x"}, "target_machines": ["laptop"], "request_id": RID}
    response = await api.post(OPS, body)
    assert response.status_code == 200
    assert response.json()["results"][0]["name"] == "laptop"
    assert calls[0]["target_machines"] == ["laptop"] and calls[0]["request_id"] == RID
    assert calls[0]["target_machine"] is None


# --- cancel, in flight --------------------------------------------------------------------------


async def test_cancel_answers_202_with_the_services_answer(api, monkeypatch):
    calls: list[dict[str, Any]] = []

    async def cancel_operation(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return {"request_id": kwargs["request_id"], "cancelled": True}

    monkeypatch.setattr(live, "cancel_operation", cancel_operation)
    response = await api.post(f"{OPS}/{RID.upper()}/cancel")
    assert response.status_code == 202
    assert response.json() == {"request_id": RID, "cancelled": True}
    assert calls[0]["session_id"] == "s1" and calls[0]["request_id"] == RID


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (MachineError("OPERATION_NOT_FOUND", "no operation in flight"), 404),
        (MachineError("UNSUPPORTED_OPERATION", "protocol 2.0"), 409),
    ],
)
async def test_cancel_maps_the_services_errors(api, monkeypatch, error, status):
    async def cancel_operation(**kwargs: Any) -> dict[str, Any]:
        raise error

    monkeypatch.setattr(live, "cancel_operation", cancel_operation)
    response = await api.post(f"{OPS}/{RID}/cancel")
    assert response.status_code == status
    assert response.json()["error"]["code"] == error.code


async def test_cancel_refuses_a_request_id_that_is_not_a_uuid(api, monkeypatch):
    monkeypatch.setattr(live, "cancel_operation", None)  # never reached
    response = await api.post(f"{OPS}/not-a-uuid/cancel")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("request_id must be a UUID")
    assert (await api.client.get(f"{OPS}/{RID}/cancel", headers=api.headers)).status_code == 405


async def test_get_ops_lists_the_operations_in_flight_of_the_session(api, owner, monkeypatch):
    row = {
        "request_id": RID,
        "session_id": "s1",
        "kind": "command",
        "op": "EXECUTE_COMMAND",
        "machine_ids": ["m1"],
        "machines": ["laptop"],
        "summary": "sleep 30",
        "caller": "api",
        "started_at": "2026-12-02T17:00:00+00:00",
    }
    seen: list[dict[str, Any]] = []

    def operations_in_flight(**kwargs: Any) -> list[dict[str, Any]]:
        seen.append(kwargs)
        return [row]

    monkeypatch.setattr(live, "operations_in_flight", operations_in_flight)
    response = await api.get(OPS)
    assert response.status_code == 200
    assert response.json() == {"operations": [row]}
    assert seen == [{"user": owner, "session_id": "s1"}]
    assert (await AsyncClient().get(OPS)).status_code == 401
    assert (await api.get("/api/v1/sessions/.bad/ops")).status_code == 400


# --- pipe, copy ------------------------------------------------------------------------------------


async def test_pipe_validates_both_ends_and_answers_the_services_result(api, monkeypatch):
    calls: list[dict[str, Any]] = []

    async def pipe(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return {"request_id": RID, "bytes": 3, "source": {"exit_code": 0}, "destination": {"exit_code": 0}}

    monkeypatch.setattr(live, "pipe", pipe)
    body = {"source": {"machine": "a", "argv": ["cat", "x"]}, "destination": {"machine": "b", "command": "wc -c"}}
    response = await api.post("/api/v1/sessions/s1/pipe", {**body, "timeout_seconds": 30})
    assert response.status_code == 200 and response.json()["bytes"] == 3
    assert calls[0]["source"] == body["source"] and calls[0]["destination"] == body["destination"]
    assert calls[0]["timeout_seconds"] == 30.0 and calls[0]["caller"] == "api"
    for bad, message in [
        ({"destination": body["destination"]}, "source is required"),
        ({**body, "source": {"machine": "a"}}, "source needs argv"),
        ({**body, "source": {"machine": "a", "argv": ["x"], "command": "y"}}, "source needs argv"),
        ({**body, "destination": {"machine": "", "argv": ["x"]}}, "destination.machine is required"),
        ({**body, "destination": {"machine": "b", "argv": ["x"], "stdin": "x"}}, "destination has unknown fields"),
        ({**body, "destination": {"machine": "b", "argv": ["x"], "env": {"A": 1}}}, "destination.env must be"),
        ({**body, "timeout_seconds": 0}, "timeout_seconds must be a number of seconds greater than 0"),
        ({**body, "timeout_seconds": 10**8}, "timeout_seconds must be a number of seconds greater than 0"),
        ({**body, "timeout_seconds": True}, "timeout_seconds must be a number"),
        ({**body, "request_id": 42}, "request_id must be a string"),
    ]:
        refused = await api.post("/api/v1/sessions/s1/pipe", bad)
        assert refused.status_code == 400, bad
        assert refused.json()["error"]["message"].startswith(message), refused.json()
    assert len(calls) == 1


async def test_a_streamed_copy_sends_progress_then_its_result(api, monkeypatch):
    async def copy(**kwargs: Any) -> dict[str, Any]:
        for done in (0, 1024, 2048):
            await kwargs["on_progress"](done, 2048)
            await asyncio.sleep(0.01)
        return {"size_bytes": 2048, "sha256": "ab" * 32}

    monkeypatch.setattr(machines_api, "copy_between_machines", copy)
    body = {
        "source_machine": "a",
        "source_path": "/x",
        "destination_machine": "b",
        "destination_path": "/y",
        "stream": True,
        "request_id": RID,
    }
    response = await api.post("/api/v1/sessions/s1/copy", body)
    assert response["Content-Type"] == "text/event-stream; charset=utf-8"
    events = events_of(await body_of(response))
    assert events[-1] == ("result", {"request_id": RID, "size_bytes": 2048, "sha256": "ab" * 32})
    progress = [data for name, data in events if name == "progress"]
    assert progress[-1] == {"request_id": RID, "bytes_done": 2048, "bytes_total": 2048}
    assert all(data["bytes_total"] == 2048 for data in progress)


async def test_closing_a_streamed_copy_cancels_it(api, monkeypatch):
    cancelled = asyncio.Event()

    async def copy(**kwargs: Any) -> dict[str, Any]:
        await kwargs["on_progress"](0, 10)
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        return {}

    monkeypatch.setattr(machines_api, "copy_between_machines", copy)
    body = {"source_machine": "a", "source_path": "/x", "destination_machine": "b", "destination_path": "/y"}
    response = await api.post("/api/v1/sessions/s1/copy", {**body, "stream": True})
    chunks = response.streaming_content
    name, data = events_of((await anext(chunks)).decode())[0]
    assert name == "progress" and uuid.UUID(data["request_id"])
    reading = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0.05)
    reading.cancel()  # the ASGI handler cancels the response when the client disconnects
    await asyncio.gather(reading, return_exceptions=True)
    async with asyncio.timeout(2):
        await cancelled.wait()


async def test_a_failed_streamed_copy_ends_with_an_error_event(api, monkeypatch):
    async def copy(**kwargs: Any) -> dict[str, Any]:
        kwargs["on_started"]()
        raise MachineError("PATH_NOT_FOUND", "/x does not exist on 'a'")

    monkeypatch.setattr(machines_api, "copy_between_machines", copy)
    body = {"source_machine": "a", "source_path": "/x", "destination_machine": "b", "destination_path": "/y"}
    response = await api.post("/api/v1/sessions/s1/copy", {**body, "stream": True, "request_id": RID})
    assert events_of(await body_of(response)) == [
        (
            "error",
            {"request_id": RID, "code": "PATH_NOT_FOUND", "message": "/x does not exist on 'a'", "details": {}},
        )
    ]


async def test_a_streamed_copy_refused_before_it_starts_is_a_json_error(api):
    """No machine attached: the same 404 JSON error as without ``stream`` (not 200 + an
    ``error`` event)."""
    body = {"source_machine": "a", "source_path": "/x", "destination_machine": "b", "destination_path": "/y"}
    plain = await api.post("/api/v1/sessions/s1/copy", body)
    streamed = await api.post("/api/v1/sessions/s1/copy", {**body, "stream": True})
    assert plain.status_code == 404 and plain.json()["error"]["code"] == "MACHINE_NOT_ATTACHED"
    assert streamed.status_code == plain.status_code
    assert streamed["Content-Type"].startswith("application/json")
    assert streamed.json() == plain.json()


COPY = {"source_machine": "a", "source_path": "/x", "destination_machine": "b", "destination_path": "/y"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "source_machine is required"),  # the fields in order: the first one named
        ({**COPY, "source_path": 3}, "source_path must be a string"),
        ({**COPY, "destination_machine": None}, "destination_machine must be a string"),
        ({**COPY, "destination_path": ""}, "destination_path must be a non-empty string"),
        ({**COPY, "overwrite": "yes"}, "overwrite must be true or false"),
        ({**COPY, "stream": 1}, "stream must be true or false"),
        ({**COPY, "request_id": 42}, "request_id must be a string"),
    ],
)
async def test_a_bad_copy_body_is_refused_naming_its_field(api, monkeypatch, body, message):
    async def never(**kwargs: Any) -> dict[str, Any]:
        raise AssertionError("not called")

    monkeypatch.setattr(machines_api, "copy_between_machines", never)
    refused = await api.post("/api/v1/sessions/s1/copy", body)
    assert refused.status_code == 400
    assert refused.json()["error"] == {"code": "INVALID_REQUEST", "message": message, "details": {}}


async def test_copy_refuses_target_machines_and_pipe_refuses_unknown_top_level_fields(api, monkeypatch):
    async def never(**kwargs: Any) -> dict[str, Any]:
        raise AssertionError("not called")

    monkeypatch.setattr(machines_api, "copy_between_machines", never)
    monkeypatch.setattr(machines_api.live, "pipe", never)
    copy = {"source_machine": "a", "source_path": "/x", "destination_machine": "b", "destination_path": "/y"}
    for name, value in (("target_machines", ["a", "b"]), ("target_machine", "a")):
        refused = await api.post("/api/v1/sessions/s1/copy", {**copy, name: value})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "INVALID_REQUEST"
        assert error["message"] == f"copy takes source_machine and destination_machine, not {name}"
    pipe = {"source": {"machine": "a", "argv": ["cat"]}, "destination": {"machine": "b", "argv": ["wc"]}}
    for extra in ({"stream": True}, {"target_machines": ["a"], "stream": False}):
        refused = await api.post("/api/v1/sessions/s1/pipe", {**pipe, **extra})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "INVALID_REQUEST"
        assert error["message"] == f"the pipe has unknown fields: {', '.join(sorted(extra))}"
