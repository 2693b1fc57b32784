"""Shim protocol 2.1 live operations on one connection: streamed output
(order, seq, flush timing, UTF-8, base64, caps), CANCEL, uncounted control frames and the
refusals of a connection negotiated at 2.0. Driven through the RequestDispatcher with a
fake platform that collects what the shim sends."""

from __future__ import annotations

import asyncio
import base64
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from machines.shim import Limits, Operations, RequestDispatcher
from machines.shim import live as live_module
from machines.shim.protocol import decode, encode, envelope


class Platform:
    """The platform's end of one connection: sends frames into the dispatcher and reads
    what the shim sends back (each frame stamped with the loop time it was sent)."""

    def __init__(self, dispatcher_for: Callable[[Platform], RequestDispatcher]) -> None:
        self.received: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent_at: dict[int, float] = {}
        self.dispatcher = dispatcher_for(self)

    async def deliver(self, frame: Any) -> None:
        decoded = decode(encode(frame))
        self.sent_at[id(decoded)] = asyncio.get_running_loop().time()
        await self.received.put(decoded)

    def send(self, op: str, payload: dict[str, Any]) -> str:
        frame = decode(encode(envelope(op, payload, session_id="agt_live", target_machine="m-1")))
        self.dispatcher.dispatch(frame)
        return str(frame["id"])

    async def next(self, within: float = 10) -> dict[str, Any]:
        async with asyncio.timeout(within):
            return await self.received.get()

    async def nothing_within(self, seconds: float) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await self.received.get()
        except TimeoutError:
            return True
        return False

    async def run(
        self, request_id: str, *, grant: bool = True, within: float = 20, stdout_before: int = 0
    ) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
        """Read until ``request_id``'s reply: ``(its COMMAND_OUTPUT frames, the reply, other
        frames)``. With ``grant``, consumes like a caller: credit = bytes received + window
        (``stdout_before``: stdout bytes the test already took)."""
        outputs: list[dict[str, Any]] = []
        others: list[dict[str, Any]] = []
        received = {"stdout": stdout_before, "stderr": 0}
        window = self.dispatcher.operations.limits.stream_window_bytes
        async with asyncio.timeout(within):
            while True:
                frame = await self.next(within)
                if frame["type"] == "COMMAND_OUTPUT" and frame["id"] == request_id:
                    outputs.append(frame)
                    stream = frame["payload"]["stream"]
                    received[stream] += raw_size(frame["payload"])
                    if grant:
                        self.send(
                            "FLOW",
                            {"request_id": request_id, "stream": stream, "credit_total": received[stream] + window},
                        )
                elif frame["id"] == request_id:
                    return outputs, frame, others
                else:
                    others.append(frame)


def raw_size(payload: dict[str, Any]) -> int:
    if payload["encoding"] == "base64":
        return len(base64.b64decode(payload["data"]))
    return len(payload["data"].encode("utf-8"))


def joined(outputs: list[dict[str, Any]], stream: str) -> str:
    return "".join(frame["payload"]["data"] for frame in outputs if frame["payload"]["stream"] == stream)


def joined_bytes(outputs: list[dict[str, Any]], stream: str = "stdout") -> bytes:
    return b"".join(
        base64.b64decode(frame["payload"]["data"]) for frame in outputs if frame["payload"]["stream"] == stream
    )


@pytest.fixture
def connect(make_operations: Callable[..., Operations]) -> Callable[..., Platform]:
    """``connect(max_concurrent=2, protocol_version="2.1", **limits)``: a dispatcher for one
    connection with those limits, and the platform end of it."""

    def make(*, max_concurrent: int = 2, protocol_version: str = "2.1", **limits: Any) -> Platform:
        settings: dict[str, Any] = {
            "max_file_size_bytes": 1024,
            "command_timeout_seconds": 5,
            "max_command_timeout_seconds": 20,
            "max_concurrent": max_concurrent,
        } | limits
        operations = make_operations(limits=Limits(**settings), protocol_version=protocol_version)
        return Platform(
            lambda platform: RequestDispatcher(operations=operations, send=platform.deliver, machine_id="m-1")
        )

    return make


