"""Live operations through the REST edge for real (docs/live-operations.md): ``manage.py
serve`` and real shim subprocesses, driven by an HTTP client reading the server-sent events.

Streaming (started, output as it happens, result), cancel by the route and by closing the
stream (the command's process is gone, nothing left in flight, the file it would have
written never appears), fan-out with one machine unreachable, a pipe whose destination
exits first, a streamed copy's progress, and a protocol 2.0 shim refusing the new features
clearly. One server for the module; each test has its own session and shims.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.infra import PYTHON, Instance, Server, ShimProcess, instance, wait_until
from tests.live_clients import MachineApi, api_error

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MiB = 1024 * 1024
# A shim that speaks protocol 2.0: the version patched where the shim reads it, then its CLI.
SHIM_2_0 = (
    "import machines.shim.protocol as p, machines.shim.connection as c; "
    "p.PROTOCOL_VERSION = c.PROTOCOL_VERSION = '2.0'; "
    "import runpy; runpy.run_module('machines.shim', run_name='__main__', alter_sys=True)"
)


@dataclass
class Live:
    instance: Instance
    server: Server
    api: MachineApi


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with instance() as inst:
        server = inst.serve()
        api = MachineApi(server.url, inst.token("admin"))
        try:
            yield Live(instance=inst, server=server, api=api)
        finally:
            api.client.close()


@dataclass
class Rig:
    live: Live
    session: str
    tmp_path: Path
    shims: list[ShimProcess] = field(default_factory=list)

    @property
    def api(self) -> MachineApi:
        return self.live.api

    @property
    def ops(self) -> str:
        return f"/api/v1/sessions/{self.session}/ops"

    def root(self, name: str) -> Path:
        root = self.tmp_path / f"root-{name}"
        root.mkdir(exist_ok=True)
        return root

    def shim(self, name: str, *flags: str, protocol_2_0: bool = False) -> ShimProcess:
        inst = self.live.instance
        args = ["--session", self.session, *flags]
        if not protocol_2_0:
            shim = inst.shim(name, self.root(name), *args, state_dir=self.tmp_path / f"state-{name}")
        else:
            state_dir = self.tmp_path / f"state-{name}"
            command = [PYTHON, "-c", SHIM_2_0, "run", "--server", self.live.server.url, "--state-dir", str(state_dir)]
            command += ["--token", inst.admin_token, "--root", str(self.root(name)), "--name", name, *args]
            started = inst.spawn(command, name=f"shim-{name}", DISPATCH_SHIM_BACKOFF_SCALE="0.05")
            shim = ShimProcess(proc=started.proc, log_path=started.log_path, state_dir=state_dir, name=name)
            shim.wait_connected()
        self.shims.append(shim)
        return shim

    def in_flight(self) -> list[dict[str, Any]]:
        response = self.api.client.get(self.ops)
        assert response.status_code == 200, response.text
        return list(response.json()["operations"])


@pytest.fixture
def rig(live: Live, tmp_path: Path) -> Iterator[Rig]:
    rig = Rig(live=live, session=f"le-{uuid.uuid4().hex[:10]}", tmp_path=tmp_path)
    try:
        yield rig
    finally:
        for shim in rig.shims:
            shim.terminate()
        for shim in rig.shims:
            shim.stop()
        assert live.server.running, live.server.log()


class EventStream:
    """A streamed ``POST`` read event by event (``event``, JSON ``data``) as the server
    writes them; ``close()`` drops the connection (what a client going away does)."""

    def __init__(self, api: MachineApi, path: str, body: dict[str, Any]) -> None:
        self.client = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api.token}"}, timeout=60)
        self.context = self.client.stream("POST", path, json=body)
        self.response = self.context.__enter__()
        self.lines = self.response.iter_lines()
        self.events: list[tuple[str, dict[str, Any], float]] = []
        self.started_at = time.monotonic()

    def next(self) -> tuple[str, dict[str, Any]] | None:
        """The next event (comments skipped), or ``None`` at the end of the stream."""
        fields: dict[str, str] = {}
        for line in self.lines:
            if not line:
                if fields:
                    event = (fields["event"], json.loads(fields["data"]))
                    self.events.append((*event, time.monotonic() - self.started_at))
                    return event
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
        return None

    def until(self, name: str) -> dict[str, Any]:
        while True:
            event = self.next()
            assert event is not None, f"the stream ended before a {name!r} event: {self.events}"
            if event[0] == name:
                return event[1]

    def rest(self) -> list[tuple[str, dict[str, Any]]]:
        found = []
        while (event := self.next()) is not None:
            found.append(event)
        return found

    def close(self) -> None:
        self.context.__exit__(None, None, None)
        self.client.close()


def audited(shim: ShimProcess, request_id: str) -> list[dict[str, Any]]:
    """The shim's audit records of operation ``request_id`` (written when it ended)."""
    return [record for record in shim.audit() if record.get("request_id") == request_id]


