"""One connection's request handling (docs/shim-protocol.md#operations): responses reuse the request
id, one task per operation, max_concurrent / SHIM_OVERLOADED (PING exempt), the local
audit log."""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from machines.shim import AuditLog, Limits, Operations, RequestDispatcher
from machines.shim.protocol import decode, encode, envelope


class Outbox:
    """Collects the frames the dispatcher sends."""

    def __init__(self) -> None:
        self.frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def send(self, frame: Any) -> None:
        await self.frames.put(decode(encode(frame)))

    async def next(self) -> dict[str, Any]:
        async with asyncio.timeout(10):
            return await self.frames.get()


def request(op: str, payload: dict[str, Any], session_id: str = "agt_0123456789ab") -> dict[str, Any]:
    return decode(encode(envelope(op, payload, session_id=session_id, target_machine="m-1")))


def blocking_command(root: Path) -> dict[str, Any]:
    """A command that runs until the file ``go`` appears in the root."""
    return {"command": f"while [ ! -e '{root}/go' ]; do sleep 0.02; done; echo done", "timeout_seconds": 20}


def make_dispatcher(
    make_operations: Callable[..., Operations], outbox: Outbox, audit: AuditLog | None = None, max_concurrent: int = 2
) -> RequestDispatcher:
    limits = Limits(
        max_file_size_bytes=1024,
        command_timeout_seconds=5,
        max_command_timeout_seconds=20,
        max_concurrent=max_concurrent,
    )
    return RequestDispatcher(operations=make_operations(limits=limits), send=outbox.send, machine_id="m-1", audit=audit)


async def test_it_answers_with_the_request_id_and_session(
    make_operations: Callable[..., Operations], root: Path
) -> None:
    outbox = Outbox()
    dispatcher = make_dispatcher(make_operations, outbox)
    frame = request("FILE_STAT", {"path": "."})
    dispatcher.dispatch(frame)
    response = await outbox.next()
    assert response["type"] == "FILE_STAT_RESPONSE"
    assert response["id"] == frame["id"]
    assert response["session_id"] == "agt_0123456789ab"
    assert response["version"] == "2.1"
    assert set(response) == {"type", "id", "ts", "version", "session_id", "target_machine", "payload"}


async def test_it_answers_ping_while_a_long_command_runs(
    make_operations: Callable[..., Operations], root: Path
) -> None:
    outbox = Outbox()
    dispatcher = make_dispatcher(make_operations, outbox)
    command = request("EXECUTE_COMMAND", blocking_command(root))
    dispatcher.dispatch(command)
    ping = request("PING", {})
    dispatcher.dispatch(ping)
    stat_request = request("FILE_STAT", {"path": "."})
    dispatcher.dispatch(stat_request)
    first, second = await outbox.next(), await outbox.next()
    assert {first["id"], second["id"]} == {ping["id"], stat_request["id"]}
    (root / "go").touch()
    result = await outbox.next()
    assert result["id"] == command["id"] and result["payload"]["stdout"] == "done\n"


async def test_it_refuses_more_than_max_concurrent_operations_but_not_pings(
    make_operations: Callable[..., Operations], root: Path
) -> None:
    outbox = Outbox()
    dispatcher = make_dispatcher(make_operations, outbox, max_concurrent=1)
    command = request("EXECUTE_COMMAND", blocking_command(root))
    dispatcher.dispatch(command)
    extra = request("FILE_STAT", {"path": "."})
    dispatcher.dispatch(extra)
    refused = await outbox.next()
    assert refused["id"] == extra["id"]
    assert refused["type"] == "ERROR"
    assert refused["payload"]["code"] == "SHIM_OVERLOADED"
    assert refused["payload"]["fatal"] is False
    assert refused["payload"]["details"] == {"max_concurrent": 1}
    ping = request("PING", {})
    dispatcher.dispatch(ping)
    assert (await outbox.next())["type"] == "PONG"
    (root / "go").touch()
    assert (await outbox.next())["type"] == "COMMAND_RESULT"
    assert dispatcher.in_flight == 0
    again = request("FILE_STAT", {"path": "."})
    dispatcher.dispatch(again)
    assert (await outbox.next())["type"] == "FILE_STAT_RESPONSE"


