"""The shim against a fake platform (docs/shim-protocol.md): HELLO, HELLO_ACK,
operations over the wire, PING, refusals that end it and closes that it survives."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import platform as host_platform
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from machines.shim import Limits, Shim, ShimRefused


@asynccontextmanager
async def running(shim: Shim) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``shim`` in a task; stop it (and wait for it) when the block ends."""
    task = asyncio.create_task(shim.run())
    try:
        yield task
    finally:
        shim.stop()
        async with asyncio.timeout(10):
            await asyncio.gather(task, return_exceptions=True)


async def test_it_says_hello_with_its_identity_then_serves_operations(
    make_shim: Callable[..., Shim], platform: Any, root: Path
) -> None:
    shim = make_shim()
    async with running(shim):
        side = await platform.next_side()
        hello = side.hello
        assert set(hello) == {"type", "id", "ts", "version", "session_id", "target_machine", "payload"}
        assert (hello["type"], hello["version"]) == ("HELLO", "2.1")
        assert set(hello["payload"]) == {
            "shim_version",
            "protocol_version",
            "machine_id",
            "hostname",
            "display_name",
            "platform",
            "arch",
            "capabilities",
            "allowed_roots",
            "sessions",
            "hardware_devices",
        }
        payload = hello["payload"]
        assert payload["protocol_version"] == "2.1"
        assert payload["machine_id"] == shim.identity.machine_id
        assert payload["hostname"] == socket.gethostname()
        assert payload["display_name"] == "laptop"
        assert payload["platform"] in ("linux", "darwin")
        assert payload["arch"] == {"aarch64": "arm64", "amd64": "x86_64"}.get(
            host_platform.machine().lower(), host_platform.machine().lower()
        )
        assert payload["capabilities"] == ["shell", "files"]
        assert payload["allowed_roots"] == [str(root)]
        assert payload["sessions"] == ["*"]
        assert payload["hardware_devices"] == []
        assert platform.paths == ["/ws/shim/"]

        written = await side.request(
            "FILE_WRITE", {"path": "hello.txt", "content": base64.b64encode(b"hi\n").decode(), "encoding": "base64"}
        )
        assert (written["type"], written["payload"]) == ("ACK", {"size_bytes_written": 3})
        assert written["session_id"] == "agt_test"
        read = await side.request("FILE_READ", {"path": str(root / "hello.txt"), "encoding": "utf-8"})
        assert read["type"] == "FILE_CONTENTS" and read["payload"]["content"] == "hi\n"
        listed = await side.request("FILE_LIST", {"path": "."})
        assert [entry["name"] for entry in listed["payload"]["entries"]] == ["hello.txt"]
        ran = await side.request("EXECUTE_COMMAND", {"argv": ["cat", "hello.txt"]})
        assert ran["type"] == "COMMAND_RESULT" and ran["payload"]["stdout"] == "hi\n"
        snapshot = await side.request("MACHINE_LIST_REQUEST", {})
        assert snapshot["type"] == "MACHINE_LIST_RESPONSE"
        assert snapshot["payload"]["machine_id"] == shim.identity.machine_id
        pong = await side.request("PING", {})
        assert (pong["type"], pong["payload"]) == ("PONG", {})
        refused = await side.request("FILE_READ", {"path": "/etc/passwd", "encoding": "utf-8"})
        assert refused["type"] == "ERROR"
        assert refused["payload"]["code"] == "PATH_OUTSIDE_ALLOWED_ROOT" and refused["payload"]["fatal"] is False
        unknown = await side.request("TELEPORT", {})
        assert unknown["payload"]["code"] == "UNSUPPORTED_OPERATION"
    assert shim.negotiated is not None and shim.negotiated.connection_id == "conn-1"


async def test_it_answers_ping_while_a_command_runs(make_shim: Callable[..., Shim], platform: Any, root: Path) -> None:
    async with running(make_shim()):
        side = await platform.next_side()
        command_id = str(uuid.uuid4())
        result = side.expect(command_id)
        await side.send(
            "EXECUTE_COMMAND",
            {"command": f"while [ ! -e '{root}/go' ]; do sleep 0.02; done; echo finished"},
            frame_id=command_id,
        )
        pong = await side.request("PING", {})
        assert pong["type"] == "PONG" and not result.done()
        (root / "go").touch()
        async with asyncio.timeout(10):
            assert (await result)["payload"]["stdout"] == "finished\n"


async def test_it_uses_only_the_granted_capabilities_and_the_lower_limits(
    make_shim: Callable[..., Shim], platform: Any, root: Path
) -> None:
    platform.granted = ["files"]
    platform.limits = {**platform.limits, "max_file_size_bytes": 8}
    shim = make_shim(limits=Limits(max_concurrent=2))
    async with running(shim):
        side = await platform.next_side()
        refused = await side.request("EXECUTE_COMMAND", {"argv": ["touch", "ran"]})
        assert refused["payload"]["code"] == "CAPABILITY_NOT_GRANTED"
        assert not (root / "ran").exists()
        (root / "nine.txt").write_text("123456789")
        too_large = await side.request("FILE_READ", {"path": "nine.txt", "encoding": "utf-8"})
        assert too_large["payload"]["code"] == "FILE_TOO_LARGE"
    assert shim.negotiated is not None
    assert shim.negotiated.capabilities == frozenset({"files"})
    assert shim.negotiated.limits == Limits(max_file_size_bytes=8, max_concurrent=2)


