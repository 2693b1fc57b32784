"""Request body cap of ``serve`` (docs/operating.md#limits, docs/architecture.md#errors).

daphne buffers a whole request body before the application runs, so ``serve`` refuses a
body over ``DISPATCH_MAX_REQUEST_BYTES`` inside daphne: a ``Content-Length`` over the cap
at once, a chunked body when it passes the cap; 413 ``REQUEST_TOO_LARGE`` in the JSON
error shape, then the connection closes, and the server's memory stays flat. Bodies up to
the cap get through, Django's own limit included: a 10 MiB file write (base64 in JSON,
~14 MiB) over REST and over MCP.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.infra import Instance, Server, ShimProcess, instance

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CLAIM = "/api/v1/peers/claim"
HUGE = 300 * 1000 * 1000  # bytes offered by the client
MiB = 1024 * 1024


@dataclass
class Live:
    instance: Instance
    server: Server
    shim: ShimProcess
    root: Path


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("body-root")
    with instance() as inst:
        server = inst.serve()
        shim = inst.shim("bodies", root, "--session", "default", state_dir=tmp_path_factory.mktemp("body-state"))
        yield Live(instance=inst, server=server, shim=shim, root=root)


def _memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of ``pid``, bytes."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _send_until_answered(port: int, head: bytes, chunks: Iterator[bytes]) -> tuple[bytes, int]:
    """Send ``head`` then ``chunks`` until the server answers; returns (answer, body bytes sent).

    Stops sending as soon as the answer starts to arrive, as a client reading its
    response would; reads to the end of the connection.
    """
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        deadline = time.monotonic() + 60
        for chunk in chunks:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
            assert time.monotonic() < deadline, "the server never answered"
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
        except ConnectionResetError:
            pass
    return answer, sent


def _check_refusal(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 413"), answer[:500]
    assert b"content-type: application/json" in head.lower()
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "REQUEST_TOO_LARGE"
    assert "DISPATCH_MAX_REQUEST_BYTES" in error["message"]


def _grew(before: dict[str, int], after: dict[str, int]) -> str:
    rss = (after["VmRSS"] - before["VmRSS"]) / MiB
    peak = (after["VmHWM"] - max(before["VmHWM"], before["VmRSS"])) / MiB
    return f"{rss:.1f} MiB (peak +{peak:.1f} MiB)"


def _chunks(total: int, size: int = MiB) -> Iterator[bytes]:
    block = b"x" * size
    for _ in range(total // size):
        yield block


def _chunked(total: int, size: int = MiB) -> Iterator[bytes]:
    for block in _chunks(total, size):
        yield f"{len(block):x}\r\n".encode() + block + b"\r\n"
    yield b"0\r\n\r\n"


def test_a_300_mb_body_with_a_content_length_is_refused_413_before_it_is_read(live: Live) -> None:
    before = _memory(live.server.pid)
    head = (
        f"POST {CLAIM} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {HUGE}\r\n\r\n"
    ).encode()
    answer, sent = _send_until_answered(live.server.port, head, _chunks(HUGE))
    _check_refusal(answer)
    assert sent < HUGE
    after = _memory(live.server.pid)
    print(f"Content-Length 300 MB: refused after {sent / MiB:.1f} MiB sent, RSS +{_grew(before, after)}")
    assert after["VmRSS"] - before["VmRSS"] < 32 * MiB, (before, after)
    assert after["VmHWM"] - max(before["VmHWM"], before["VmRSS"]) < 32 * MiB, (before, after)
    assert live.server.get("/healthz").status_code == 200


def test_a_300_mb_chunked_body_is_cut_off_at_the_cap_with_413(live: Live) -> None:
    before = _memory(live.server.pid)
    head = (
        f"POST {CLAIM} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    answer, sent = _send_until_answered(live.server.port, head, _chunked(HUGE))
    _check_refusal(answer)
    assert sent < 64 * MiB  # cut off near the 16 MiB cap, not read to the end
    after = _memory(live.server.pid)
    print(f"chunked 300 MB: cut off after {sent / MiB:.1f} MiB sent, RSS +{_grew(before, after)}")
    assert after["VmRSS"] - before["VmRSS"] < 32 * MiB, (before, after)
    assert after["VmHWM"] - max(before["VmHWM"], before["VmRSS"]) < 32 * MiB, (before, after)
    assert live.server.get("/healthz").status_code == 200


def _ten_mib() -> tuple[bytes, str]:
    data = os.urandom(10 * MiB)
    return data, base64.b64encode(data).decode()


def test_a_10_mib_file_write_over_rest_succeeds(live: Live) -> None:
    data, encoded = _ten_mib()
    target = live.root / "rest-10mib.bin"
    response = httpx.post(
        f"{live.server.url}/api/v1/sessions/default/ops",
        json={"op": "FILE_WRITE", "payload": {"path": str(target), "content": encoded, "encoding": "base64"}},
        headers={"Authorization": f"Bearer {live.instance.admin_token}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text[:500]
    assert hashlib.sha256(target.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_10_mib_file_write_over_mcp_succeeds(live: Live) -> None:
    data, encoded = _ten_mib()
    target = live.root / "mcp-10mib.bin"
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {
            "name": "local_pc_file_write",
            "arguments": {"path": str(target), "content": encoded, "encoding": "base64"},
        },
    }
    response = httpx.post(
        f"{live.server.url}/mcp",
        content=json.dumps(call).encode(),
        headers={
            "Authorization": f"Bearer {live.instance.admin_token}",
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text[:500]
    # tools/call is answered as an event stream when the client accepts one
    body = response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        body = next(
            line[len("data:") :] for line in body.splitlines() if line.startswith("data:") and '"result"' in line
        )
    result = json.loads(body)["result"]
    assert not result.get("isError"), result
    assert hashlib.sha256(target.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