# -- streamed output -----------------------------------------------------------------------


async def test_it_streams_both_streams_in_order_with_one_seq_and_a_result_without_output(
    connect: Callable[..., Platform],
) -> None:
    platform = connect()
    script = "printf 'a\\n'; sleep 0.15; printf 'b\\n' >&2; sleep 0.15; printf 'c\\n'"
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script], "stream": True})
    outputs, result, others = await platform.run(request_id)
    assert others == []
    assert [frame["payload"]["seq"] for frame in outputs] == list(range(len(outputs)))
    assert [(frame["payload"]["stream"], frame["payload"]["data"]) for frame in outputs] == [
        ("stdout", "a\n"),
        ("stderr", "b\n"),
        ("stdout", "c\n"),
    ]
    assert all(frame["payload"]["encoding"] == "utf-8" and frame["session_id"] == "agt_live" for frame in outputs)
    assert result["type"] == "COMMAND_RESULT"
    payload = result["payload"]
    assert (payload["stdout"], payload["stderr"], payload["exit_code"]) == ("", "", 0)
    assert (payload["stdout_bytes"], payload["stderr_bytes"]) == (4, 2)
    assert payload["stream_truncated"] is False and payload["cancelled"] is False
    assert payload["output_truncated"] is False and payload["timed_out"] is False


async def test_it_sends_the_first_output_at_once_then_at_most_one_frame_per_100_ms(
    connect: Callable[..., Platform],
) -> None:
    platform = connect()
    script = "echo first; sleep 0.5; for i in $(seq 1 40); do echo line$i; sleep 0.01; done"
    started = asyncio.get_running_loop().time()
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script], "stream": True})
    outputs, result, _ = await platform.run(request_id)
    times = [platform.sent_at[id(frame)] for frame in outputs]
    assert outputs[0]["payload"]["data"] == "first\n"
    assert times[0] - started < 0.4  # at once, not after the 0.5 s pause
    # between the first and the last (the end flushes at once), one frame per 100 ms at most
    assert all(later - earlier >= 0.09 for earlier, later in itertools.pairwise(times[1:-1]))
    assert 2 <= len(outputs) <= 12  # 40 lines over ≥ 0.4 s went out batched
    assert joined(outputs, "stdout") == "first\n" + "".join(f"line{i}\n" for i in range(1, 41))
    assert result["payload"]["stdout_bytes"] == len(joined(outputs, "stdout"))


async def test_it_flushes_a_full_64_kib_buffer_without_waiting_and_never_sends_more_per_frame(
    connect: Callable[..., Platform],
) -> None:
    platform = connect()
    command = "head -c 300000 /dev/zero | tr '\\0' x"
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", command], "stream": True})
    outputs, result, _ = await platform.run(request_id)
    sizes = [len(frame["payload"]["data"]) for frame in outputs]
    assert max(sizes) <= 64 * 1024 and sum(sizes) == 300000
    assert len(outputs) >= 5
    assert result["payload"]["stdout_bytes"] == 300000


async def test_it_never_splits_a_utf8_character_and_replaces_invalid_bytes(connect: Callable[..., Platform]) -> None:
    platform = connect()
    # "€" is e2 82 ac: written a byte at a time, with pauses longer than the flush interval.
    script = "printf '\\342'; sleep 0.15; printf '\\202'; sleep 0.15; printf '\\254 ok \\377'"
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script], "stream": True})
    outputs, result, _ = await platform.run(request_id)
    assert joined(outputs, "stdout") == "€ ok \ufffd"
    assert outputs[0]["payload"]["data"].startswith("€")
    assert result["payload"]["stdout_bytes"] == 8