# --- streaming ------------------------------------------------------------------------------------


def test_a_streamed_command_sends_its_output_as_it_happens_then_the_result(rig: Rig) -> None:
    rig.shim("box")
    command = "for i in 1 2 3; do echo line$i; sleep 0.3; done; echo oops >&2"
    stream = EventStream(rig.api, rig.ops, {"op": "EXECUTE_COMMAND", "payload": {"command": command}, "stream": True})
    try:
        assert stream.response.status_code == 200
        assert stream.response.headers["content-type"].startswith("text/event-stream")
        assert stream.response.headers["x-accel-buffering"] == "no"
        started = stream.until("started")
        assert started["name"] == "box" and uuid.UUID(started["request_id"])
        events = stream.rest()
    finally:
        stream.close()
    outputs = [data for name, data in events if name == "output"]
    stdout = "".join(data["data"] for data in outputs if data["stream"] == "stdout")
    assert stdout == "line1\nline2\nline3\n"
    assert "".join(data["data"] for data in outputs if data["stream"] == "stderr") == "oops\n"
    assert [data["seq"] for data in outputs] == list(range(len(outputs)))
    assert all(data["request_id"] == started["request_id"] and data["name"] == "box" for data in outputs)
    name, result = events[-1]
    assert name == "result", events
    assert result["payload"]["exit_code"] == 0 and result["payload"]["cancelled"] is False
    assert result["payload"]["stdout_bytes"] == len(stdout)
    # The first line arrived while the command still ran (it takes ≥ 0.9 s).
    first_output = next(at for name, _, at in stream.events if name == "output")
    result_at = stream.events[-1][2]
    assert result_at - first_output > 0.5, stream.events
    wait_until(lambda: rig.in_flight() == [], timeout=5, what="the command to leave the in-flight list")


