"""Live operations with real shims, across processes (docs/live-operations.md).

Two ``manage.py serve`` processes share PostgreSQL and Redis; real ``python -m
machines.shim run`` subprocesses (protocol 2.1) connect to them; the caller is a third
process (``tests.integration.live_caller``) that runs the ``machines.services`` live
operations, so every frame crosses the Redis channel layer between the caller and the
consumer holding the shim. Covered: streaming, closing the stream, cancel from another
process, a SIGKILLed shim mid-stream, fan-out with one machine unreachable, a pipe whose
destination exits first, a 2.0 shim refused, credit under a slow consumer (memory flat).
Then through the edges with the shim on the other serve process: a REST stream cancelled
by the route on that other process, a REST stream closed, an MCP ``notifications/cancelled``
posted to the other process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.infra import PYTHON, Instance, Process, Server, ShimProcess, instance, wait_until
from tests.live_clients import MachineApi, children_of, wait_for_child

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(120),
]

OLD_SHIM = (
    "import sys; from machines.shim.cli import main; "
    "[setattr(module, 'PROTOCOL_VERSION', '2.0') for name, module in list(sys.modules.items()) "
    "if name.startswith('machines.shim') and hasattr(module, 'PROTOCOL_VERSION')]; "
    "sys.exit(main(prog='dispatch-shim'))"
)


@dataclass
class Caller:
    """A ``live_caller`` process: its JSON lines, parsed."""

    process: Process

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.process.log().splitlines() if line.startswith("{")]

    def wait_for(self, event: str, timeout: float = 20) -> dict[str, Any]:
        found = wait_until(
            lambda: [e for e in self.events() if e["event"] == event],
            timeout=timeout,
            what=f"the caller's {event!r} event",
            details=self.process.log,
        )
        return dict(found[0])

    def end(self, timeout: float = 30) -> dict[str, Any]:
        return self.wait_for("end", timeout)


@dataclass
class Live:
    instance: Instance
    a: Server
    b: Server
    tmp_path: Path
    session: str = field(default_factory=lambda: f"live-{uuid.uuid4().hex[:10]}")
    shims: list[ShimProcess] = field(default_factory=list)
    callers: list[Process] = field(default_factory=list)
    apis: list[MachineApi] = field(default_factory=list)

    def shim(self, name: str, server: Server) -> ShimProcess:
        root = self.tmp_path / f"root-{name}"
        root.mkdir(exist_ok=True)
        shim = self.instance.shim(
            name, root, "--session", self.session, server=server, state_dir=self.tmp_path / f"state-{name}"
        )
        self.shims.append(shim)
        return shim

    def old_shim(self, name: str, server: Server) -> ShimProcess:
        """A real shim whose protocol is patched to 2.0 before it starts
        (docs/shim-protocol.md#version-20-compatibility)."""
        root = self.tmp_path / f"root-{name}"
        root.mkdir(exist_ok=True)
        state = self.tmp_path / f"state-{name}"
        args = [PYTHON, "-c", OLD_SHIM, "run", "--server", server.url, "--state-dir", str(state)]
        args += ["--token", self.instance.admin_token, "--root", str(root), "--name", name, "--session", self.session]
        started = self.instance.spawn(args, name=f"shim-{name}", DISPATCH_SHIM_BACKOFF_SCALE="0.05")
        shim = ShimProcess(proc=started.proc, log_path=started.log_path, state_dir=state, name=name)
        self.shims.append(shim)
        return shim.wait_connected()

    @property
    def ops(self) -> str:
        return f"/api/v1/sessions/{self.session}/ops"

    def api(self, server: Server) -> MachineApi:
        api = MachineApi(server.url, self.instance.admin_token)
        self.apis.append(api)
        return api

    def call(self, do: str, **request: Any) -> Caller:
        body = json.dumps({"do": do, "session_id": self.session, **request})
        process = self.instance.spawn([PYTHON, "-m", "tests.integration.live_caller", body], name=f"caller-{do}")
        self.callers.append(process)
        return Caller(process)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Instance, Server, Server]]:
    with instance(postgres=True, redis=True) as inst:
        a, b = inst.serve(wait=False), inst.serve(wait=False)
        a.wait_healthy(), b.wait_healthy()
        yield inst, a, b