async def test_it_attaches_only_to_the_sessions_it_was_given(
    make_shim: Callable[..., Shim], platform: Any, root: Path
) -> None:
    async with running(make_shim(sessions=["agt_one", "agt_two"], capabilities=["files"])):
        side = await platform.next_side()
        assert side.hello["payload"]["sessions"] == ["agt_one", "agt_two"]
        assert side.hello["payload"]["capabilities"] == ["files"]


async def test_it_does_not_reconnect_after_being_taken_over(make_shim: Callable[..., Shim], platform: Any) -> None:
    shim = make_shim()
    task = asyncio.create_task(shim.run())
    side = await platform.next_side()
    await side.send("SESSION_REVOKED", {"reason": "reconnected"}, session_id=None)
    await side.connection.close(4427)
    async with asyncio.timeout(10):
        with pytest.raises(ShimRefused, match="reconnected") as refused:
            await task
    assert refused.value.code == 4427
    assert platform.attempts == 1


@pytest.mark.parametrize(("code", "message"), [(4401, "refused the token"), (4426, "protocol version")])
async def test_it_does_not_reconnect_after_a_refusal(
    make_shim: Callable[..., Shim], platform: Any, code: int, message: str
) -> None:
    task = asyncio.create_task(make_shim().run())
    side = await platform.next_side()
    await side.send("ERROR", {"code": "NOPE", "message": "refused here", "fatal": True}, session_id=None)
    await side.connection.close(code)
    async with asyncio.timeout(10):
        with pytest.raises(ShimRefused, match=message) as refused:
            await task
    assert refused.value.code == code
    assert "refused here" in str(refused.value)
    assert platform.attempts == 1


async def test_it_does_not_reconnect_with_a_token_the_platform_refuses(
    make_shim: Callable[..., Shim], platform: Any
) -> None:
    with pytest.raises(ShimRefused) as refused:
        async with asyncio.timeout(10):
            await make_shim(token="wrong").run()
    assert refused.value.code == 4401
    assert platform.attempts == 1


@pytest.mark.parametrize("status", [401, 403])
async def test_it_does_not_reconnect_after_http_refusal_at_the_upgrade(
    make_shim: Callable[..., Shim], platform: Any, status: int
) -> None:
    platform.upgrade_status = status
    with pytest.raises(ShimRefused, match=f"HTTP {status}") as refused:
        async with asyncio.timeout(10):
            await make_shim().run()
    assert refused.value.code == status
    assert platform.attempts == 1


async def test_it_retries_other_http_answers_at_the_upgrade(make_shim: Callable[..., Shim], platform: Any) -> None:
    platform.upgrade_status = 502
    async with running(make_shim()):
        async with asyncio.timeout(10):
            while platform.attempts < 2:
                await asyncio.sleep(0.01)
        platform.upgrade_status = None
        side = await platform.next_side()
        assert side.hello["type"] == "HELLO"


async def test_it_reconnects_after_a_normal_close(make_shim: Callable[..., Shim], platform: Any) -> None:
    shim = make_shim()
    async with running(shim) as task:
        first = await platform.next_side()
        await first.connection.close(1000)
        second = await platform.next_side()
        assert second.hello["payload"]["machine_id"] == first.hello["payload"]["machine_id"]
        assert second.hello["id"] != first.hello["id"]
        pong = await second.request("PING", {})
        assert pong["type"] == "PONG"
        assert not task.done()
    assert shim.connections == 2


async def test_it_reconnects_when_no_hello_ack_comes(make_shim: Callable[..., Shim], platform: Any) -> None:
    platform.send_ack = False
    async with running(make_shim(handshake_timeout=0.2)):
        await platform.next_side()
        platform.send_ack = True
        side = await platform.next_side()
        assert (await side.request("PING", {}))["type"] == "PONG"


async def test_it_closes_cleanly_when_stopped(make_shim: Callable[..., Shim], platform: Any) -> None:
    shim = make_shim()
    task = asyncio.create_task(shim.run())
    side = await platform.next_side()
    shim.stop()
    async with asyncio.timeout(10):
        await task  # returns, no exception
        await side.connection.wait_closed()
    assert side.connection.close_code == 1000
    assert platform.attempts == 1


async def test_it_writes_the_local_audit_log_of_what_the_platform_asked(
    make_shim: Callable[..., Shim], platform: Any, tmp_path: Path
) -> None:
    async with running(make_shim()):
        side = await platform.next_side()
        sent = await side.request("FILE_WRITE", {"path": "a.txt", "content": "top secret", "encoding": "utf-8"})
        await side.request("PING", {})
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(record["op"], record["request_id"], record["session_id"]) for record in records] == [
        ("FILE_WRITE", sent["id"], "agt_test")
    ]
    assert "top secret" not in (tmp_path / "audit.jsonl").read_text()
    assert oct(os.stat(tmp_path / "audit.jsonl").st_mode & 0o777) == "0o600"