def test_a_command_is_cancelled_by_the_route_from_another_connection(rig: Rig) -> None:
    shim = rig.shim("box")
    marker = rig.root("box") / "marker"
    request_id = str(uuid.uuid4())
    body = {
        "op": "EXECUTE_COMMAND",
        "payload": {"command": f"echo begun; sleep 20; touch {marker}"},
        "stream": True,
        "request_id": request_id,
    }
    stream = EventStream(rig.api, rig.ops, body)
    try:
        stream.until("output")
        [row] = rig.in_flight()
        assert row["request_id"] == request_id and row["kind"] == "command" and row["machines"] == ["box"]
        cancelled = rig.api.client.post(f"{rig.ops}/{request_id}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        assert cancelled.json() == {"request_id": request_id, "cancelled": True}
        result = stream.until("result")
    finally:
        stream.close()
    assert result["payload"]["cancelled"] is True and result["payload"]["exit_code"] < 0
    # The row goes when the service finishes, just after the result event was written.
    wait_until(lambda: rig.in_flight() == [], timeout=5, what="the command to leave the in-flight list")
    [record] = wait_until(lambda: audited(shim, request_id), timeout=5, what="the shim's audit record")
    assert record["result"]["cancelled"] is True, record
    again = rig.api.client.post(f"{rig.ops}/{request_id}/cancel")
    assert (again.status_code, api_error(again)["code"]) == (404, "OPERATION_NOT_FOUND")
    assert not marker.exists()


def test_closing_the_stream_cancels_the_command(rig: Rig) -> None:
    shim = rig.shim("box")
    marker = rig.root("box") / "marker"
    body = {"op": "EXECUTE_COMMAND", "payload": {"command": f"echo begun; sleep 20; touch {marker}"}, "stream": True}
    stream = EventStream(rig.api, rig.ops, body)
    stream.until("output")
    assert len(rig.in_flight()) == 1
    stream.close()
    wait_until(lambda: rig.in_flight() == [], timeout=10, what="the command to leave the in-flight list")
    [record] = wait_until(
        lambda: [r for r in shim.audit() if r["op"] == "EXECUTE_COMMAND"], timeout=10, what="the audit record"
    )
    assert record["result"].get("cancelled") is True, record
    assert not marker.exists()


def test_a_request_id_in_flight_is_refused_and_a_bad_one_is_400(rig: Rig) -> None:
    rig.shim("box")
    request_id = str(uuid.uuid4())
    body = {"op": "EXECUTE_COMMAND", "payload": {"argv": ["sleep", "20"]}, "stream": True, "request_id": request_id}
    stream = EventStream(rig.api, rig.ops, body)
    try:
        stream.until("started")
        twice = rig.api.client.post(rig.ops, json=body)
        assert (twice.status_code, api_error(twice)["code"]) == (409, "OPERATION_EXISTS")
        bad = rig.api.client.post(rig.ops, json={**body, "request_id": "twelve"})
        assert (bad.status_code, api_error(bad)["code"]) == (400, "INVALID_REQUEST")
        assert rig.api.client.post(f"{rig.ops}/{request_id}/cancel").status_code == 202
        stream.until("result")
    finally:
        stream.close()


# --- fan-out --------------------------------------------------------------------------------------


def test_a_fan_out_with_one_machine_unreachable_has_one_failed_entry(rig: Rig) -> None:
    rig.shim("alpha"), rig.shim("beta")
    gone = rig.shim("gamma")
    gone.kill()
    body = {"op": "EXECUTE_COMMAND", "payload": {"argv": ["hostname"]}, "target_machines": ["alpha", "beta", "gamma"]}
    answer = rig.api.client.post(rig.ops, json=body)
    assert answer.status_code == 200, answer.text
    results = {entry["name"]: entry for entry in answer.json()["results"]}
    assert set(results) == {"alpha", "beta", "gamma"}
    assert results["alpha"]["ok"] and results["beta"]["ok"]
    assert results["alpha"]["result"]["payload"]["exit_code"] == 0
    assert not results["gamma"]["ok"]
    assert results["gamma"]["error"]["code"] in {"MACHINE_UNREACHABLE", "MACHINE_NOT_ATTACHED"}, results["gamma"]

    stream = EventStream(rig.api, rig.ops, {**body, "payload": {"command": "echo hi"}, "stream": True})
    try:
        events = stream.rest()
    finally:
        stream.close()
    assert events[-1][0] == "done"
    done = {entry["name"]: entry for entry in events[-1][1]["results"]}
    assert done["alpha"]["ok"] and done["beta"]["ok"] and not done["gamma"]["ok"]
    for name in ("alpha", "beta"):
        said = "".join(d["data"] for kind, d in events if kind == "output" and d["name"] == name)
        assert said == "hi\n", events
    assert [kind for kind, d in events if d.get("name") == "gamma"] == ["error"]


def test_star_runs_on_every_attached_machine(rig: Rig) -> None:
    rig.shim("alpha"), rig.shim("beta")
    body = {"op": "FILE_LIST", "payload": {"path": "."}, "target_machines": "*"}
    answer = rig.api.client.post(rig.ops, json=body)
    assert answer.status_code == 200, answer.text
    assert sorted(entry["name"] for entry in answer.json()["results"]) == ["alpha", "beta"]
    both = rig.api.client.post(rig.ops, json={**body, "target_machine": "alpha"})
    assert both.status_code == 400
    assert "exclusive" in api_error(both)["message"]


# --- pipe, copy -----------------------------------------------------------------------------------


def test_a_pipe_whose_destination_exits_first_stops_the_source(rig: Rig) -> None:
    rig.shim("source"), rig.shim("sink")
    body = {
        "source": {"machine": "source", "argv": ["yes", "dispatch"]},
        "destination": {"machine": "sink", "argv": ["head", "-c", "1000"]},
        "timeout_seconds": 30,
    }
    started = time.monotonic()
    answer = rig.api.client.post(f"/api/v1/sessions/{rig.session}/pipe", json=body)
    assert answer.status_code == 200, answer.text
    assert time.monotonic() - started < 15
    result = answer.json()
    assert result["destination"]["exit_code"] == 0
    assert result["destination"]["stdout"] == ("dispatch\n" * 112)[:1000]
    assert result["source"]["cancelled"] is True, result["source"]
    assert result["bytes"] >= 1000 and uuid.UUID(result["request_id"])
    wait_until(lambda: rig.in_flight() == [], timeout=5, what="the pipe to leave the in-flight list")


def test_a_streamed_copy_reports_progress_then_its_result(rig: Rig) -> None:
    rig.shim("source"), rig.shim("sink")
    data = os.urandom(3 * MiB + 7)
    (rig.root("source") / "data.bin").write_bytes(data)
    body = {
        "source_machine": "source",
        "source_path": str(rig.root("source") / "data.bin"),
        "destination_machine": "sink",
        "destination_path": str(rig.root("sink") / "data.bin"),
        "stream": True,
    }
    stream = EventStream(rig.api, f"/api/v1/sessions/{rig.session}/copy", body)
    try:
        events = stream.rest()
    finally:
        stream.close()
    progress = [d for kind, d in events if kind == "progress"]
    assert progress and progress[-1]["bytes_done"] == len(data)
    assert all(d["bytes_total"] == len(data) for d in progress)
    assert [d["bytes_done"] for d in progress] == sorted(d["bytes_done"] for d in progress)
    kind, result = events[-1]
    assert kind == "result" and result["size_bytes"] == len(data)
    assert (rig.root("sink") / "data.bin").read_bytes() == data


# --- protocol 2.0 ---------------------------------------------------------------------------------


def test_a_protocol_2_0_shim_refuses_the_new_features_clearly_and_still_works(rig: Rig) -> None:
    rig.shim("old", protocol_2_0=True)
    plain = rig.api.run(rig.session, ["echo", "still works"])
    assert plain["payload"]["stdout"] == "still works\n"

    body = {"op": "EXECUTE_COMMAND", "payload": {"argv": ["echo", "x"]}, "stream": True}
    refused = rig.api.client.post(rig.ops, json=body)
    assert refused.status_code == 409, refused.text
    error = api_error(refused)
    assert error["code"] == "UNSUPPORTED_OPERATION"
    assert "old" in error["message"] and "2.0" in error["message"] and "2.1" in error["message"], error

    pipe = {"source": {"machine": "old", "argv": ["echo", "x"]}, "destination": {"machine": "old", "argv": ["cat"]}}
    refused_pipe = rig.api.client.post(f"/api/v1/sessions/{rig.session}/pipe", json=pipe)
    assert (refused_pipe.status_code, api_error(refused_pipe)["code"]) == (409, "UNSUPPORTED_OPERATION")

    request_id = str(uuid.uuid4())
    pending = _PendingOp(rig, {"op": "EXECUTE_COMMAND", "payload": {"argv": ["sleep", "2"]}, "request_id": request_id})
    wait_until(lambda: rig.in_flight() != [], timeout=10, what="the 2.0 command to be in flight")
    cancel = rig.api.client.post(f"{rig.ops}/{request_id}/cancel")
    assert (cancel.status_code, api_error(cancel)["code"]) == (409, "UNSUPPORTED_OPERATION")
    answer = pending.result(15)
    assert answer.status_code == 200 and answer.json()["payload"]["exit_code"] == 0


class _PendingOp:
    """``POST …/ops`` sent from a thread (a body ``InFlight`` cannot carry: a request_id)."""

    def __init__(self, rig: Rig, body: dict[str, Any]) -> None:
        self.response: httpx.Response | None = None

        def send() -> None:
            self.response = rig.api.client.post(rig.ops, json=body)

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def result(self, timeout: float) -> httpx.Response:
        self.thread.join(timeout)
        assert self.response is not None, f"no answer within {timeout:g}s"
        return self.response


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_slow_reader_holds_the_command_back_and_the_server_memory_stays_flat(rig: Rig) -> None:
    # The event stream's credit follows what the client has actually taken off the socket:
    # a command printing 300 MB to a reader taking ~600 KiB/s stays held on the machine
    # (still in flight after 4 s, where unpaced it ends in about 8 s), and the server does
    # not buffer what the reader has not taken.
    rig.shim("laptop")
    server_pid = rig.live.server.proc.pid
    before = _rss_bytes(server_pid)
    body = json.dumps(
        {
            "op": "EXECUTE_COMMAND",
            "stream": True,
            "payload": {"command": "head -c 300000000 /dev/zero | tr '\\0' x", "timeout_seconds": 60},
        }
    ).encode()
    host, port = "127.0.0.1", rig.live.server.port
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.connect((host, port))
        sock.sendall(
            f"POST {rig.ops} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {rig.api.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        taken, peak = 0, before
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            taken += len(sock.recv(64 * 1024))
            time.sleep(0.1)
            peak = max(peak, _rss_bytes(server_pid))
        assert taken > 0
        held = [op for op in rig.in_flight() if op["kind"] == "command"]
        assert len(held) == 1, "the command ran ahead of its reader"
        assert peak - before < 48 * MiB, f"server grew {(peak - before) / MiB:.1f} MiB for a reader that took {taken}"
    wait_until(lambda: not rig.in_flight(), timeout=15, what="the closed stream's command to end")


def _running_with(marker: str) -> list[int]:
    """Pids of processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_sigkilled_shim_leaves_no_silent_command_running(rig: Rig) -> None:
    # A command that prints nothing gets no SIGPIPE when its shim dies: the shim's guardian
    # kills its process group once the shim is gone, however it died.
    shim = rig.shim("doomed")
    marker = f"m{uuid.uuid4().hex[:8]}"
    body = {
        "op": "EXECUTE_COMMAND",
        "stream": True,
        "payload": {"command": f"echo begun; sleep 300; echo never # {marker}"},
    }
    stream = EventStream(rig.api, rig.ops, body)
    stream.until("output")
    wait_until(lambda: len(_running_with(marker)) >= 1, timeout=10, what="the command to run")
    shim.kill()
    event = stream.until("error")
    assert event["code"] == "MACHINE_UNREACHABLE", event
    stream.close()
    wait_until(lambda: not _running_with(marker), timeout=10, what="the command to be killed")