async def test_it_streams_raw_bytes_as_base64_when_asked_binary(connect: Callable[..., Platform]) -> None:
    platform = connect()
    script = "printf '\\000\\377\\376abc'; printf '\\342' >&2"
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script], "stream": True, "binary": True})
    outputs, result, _ = await platform.run(request_id)
    assert {frame["payload"]["encoding"] for frame in outputs} == {"base64"}
    assert joined_bytes(outputs, "stdout") == b"\x00\xff\xfeabc"
    assert joined_bytes(outputs, "stderr") == b"\xe2"
    assert (result["payload"]["stdout_bytes"], result["payload"]["stderr_bytes"]) == (6, 1)


async def test_it_bounds_streamed_output_at_max_stream_bytes_unless_it_feeds_a_pipe(
    connect: Callable[..., Platform],
) -> None:
    platform = connect(max_stream_bytes=100_000)
    command = ["sh", "-c", "head -c 200000 /dev/zero; head -c 100000 /dev/zero >&2; echo end >&2"]
    request_id = platform.send("EXECUTE_COMMAND", {"argv": command, "stream": True, "binary": True})
    outputs, result, _ = await platform.run(request_id)
    payload = result["payload"]
    assert payload["stream_truncated"] is True and payload["exit_code"] == 0
    assert payload["stdout_bytes"] + payload["stderr_bytes"] == 100_000
    assert len(joined_bytes(outputs, "stdout")) + len(joined_bytes(outputs, "stderr")) == 100_000

    piped = platform.send("EXECUTE_COMMAND", {"argv": command, "stream": True, "binary": True, "pipe": True})
    outputs, result, _ = await platform.run(piped)
    assert result["payload"]["stream_truncated"] is False
    assert (result["payload"]["stdout_bytes"], result["payload"]["stderr_bytes"]) == (200_000, 100_004)


async def test_it_keeps_the_2_0_result_when_not_streamed_and_says_cancelled(connect: Callable[..., Platform]) -> None:
    platform = connect()
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["echo", "hi"], "stream": False})
    outputs, result, _ = await platform.run(request_id)
    assert outputs == []
    assert result["payload"]["stdout"] == "hi\n" and result["payload"]["cancelled"] is False
    assert "stdout_bytes" not in result["payload"]


# -- cancel --------------------------------------------------------------------------------


async def test_a_cancel_is_acked_and_the_command_answers_cancelled_with_minus_sigterm(
    connect: Callable[..., Platform],
) -> None:
    platform = connect()
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", "echo started; sleep 30"], "stream": True})
    first = await platform.next()
    assert first["payload"]["data"] == "started\n"
    cancel_id = platform.send("CANCEL", {"request_id": request_id})
    _, result, others = await platform.run(request_id)
    assert [(frame["type"], frame["id"], frame["payload"]) for frame in others] == [("ACK", cancel_id, {})]
    assert result["type"] == "COMMAND_RESULT"
    assert result["payload"]["cancelled"] is True
    assert result["payload"]["exit_code"] == -15
    assert result["payload"]["duration_seconds"] < 5
    assert platform.dispatcher.in_flight == 0


async def test_a_command_that_ignores_sigterm_gets_sigkill_after_the_grace(
    connect: Callable[..., Platform], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_module, "CANCEL_GRACE_SECONDS", 0.3)
    platform = connect()
    script = "trap '' TERM; echo started; sleep 30"  # the ignored TERM is inherited by sleep too
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["sh", "-c", script], "stream": True})
    await platform.next()
    platform.send("CANCEL", {"request_id": request_id})
    _, result, others = await platform.run(request_id)
    assert [frame["type"] for frame in others] == ["ACK"]
    assert result["payload"]["cancelled"] is True and result["payload"]["exit_code"] == -9