async def test_it_answers_unknown_operations_and_missing_ids_with_errors(
    make_operations: Callable[..., Operations],
) -> None:
    outbox = Outbox()
    dispatcher = make_dispatcher(make_operations, outbox)
    unknown = request("FORMAT_DISK", {})
    dispatcher.dispatch(unknown)
    answer = await outbox.next()
    assert (answer["id"], answer["payload"]["code"]) == (unknown["id"], "UNSUPPORTED_OPERATION")
    no_id = request("FILE_STAT", {"path": "."})
    no_id["id"] = None
    dispatcher.dispatch(no_id)
    answer = await outbox.next()
    assert (answer["id"], answer["payload"]["code"]) == (None, "INVALID_REQUEST")


async def test_it_kills_running_commands_when_the_connection_closes(
    make_operations: Callable[..., Operations], root: Path, processes: Any
) -> None:
    outbox = Outbox()
    dispatcher = make_dispatcher(make_operations, outbox)
    dispatcher.dispatch(request("EXECUTE_COMMAND", {"command": "sleep 100 & echo $! > pidfile; wait"}))
    async with asyncio.timeout(10):
        while not (root / "pidfile").exists() or not (root / "pidfile").read_text().strip():
            await asyncio.sleep(0.02)
    await dispatcher.aclose()
    assert processes.wait_gone(int((root / "pidfile").read_text()))
    assert dispatcher.in_flight == 0


async def test_it_audits_every_operation_without_contents_or_env_values(
    make_operations: Callable[..., Operations], root: Path, tmp_path: Path
) -> None:
    outbox = Outbox()
    audit = AuditLog(tmp_path / "state" / "audit.jsonl")
    dispatcher = make_dispatcher(make_operations, outbox, audit=audit)
    write = request("FILE_WRITE", {"path": "notes.txt", "content": "the launch code is 0000", "encoding": "utf-8"})
    dispatcher.dispatch(write)
    await outbox.next()
    command = request(
        "EXECUTE_COMMAND",
        {"argv": ["echo", "--password=hunter2", "--verbose"], "env": {"API_KEY": "sk-envvalue"}},
    )
    dispatcher.dispatch(command)
    await outbox.next()
    refused = request("FILE_READ", {"path": "/etc/passwd"})
    dispatcher.dispatch(refused)
    await outbox.next()
    dispatcher.dispatch(request("PING", {}))
    await outbox.next()
    await dispatcher.aclose()

    text = audit.path.read_text()
    assert "launch code" not in text and "hunter2" not in text and "sk-envvalue" not in text
    assert stat.S_IMODE(audit.path.stat().st_mode) == 0o600
    records = [json.loads(line) for line in text.splitlines()]
    assert [record["op"] for record in records] == ["FILE_WRITE", "EXECUTE_COMMAND", "FILE_READ"]  # no PING
    written, ran, read = records
    assert set(written) == {"ts", "session_id", "machine_id", "request_id", "op", "details", "result"}
    assert written["request_id"] == write["id"]
    assert written["session_id"] == "agt_0123456789ab"
    assert written["machine_id"] == "m-1"
    assert written["details"]["path"] == "notes.txt"
    assert written["result"]["ok"] is True and written["result"]["error_code"] is None
    assert written["result"]["duration_ms"] >= 0
    assert ran["details"]["argv"] == ["echo", "--password=[REDACTED]", "--verbose"]
    assert ran["details"]["env_keys"] == ["API_KEY"]
    assert ran["result"]["exit_code"] == 0 and ran["result"]["ok"] is True
    assert read["result"]["ok"] is False
    assert read["result"]["error_code"] == "PATH_OUTSIDE_ALLOWED_ROOT"
