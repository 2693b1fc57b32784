"""Flow control of shim protocol 2.1 (docs/shim-protocol.md#flow-control-flow): output credit (a stalled stream stops
reading its pipe, memory stays flat, granting resumes it), streamed stdin with the shim's
stdin credit, the audit record of a live command, and what a dropped connection or a
timeout leaves behind."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from machines.shim import AuditLog, Limits, Operations, RequestDispatcher

from .test_shim_live import Platform, joined_bytes, raw_size

MiB = 1024 * 1024


@pytest.fixture
def connect(make_operations: Callable[..., Operations], tmp_path: Path) -> Callable[..., Platform]:
    """``connect(audit=False, **limits)``: a 2.1 dispatcher and the platform end of it."""

    def make(*, audit: bool = False, **limits: Any) -> Platform:
        settings: dict[str, Any] = {
            "max_file_size_bytes": 1024,
            "command_timeout_seconds": 10,
            "max_command_timeout_seconds": 20,
            "max_concurrent": 2,
        } | limits
        operations = make_operations(limits=Limits(**settings))
        log = AuditLog(tmp_path / "audit.jsonl") if audit else None
        return Platform(
            lambda platform: RequestDispatcher(
                operations=operations, send=platform.deliver, machine_id="m-1", audit=log
            )
        )

    return make


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_a_stream_out_of_credit_stops_reading_and_memory_stays_flat_until_credit_comes(
    connect: Callable[..., Platform],
) -> None:
    platform = connect()  # the default window: 1 MiB
    before = resident_bytes()
    request_id = platform.send(
        "EXECUTE_COMMAND", {"argv": ["head", "-c", "50M", "/dev/zero"], "stream": True, "binary": True}
    )
    stalled: list[dict[str, Any]] = []
    while sum(raw_size(frame["payload"]) for frame in stalled) < MiB:
        stalled.append(await platform.next())
    assert await platform.nothing_within(0.5)  # nothing past the window, however fast it writes
    command = platform.dispatcher.running_command(request_id)
    assert command is not None
    assert command.byte_counts["stdout"] <= MiB + 64 * 1024  # its pipe is no longer read
    assert command.buffered_bytes <= 512 * 1024
    assert resident_bytes() - before < 24 * MiB  # not 50 MiB

    # Granting as the bytes are consumed lets it finish.
    platform.send("FLOW", {"request_id": request_id, "stream": "stdout", "credit_total": 2 * MiB})
    outputs, result, _ = await platform.run(request_id, within=60, stdout_before=MiB)
    payload = result["payload"]
    assert payload["exit_code"] == 0 and payload["cancelled"] is False
    assert payload["stdout_bytes"] == 50 * MiB
    assert len(joined_bytes(stalled)) + len(joined_bytes(outputs)) == 50 * MiB
    assert [frame["payload"]["seq"] for frame in stalled + outputs] == list(range(len(stalled) + len(outputs)))


async def test_a_smaller_credit_total_than_known_is_ignored(connect: Callable[..., Platform]) -> None:
    platform = connect(stream_window_bytes=65536)
    request_id = platform.send(
        "EXECUTE_COMMAND", {"argv": ["head", "-c", "200000", "/dev/zero"], "stream": True, "binary": True}
    )
    first = await platform.next()
    platform.send("FLOW", {"request_id": request_id, "stream": "stdout", "credit_total": 1000})  # below the window
    platform.send("FLOW", {"request_id": request_id, "stream": "stderr", "credit_total": 10 * MiB})  # other stream
    frames = [first]
    while sum(raw_size(frame["payload"]) for frame in frames) < 65536:
        frames.append(await platform.next())
    assert await platform.nothing_within(0.3)
    platform.send("FLOW", {"request_id": request_id, "stream": "stdout", "credit_total": 200000})
    outputs, result, _ = await platform.run(request_id, grant=False)
    assert len(joined_bytes(frames)) + len(joined_bytes(outputs)) == result["payload"]["stdout_bytes"] == 200000


async def test_a_command_that_times_out_while_out_of_credit_ends_timed_out(connect: Callable[..., Platform]) -> None:
    platform = connect(stream_window_bytes=65536)
    request_id = platform.send(
        "EXECUTE_COMMAND",
        {"argv": ["head", "-c", "10000000", "/dev/zero"], "stream": True, "binary": True, "timeout_seconds": 0.5},
    )
    outputs, result, _ = await platform.run(request_id, grant=False, within=8)
    assert result["payload"]["timed_out"] is True and result["payload"]["exit_code"] == -1
    assert result["payload"]["stdout_bytes"] == len(joined_bytes(outputs)) == 65536


async def feed(platform: Platform, request_id: str, data: bytes, chunk: int) -> list[dict[str, Any]]:
    """Send ``data`` as COMMAND_INPUT frames of ``chunk`` bytes, never past the stdin credit
    (waiting for the shim's FLOW grants), then eof. Returns the FLOW frames received."""
    credit = platform.dispatcher.operations.limits.stream_window_bytes
    grants: list[dict[str, Any]] = []
    sent = 0
    while sent < len(data):
        size = min(chunk, len(data) - sent, credit - sent)
        if size <= 0:
            frame = await platform.next()
            assert frame["type"] == "FLOW", frame
            assert frame["payload"]["request_id"] == request_id and frame["payload"]["stream"] == "stdin"
            grants.append(frame)
            credit = max(credit, frame["payload"]["credit_total"])
            continue
        piece = base64.b64encode(data[sent : sent + size]).decode()
        platform.send("COMMAND_INPUT", {"request_id": request_id, "data": piece, "encoding": "base64", "eof": False})
        sent += size
        await asyncio.sleep(0)
    platform.send("COMMAND_INPUT", {"request_id": request_id, "data": "", "encoding": "base64", "eof": True})
    return grants


async def test_stdin_streamed_in_chunks_within_the_credit_reaches_the_command(connect: Callable[..., Platform]) -> None:
    platform = connect(stream_window_bytes=256 * 1024, audit=True)
    data = os.urandom(3 * MiB)
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["sha256sum"], "stdin": "stream"})
    grants = await feed(platform, request_id, data, 64 * 1024)
    _, result, others = await platform.run(request_id)
    assert result["payload"]["stdout"] == f"{hashlib.sha256(data).hexdigest()}  -\n"
    assert result["payload"]["exit_code"] == 0
    totals = [frame["payload"]["credit_total"] for frame in grants + others if frame["type"] == "FLOW"]
    assert len(totals) >= 3 and totals == sorted(totals)
    assert all(frame["type"] == "FLOW" for frame in others)
    await platform.dispatcher.aclose()
    log = platform.dispatcher._audit
    assert log is not None
    (record,) = [json.loads(line) for line in log.path.read_text().splitlines()]  # no record for the frames
    assert record["op"] == "EXECUTE_COMMAND" and record["details"]["stdin"] == "stream"
    assert record["result"]["bytes"] == {"stdout": 68, "stderr": 0, "stdin": 3 * MiB}
    assert record["result"]["cancelled"] is False and record["result"]["exit_code"] == 0