async def test_a_cancel_of_an_unknown_or_finished_operation_is_acked(connect: Callable[..., Platform]) -> None:
    platform = connect()
    cancel_id = platform.send("CANCEL", {"request_id": "never-sent"})
    ack = await platform.next()
    assert (ack["type"], ack["id"], ack["payload"]) == ("ACK", cancel_id, {})
    done = platform.send("EXECUTE_COMMAND", {"argv": ["true"]})
    await platform.run(done)
    cancel_id = platform.send("CANCEL", {"request_id": done})
    assert (await platform.next())["id"] == cancel_id


async def test_a_cancelled_command_that_is_out_of_credit_still_ends(connect: Callable[..., Platform]) -> None:
    platform = connect(stream_window_bytes=65536)
    request_id = platform.send(
        "EXECUTE_COMMAND", {"argv": ["head", "-c", "10000000", "/dev/zero"], "stream": True, "binary": True}
    )
    stalled = [await platform.next()]
    while len(joined_bytes(stalled)) < 65536:  # the window is spent and nobody grants more
        stalled.append(await platform.next())
    platform.send("CANCEL", {"request_id": request_id})
    outputs, result, _ = await platform.run(request_id, grant=False, within=5)
    assert result["payload"]["cancelled"] is True and result["payload"]["exit_code"] == -15
    assert result["payload"]["stdout_bytes"] == len(joined_bytes(stalled + outputs)) == 65536


async def test_a_cancel_of_a_running_file_operation_answers_cancelled(
    connect: Callable[..., Platform], monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow_stat(jailed: Any, want_hash: bool, cancelled: Any) -> dict[str, Any]:
        cancelled.wait(10)  # a long hash, stopped when the task is cancelled
        return {}

    monkeypatch.setattr("machines.shim.files.stat_path", slow_stat)
    platform = connect()
    request_id = platform.send("FILE_STAT", {"path": ".", "hash": True})
    await asyncio.sleep(0.1)
    cancel_id = platform.send("CANCEL", {"request_id": request_id})
    answers = {frame["id"]: frame for frame in [await platform.next(), await platform.next()]}
    assert answers[cancel_id]["type"] == "ACK"
    assert answers[request_id]["type"] == "ERROR"
    assert answers[request_id]["payload"]["code"] == "CANCELLED"
    assert platform.dispatcher.in_flight == 0


# -- control frames: uncounted, validated, refused on 2.0 ----------------------------------


async def test_control_frames_do_not_count_against_max_concurrent(connect: Callable[..., Platform]) -> None:
    platform = connect(max_concurrent=1)
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["cat"], "stream": True, "stdin": "stream"})
    assert platform.send("FLOW", {"request_id": request_id, "stream": "stdout", "credit_total": 1 << 21})
    platform.send("COMMAND_INPUT", {"request_id": request_id, "data": "hello\n", "encoding": "utf-8", "eof": False})
    echoed = await platform.next()
    assert (echoed["type"], echoed["payload"]["data"]) == ("COMMAND_OUTPUT", "hello\n")
    overloaded = platform.send("FILE_STAT", {"path": "."})
    refused = await platform.next()
    assert (refused["id"], refused["payload"]["code"]) == (overloaded, "SHIM_OVERLOADED")
    cancel_id = platform.send("CANCEL", {"request_id": request_id})
    _, result, others = await platform.run(request_id)
    assert [(frame["type"], frame["id"]) for frame in others] == [("ACK", cancel_id)]
    assert result["payload"]["cancelled"] is True


