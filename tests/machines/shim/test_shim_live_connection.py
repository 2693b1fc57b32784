"""The real Shim class over a websocket with live operations: on a connection
negotiated at 2.1 it streams, takes credit and cancels; one negotiated at 2.0 refuses the
live features naming the versions; a dropped socket kills a streamed command's group."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from machines.shim import Shim

from .test_shim_connection import running


async def frames_until(side: Any, done: Callable[[dict[str, Any]], bool], within: float = 10) -> dict[str, Any]:
    """Wait until a frame received from the shim satisfies ``done``; return it."""
    async with asyncio.timeout(within):
        while True:
            for frame in side.frames:
                if done(frame):
                    return frame
            await asyncio.sleep(0.01)


async def test_over_a_2_1_connection_it_streams_takes_credit_and_cancels(
    make_shim: Callable[..., Shim], platform: Any, tmp_path: Path
) -> None:
    platform.protocol_version = "2.1"
    platform.limits = {**platform.limits, "stream_window_bytes": 65536}
    shim = make_shim()
    async with running(shim):
        side = await platform.next_side()
        script = "echo started; head -c 1000000 /dev/zero; sleep 30"  # 8 + 1000000 bytes
        request_id = await side.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script], "stream": True})
        first = await frames_until(side, lambda f: f["type"] == "COMMAND_OUTPUT")
        assert first["payload"]["data"].startswith("started\n") and first["payload"]["seq"] == 0
        assert shim.negotiated is not None and shim.negotiated.protocol_version == "2.1"
        assert shim.negotiated.limits.stream_window_bytes == 65536  # the lower of both sides

        def streamed() -> int:
            return sum(len(f["payload"]["data"].encode()) for f in side.frames if f["type"] == "COMMAND_OUTPUT")

        await frames_until(side, lambda f: streamed() >= 65536)
        await asyncio.sleep(0.3)
        assert streamed() == 65536  # the window, and not a byte more
        await side.send("FLOW", {"request_id": request_id, "stream": "stdout", "credit_total": 200000})
        await frames_until(side, lambda f: streamed() >= 200000)
        cancel_id = await side.send("CANCEL", {"request_id": request_id})
        result = await frames_until(side, lambda f: f["type"] == "COMMAND_RESULT")
        ack = await frames_until(side, lambda f: f["id"] == cancel_id)
        assert (ack["type"], ack["payload"]) == ("ACK", {})
        assert result["id"] == request_id
        payload = result["payload"]
        assert payload["cancelled"] is True and payload["exit_code"] == -15
        assert payload["stdout_bytes"] == streamed() == 200000
        seqs = [f["payload"]["seq"] for f in side.frames if f["type"] == "COMMAND_OUTPUT"]
        assert seqs == list(range(len(seqs)))
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [record["op"] for record in records] == ["EXECUTE_COMMAND"]  # no CANCEL, no FLOW
    assert records[0]["result"]["cancelled"] is True
    assert records[0]["result"]["bytes"]["stdout"] >= 200000


async def test_over_a_2_0_connection_it_refuses_live_features_naming_the_versions(
    make_shim: Callable[..., Shim], platform: Any
) -> None:
    platform.protocol_version = "2.0"
    shim = make_shim()
    async with running(shim):
        side = await platform.next_side()
        refused = await side.request("EXECUTE_COMMAND", {"argv": ["true"], "stream": True})
        assert refused["type"] == "ERROR" and refused["payload"]["code"] == "UNSUPPORTED_OPERATION"
        message = refused["payload"]["message"]
        assert "2.0" in message and "2.1" in message and "stream" in message
        assert refused["payload"]["details"]["protocol_version"] == "2.0"
        cancel = await side.request("CANCEL", {"request_id": "x"})
        assert cancel["type"] == "ERROR" and cancel["payload"]["code"] == "UNSUPPORTED_OPERATION"
        plain = await side.request("EXECUTE_COMMAND", {"argv": ["echo", "still fine"]})
        assert plain["type"] == "COMMAND_RESULT" and plain["payload"]["stdout"] == "still fine\n"


async def test_a_dropped_socket_kills_a_streamed_commands_group(
    make_shim: Callable[..., Shim], platform: Any, root: Path, processes: Any
) -> None:
    platform.protocol_version = "2.1"
    shim = make_shim()
    async with running(shim):
        side = await platform.next_side()
        script = "sleep 100 & echo $! > pidfile; echo started; wait"
        await side.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script], "stream": True, "stdin": "stream"})
        await frames_until(side, lambda f: f["type"] == "COMMAND_OUTPUT")
        child = int((root / "pidfile").read_text())
        await side.connection.close()
        assert processes.wait_gone(child)