async def test_input_past_the_stdin_credit_is_refused_and_dropped(connect: Callable[..., Platform]) -> None:
    platform = connect(stream_window_bytes=1024)
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["cat"], "stdin": "stream", "stream": True})
    too_much = platform.send(
        "COMMAND_INPUT", {"request_id": request_id, "data": "x" * 1025, "encoding": "utf-8", "eof": False}
    )
    refused = await platform.next()
    assert (refused["type"], refused["id"], refused["payload"]["code"]) == ("ERROR", too_much, "INVALID_REQUEST")
    assert "credit" in refused["payload"]["message"]
    platform.send("COMMAND_INPUT", {"request_id": request_id, "data": "héllo", "encoding": "utf-8", "eof": True})
    outputs, result, _ = await platform.run(request_id)
    assert "".join(frame["payload"]["data"] for frame in outputs) == "héllo"
    assert result["payload"]["exit_code"] == 0
    late = platform.send("COMMAND_INPUT", {"request_id": request_id, "data": "x", "encoding": "utf-8", "eof": True})
    assert late and await platform.nothing_within(0.2)  # the operation is over: dropped silently


async def test_input_is_refused_for_a_command_without_streamed_stdin_and_after_eof(
    connect: Callable[..., Platform], root: Path
) -> None:
    platform = connect()
    script = f"while [ ! -e '{root}/go' ]; do sleep 0.02; done"
    no_stdin = platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script]})
    frame_id = platform.send("COMMAND_INPUT", {"request_id": no_stdin, "data": "x", "encoding": "utf-8"})
    refused = await platform.next()
    assert (refused["id"], refused["payload"]["code"]) == (frame_id, "INVALID_REQUEST")
    closed = platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script], "stdin": "stream"})
    platform.send("COMMAND_INPUT", {"request_id": closed, "data": "", "encoding": "utf-8", "eof": True})
    frame_id = platform.send("COMMAND_INPUT", {"request_id": closed, "data": "x", "encoding": "utf-8"})
    refused = await platform.next()
    assert (refused["id"], refused["payload"]["code"]) == (frame_id, "INVALID_REQUEST")
    assert "eof" in refused["payload"]["message"]
    (root / "go").touch()
    results = {frame["id"]: frame["payload"] for frame in [await platform.next(), await platform.next()]}
    assert results[no_stdin]["exit_code"] == results[closed]["exit_code"] == 0