async def test_a_2_0_connection_refuses_every_live_feature_naming_the_versions(
    connect: Callable[..., Platform],
) -> None:
    platform = connect(protocol_version="2.0")
    for payload in (
        {"stream": True},
        {"stdin": "stream"},
        {"binary": True},
        {"pipe": True},
    ):
        request_id = platform.send("EXECUTE_COMMAND", {"argv": ["true"], **payload})
        refused = await platform.next()
        assert refused["id"] == request_id and refused["type"] == "ERROR"
        assert refused["payload"]["code"] == "UNSUPPORTED_OPERATION"
        assert "2.0" in refused["payload"]["message"] and "2.1" in refused["payload"]["message"]
    for op, payload in (
        ("CANCEL", {"request_id": "x"}),
        ("FLOW", {"request_id": "x", "stream": "stdout", "credit_total": 1}),
        ("COMMAND_INPUT", {"request_id": "x", "data": "", "encoding": "utf-8", "eof": True}),
    ):
        frame_id = platform.send(op, payload)
        refused = await platform.next()
        assert (refused["id"], refused["payload"]["code"]) == (frame_id, "UNSUPPORTED_OPERATION")
        assert "2.0" in refused["payload"]["message"] and op in refused["payload"]["message"]
    plain = platform.send("EXECUTE_COMMAND", {"argv": ["echo", "ok"], "stream": False, "stdin": "null"})
    _, result, _ = await platform.run(plain)
    assert result["payload"]["stdout"] == "ok\n"


@pytest.mark.parametrize(
    "fields",
    [{"stream": "yes"}, {"binary": 1}, {"pipe": "no"}, {"stdin": "file"}, {"stdin": True}],
)
async def test_it_refuses_live_fields_of_the_wrong_type(connect: Callable[..., Platform], fields: dict) -> None:
    platform = connect()
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["true"], **fields})
    refused = await platform.next()
    assert (refused["id"], refused["payload"]["code"]) == (request_id, "INVALID_REQUEST")
    assert next(iter(fields)) in refused["payload"]["message"]


@pytest.mark.parametrize(
    ("op", "payload"),
    [
        ("CANCEL", {}),
        ("FLOW", {"request_id": "x", "stream": "stdin", "credit_total": 5}),
        ("FLOW", {"request_id": "x", "stream": "stdout", "credit_total": -1}),
        ("FLOW", {"request_id": "x", "stream": "stdout", "credit_total": "5"}),
        ("COMMAND_INPUT", {"request_id": "x", "data": "!!", "encoding": "base64"}),
        ("COMMAND_INPUT", {"request_id": "x", "data": "a", "encoding": "latin-1"}),
        ("COMMAND_INPUT", {"request_id": "x", "data": 5}),
        ("COMMAND_INPUT", {"request_id": "x", "data": "a", "eof": "yes"}),
    ],
)
async def test_it_refuses_malformed_control_frames_under_their_own_id(
    connect: Callable[..., Platform], op: str, payload: dict
) -> None:
    platform = connect()
    frame_id = platform.send(op, payload)
    refused = await platform.next()
    assert (refused["type"], refused["id"], refused["payload"]["code"]) == ("ERROR", frame_id, "INVALID_REQUEST")


async def test_flow_and_input_for_an_unknown_operation_are_dropped_silently(connect: Callable[..., Platform]) -> None:
    platform = connect()
    platform.send("FLOW", {"request_id": "gone", "stream": "stdout", "credit_total": 10})
    platform.send("COMMAND_INPUT", {"request_id": "gone", "data": "x", "encoding": "utf-8", "eof": True})
    assert await platform.nothing_within(0.2)


async def test_a_command_cancelled_before_its_process_started_answers_cancelled_and_never_runs(
    connect: Callable[..., Platform], root: Path
) -> None:
    platform = connect()
    request_id = platform.send("EXECUTE_COMMAND", {"argv": ["touch", "ran"], "stream": True})
    cancel_id = platform.send("CANCEL", {"request_id": request_id})  # before its task ever ran
    answers = {frame["id"]: frame for frame in [await platform.next(), await platform.next()]}
    assert answers[cancel_id]["type"] == "ACK"
    assert (answers[request_id]["type"], answers[request_id]["payload"]["code"]) == ("ERROR", "CANCELLED")
    assert not (root / "ran").exists()