@pytest.fixture
def live(servers: tuple[Instance, Server, Server], tmp_path: Path) -> Iterator[Live]:
    inst, a, b = servers
    world = Live(instance=inst, a=a, b=b, tmp_path=tmp_path)
    try:
        yield world
    finally:
        for process in [*world.callers, *world.shims]:
            process.stop()
        for api in world.apis:
            api.client.close()
        for server in (a, b):
            assert server.running, server.log()


def outputs(events: list[dict[str, Any]], machine_id: str | None = None) -> str:
    return "".join(e["data"] for e in events if e["event"] == "output" and machine_id in (None, e["machine_id"]))


def running_with(marker: str) -> list[int]:
    """Pids of processes whose command line holds ``marker`` (the test's own clients aside)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and not cmdline.startswith(b"curl\0"):
                found.append(int(entry.name))
    return found


def idle(marker: str) -> str:
    """A shell loop that runs until stopped and keeps ``marker`` in its command line (a
    shell ``exec``s a last simple command, which would drop it)."""
    return f"while true; do sleep 0.2; done # {marker}"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


# --- streaming and cancel ----------------------------------------------------------------------


def test_a_command_streams_its_output_to_a_caller_in_another_process(live: Live) -> None:
    shim = live.shim("streamer", live.a)
    caller = live.call("stream", payload={"argv": ["sh", "-c", "for i in 1 2 3; do echo line $i; sleep 0.3; done"]})
    end = caller.end()
    events = caller.events()
    assert end["answer"] is None, end
    started = next(e for e in events if e["event"] == "started")
    assert started["machine_id"] == shim.machine_id and started["name"] == "streamer"
    assert outputs(events) == "line 1\nline 2\nline 3\n"
    result = next(e for e in events if e["event"] == "result")
    assert result["payload"]["exit_code"] == 0 and result["payload"]["stdout_bytes"] == 21
    assert result["payload"]["stdout"] == "" and result["payload"]["cancelled"] is False
    first = next(e for e in events if e["event"] == "output")
    assert result["t"] - first["t"] >= 0.4, "the first line arrived only with the result"
    record = wait_until(
        lambda: [r for r in shim.audit() if r["op"] == "EXECUTE_COMMAND"], timeout=10, what="the shim's audit"
    )[0]
    assert record["request_id"] == started["request_id"]


def test_closing_the_stream_cancels_the_command(live: Live) -> None:
    shim = live.shim("closer", live.a)
    marker = f"m{uuid.uuid4().hex[:8]}"
    caller = live.call("stream", payload={"command": f"echo go; {idle(marker)}"}, stop_after=1)
    caller.wait_for("output")
    assert caller.end()["answer"] is None
    wait_until(lambda: not running_with(marker), timeout=10, what="the command to be gone")
    record = wait_until(
        lambda: [r for r in shim.audit() if r["op"] == "EXECUTE_COMMAND"], timeout=10, what="the shim's audit"
    )[0]
    assert json.dumps(record).count("cancel") >= 1, record


def test_a_cancel_from_another_process_ends_the_command_cancelled(live: Live) -> None:
    live.shim("cancelled", live.a)
    request_id = str(uuid.uuid4())
    streaming = live.call("stream", payload={"argv": ["sh", "-c", "echo go; exec sleep 30"]}, request_id=request_id)
    streaming.wait_for("output")
    cancelling = live.call("cancel", request_id=request_id)
    assert cancelling.end()["answer"] == {"request_id": request_id, "cancelled": True}
    streaming.end(timeout=15)
    result = next(e for e in streaming.events() if e["event"] == "result")
    assert result["payload"]["cancelled"] is True and result["payload"]["exit_code"] == -15
    missing = live.call("cancel", request_id=request_id).end()
    assert missing["error"]["code"] == "OPERATION_NOT_FOUND"


def test_a_sigkilled_shim_mid_stream_fails_the_stream_and_leaves_nothing_running(live: Live) -> None:
    shim = live.shim("doomed", live.b)
    marker = f"m{uuid.uuid4().hex[:8]}"
    caller = live.call("stream", payload={"command": f"while true; do echo tick; sleep 0.1; done # {marker}"})
    caller.wait_for("output")
    assert running_with(marker)
    shim.kill()
    errors = [e for e in [caller.wait_for("error", timeout=10)] if e["event"] == "error"]
    assert errors[0]["code"] == "MACHINE_UNREACHABLE", errors
    wait_until(lambda: not running_with(marker), timeout=10, what="the command to be gone")


# --- fan-out, pipe -----------------------------------------------------------------------------------


def test_fan_out_with_one_machine_unreachable_is_one_failed_entry(live: Live) -> None:
    alpha, beta = live.shim("alpha", live.a), live.shim("beta", live.b)
    caller = live.call(
        "op",
        op="EXECUTE_COMMAND",
        payload={"argv": ["sh", "-c", "sleep 1.5; echo done"]},
        target_machines="*",
    )
    wait_for_child(beta.pid, "sh")
    beta.kill()
    answer = caller.end()["answer"]
    entries = {entry["name"]: entry for entry in answer["results"]}
    assert entries["alpha"]["ok"] is True and entries["alpha"]["result"]["payload"]["stdout"] == "done\n"
    assert entries["alpha"]["machine_id"] == alpha.machine_id
    assert entries["beta"]["ok"] is False and entries["beta"]["error"]["code"] == "MACHINE_UNREACHABLE"


def test_a_pipe_whose_destination_exits_first_stops_its_source(live: Live) -> None:
    live.shim("source", live.a)
    live.shim("sink", live.b)
    marker = f"m{uuid.uuid4().hex[:8]}"
    caller = live.call(
        "pipe",
        source={"machine": "source", "command": f"while true; do echo data; done # {marker}"},
        destination={"machine": "sink", "argv": ["head", "-c", "100"]},
        timeout_seconds=20,
    )
    answer = caller.end()["answer"]
    assert answer["destination"]["ok"] is True and answer["destination"]["exit_code"] == 0
    assert answer["destination"]["stdout"] == "data\n" * 20
    assert answer["source"]["cancelled"] is True or answer["source"]["exit_code"] != 0
    assert answer["bytes"] >= 100
    wait_until(lambda: not running_with(marker), timeout=10, what="the source to be gone")


def test_a_pipe_moves_bytes_between_shims_of_two_processes(live: Live) -> None:
    live.shim("producer", live.a)
    live.shim("consumer", live.b)
    caller = live.call(
        "pipe",
        source={"machine": "producer", "command": "head -c 3000000 /dev/zero | tr '\\0' 'z'"},
        destination={"machine": "consumer", "argv": ["wc", "-c"]},
    )
    answer = caller.end()["answer"]
    assert answer["bytes"] == 3_000_000
    assert answer["destination"]["stdout"].strip() == "3000000"
    assert answer["source"]["exit_code"] == 0 and answer["source"]["cancelled"] is False


# --- 2.0, credit -------------------------------------------------------------------------------------


def test_a_2_0_shim_is_refused_clearly_and_keeps_working(live: Live) -> None:
    old = live.old_shim("old", live.a)
    refused = live.call("stream", payload={"argv": ["echo", "hi"]}).end()
    assert refused["error"]["code"] == "UNSUPPORTED_OPERATION"
    assert (
        "machine 'old' runs shim 0.1.0 (protocol 2.0); streamed output needs protocol 2.1"
        in refused["error"]["message"]
    )
    plain = live.call("op", op="EXECUTE_COMMAND", payload={"argv": ["echo", "hi"]}).end()
    assert plain["answer"]["payload"]["stdout"] == "hi\n" and plain["answer"]["machine_id"] == old.machine_id
    piped = live.call("pipe", source={"argv": ["echo", "x"]}, destination={"argv": ["cat"]}).end()
    assert piped.get("error", {}).get("code") == "UNSUPPORTED_OPERATION", piped


def test_a_slow_consumer_holds_a_fast_command_back_and_memory_stays_flat(live: Live) -> None:
    shim = live.shim("firehose", live.a)
    caller = live.call(
        "stream",
        payload={"command": "head -c 2000000000 /dev/zero | tr '\\0' 'y'"},
        pause=0.05,
        stop_after=60,
        quiet=True,
    )
    caller.wait_for("output")
    servers = {"serve": live.a.pid, "shim": shim.pid}
    wait_until(
        lambda: len([e for e in caller.events() if e["event"] == "output"]) >= 10, timeout=20, what="ten outputs"
    )
    before = {name: rss_kib(pid) for name, pid in servers.items()}
    wait_until(
        lambda: len([e for e in caller.events() if e["event"] == "output"]) >= 50, timeout=20, what="fifty outputs"
    )
    after = {name: rss_kib(pid) for name, pid in servers.items()}
    caller.end()
    events = [e for e in caller.events() if e["event"] == "output"]
    taken = sum(e["data"] for e in events)
    seconds = events[-1]["t"] - events[0]["t"]
    # 0.05 s per event of at most 64 KiB: the command could not run ahead of the consumer.
    assert taken <= 60 * 64 * 1024 and seconds >= 2.5
    for name in servers:
        assert after[name] - before[name] < 16 * 1024, f"{name} grew {after[name] - before[name]} KiB"
    assert events[-1]["rss"] - events[10]["rss"] < 16 * 1024, "the caller grew"
    wait_until(lambda: not [p for p, n in children_of(shim.pid) if n in ("head", "tr")], timeout=10, what="cancelled")


# --- through the edges, across processes ------------------------------------------------------------
# The REST and MCP edges (branch live-edges) on one serve process, the shim on the other.


def test_a_rest_stream_on_one_process_is_cancelled_by_the_route_on_the_other(live: Live) -> None:
    from tests.integration.test_live_edges import EventStream

    shim = live.shim("rest-cancel", live.b)
    request_id = str(uuid.uuid4())
    body = {"op": "EXECUTE_COMMAND", "payload": {"argv": ["sh", "-c", "echo begun; exec sleep 30"]}}
    stream = EventStream(live.api(live.a), live.ops, {**body, "stream": True, "request_id": request_id})
    try:
        assert stream.until("started")["machine_id"] == shim.machine_id
        assert stream.until("output")["data"] == "begun\n"
        listed = live.api(live.a).client.get(live.ops).json()["operations"]
        assert [entry["request_id"] for entry in listed] == [request_id]
        cancel = live.api(live.b).client.post(f"{live.ops}/{request_id}/cancel")
        assert cancel.status_code == 202 and cancel.json() == {"request_id": request_id, "cancelled": True}
        result = stream.until("result")
        assert result["payload"]["cancelled"] is True and result["payload"]["exit_code"] == -15
    finally:
        stream.close()
    wait_until(lambda: not [n for _, n in children_of(shim.pid) if n == "sleep"], timeout=10, what="sleep gone")
    assert live.api(live.b).client.get(live.ops).json()["operations"] == []


def test_closing_a_rest_stream_cancels_a_command_held_by_the_other_process(live: Live) -> None:
    from tests.integration.test_live_edges import EventStream

    shim = live.shim("rest-close", live.b)
    marker = f"m{uuid.uuid4().hex[:8]}"
    body = {"op": "EXECUTE_COMMAND", "payload": {"command": f"echo begun; {idle(marker)}"}, "stream": True}
    stream = EventStream(live.api(live.a), live.ops, body)
    assert stream.until("output")["data"] == "begun\n"
    assert running_with(marker)
    stream.close()
    wait_until(lambda: not running_with(marker), timeout=10, what="the command to be gone")
    assert shim.running


def test_an_mcp_cancel_on_one_process_stops_a_tool_call_running_on_the_other(live: Live) -> None:
    if shutil.which("curl") is None:
        pytest.skip("no curl to play the MCP client")
    shim = live.shim("mcp-cancel", live.b)
    marker = f"m{uuid.uuid4().hex[:8]}"
    headers = {
        "Authorization": f"Bearer {live.instance.admin_token}",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-11-25",
        "Content-Type": "application/json",
    }
    call = {
        "jsonrpc": "2.0",
        "id": 41,
        "method": "tools/call",
        "params": {
            "name": "local_pc_execute_command",
            "arguments": {"command": f"echo begun; {idle(marker)}", "session_id": live.session},
            "_meta": {"progressToken": "tok-41"},
        },
    }
    # The tool call is a client process of its own (curl), as an MCP client is.
    command = ["curl", "-sS", "-N", "-X", "POST", f"{live.a.url}/mcp", "--data", json.dumps(call)]
    for name, value in headers.items():
        command += ["-H", f"{name}: {value}"]
    client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: running_with(marker) or client.poll() is not None, timeout=15, what="the command")
        assert client.poll() is None, client.communicate()[0]
        cancelled = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 41}}
        assert httpx.post(f"{live.b.url}/mcp", json=cancelled, headers=headers, timeout=10).status_code == 202
        wait_until(lambda: not running_with(marker), timeout=10, what="the command to be gone")
        output, _ = client.communicate(timeout=15)
    finally:
        if client.poll() is None:
            client.kill()
    messages = [json.loads(line[5:]) for line in output.splitlines() if line.startswith("data:")]
    assert messages, output
    answer = messages[-1]
    assert answer["id"] == 41 and answer["result"]["structuredContent"]["cancelled"] is True, answer
    assert shim.running