async def test_a_dropped_connection_kills_streamed_and_stdin_commands(
    connect: Callable[..., Platform], root: Path, processes: Any
) -> None:
    platform = connect()
    for name, fields in (("streamed", {"stream": True}), ("fed", {"stdin": "stream"})):
        script = f"sleep 100 & echo $! > {name}.pid; wait"
        platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script], **fields})
    async with asyncio.timeout(10):
        while not all((root / f"{name}.pid").exists() for name in ("streamed", "fed")) or not all(
            (root / f"{name}.pid").read_text().strip() for name in ("streamed", "fed")
        ):
            await asyncio.sleep(0.02)
    await platform.dispatcher.aclose()
    for name in ("streamed", "fed"):
        assert processes.wait_gone(int((root / f"{name}.pid").read_text()))
    assert platform.dispatcher.in_flight == 0


async def test_the_audit_of_a_cancelled_streamed_command_has_bytes_but_never_its_data(
    connect: Callable[..., Platform],
) -> None:
    platform = connect(audit=True)
    request_id = platform.send(
        "EXECUTE_COMMAND",
        {"argv": ["sh", "-c", "printf 'se%s\\n' cret-output; echo oops >&2; sleep 30"], "stream": True},
    )
    seen = ""
    while "secret-output" not in seen or "oops" not in seen:
        seen += (await platform.next())["payload"]["data"]
    platform.send("CANCEL", {"request_id": request_id})
    platform.send("FLOW", {"request_id": request_id, "stream": "stdout", "credit_total": 5 * MiB})
    _, result, _ = await platform.run(request_id)
    await platform.dispatcher.aclose()
    log = platform.dispatcher._audit
    assert log is not None
    text = log.path.read_text()
    assert "secret-output" not in text
    (record,) = [json.loads(line) for line in text.splitlines()]
    assert record["op"] == "EXECUTE_COMMAND" and record["details"]["stream"] is True
    assert record["result"]["cancelled"] is True and record["result"]["exit_code"] == -15
    assert record["result"]["bytes"] == {"stdout": 14, "stderr": 5, "stdin": 0}
    assert result["payload"]["exit_code"] == -15
