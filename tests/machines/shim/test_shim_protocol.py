"""Envelope helpers, limits negotiation, URLs, backoff and frame caps (docs/shim-protocol.md)."""

from __future__ import annotations

import json
import random

import pytest

from machines.shim import Limits, ShimError, reconnect_delay, websocket_url
from machines.shim.connection import fit_frame
from machines.shim.protocol import MAX_MESSAGE_BYTES, decode, encode, envelope, major_version


def test_it_builds_the_envelope_of_every_frame() -> None:
    frame = envelope("PING", {}, frame_id="abc", session_id="s", target_machine="m")
    assert set(frame) == {"type", "id", "ts", "version", "session_id", "target_machine", "payload"}
    assert (frame["type"], frame["id"], frame["version"], frame["payload"]) == ("PING", "abc", "2.1", {})
    assert isinstance(frame["ts"], float)


@pytest.mark.parametrize("text", ["not json", "[1]", '{"id": "x"}', '{"type": "PING", "payload": [1]}', b"{}"])
def test_it_refuses_frames_that_are_not_envelopes(text: str | bytes) -> None:
    with pytest.raises(ShimError) as caught:
        decode(text)
    assert caught.value.code == "INVALID_REQUEST"


def test_it_fills_in_a_missing_payload() -> None:
    assert decode('{"type": "PING", "id": "1"}')["payload"] == {}


def test_it_encodes_file_names_that_are_not_utf8() -> None:
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    text = encode({"path": name})
    text.encode("utf-8")  # must not raise
    assert json.loads(text)["path"] == name


def test_it_lowers_its_limits_to_the_platforms() -> None:
    own = Limits(
        max_file_size_bytes=4096, command_timeout_seconds=60, max_command_timeout_seconds=120, max_concurrent=8
    )
    lowered = own.lower(
        {
            "max_file_size_bytes": 10_000,
            "command_timeout_seconds": 30,
            "max_command_timeout_seconds": 600,
            "max_concurrent": 4,
        }
    )
    assert lowered == Limits(
        max_file_size_bytes=4096, command_timeout_seconds=30, max_command_timeout_seconds=120, max_concurrent=4
    )
    assert own.lower({"max_concurrent": "many", "max_file_size_bytes": -1}) == own
    assert Limits(command_timeout_seconds=30).lower({"max_command_timeout_seconds": 10}).command_timeout_seconds == 10


def test_it_knows_major_versions() -> None:
    assert major_version("2.0") == 2 and major_version("3.11") == 3
    assert major_version("2") is None and major_version(2.0) is None


@pytest.mark.parametrize(
    ("server", "url"),
    [
        ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/ws/shim/"),
        ("https://dispatch.example/", "wss://dispatch.example/ws/shim/"),
        ("https://example.org/dispatch", "wss://example.org/dispatch/ws/shim/"),
        ("ws://h:1/ws/shim/", "ws://h:1/ws/shim/"),
    ],
)
def test_it_derives_the_websocket_url_from_the_base_url(server: str, url: str) -> None:
    assert websocket_url(server) == url


@pytest.mark.parametrize("server", ["ftp://h", "127.0.0.1:8000", "http://"])
def test_it_refuses_a_server_that_is_not_a_base_url(server: str) -> None:
    with pytest.raises(ValueError):
        websocket_url(server)


def test_it_backs_off_exponentially_to_a_minute_with_jitter() -> None:
    rng = random.Random(7)
    for attempt, base in [(0, 1), (1, 2), (3, 8), (5, 32), (6, 60), (40, 60)]:
        delays = [reconnect_delay(attempt, rng=rng) for _ in range(50)]
        assert all(base <= delay <= base + 5 for delay in delays)
        assert max(delays) - min(delays) > 1  # jittered
    assert reconnect_delay(6, scale=0.01, rng=rng) <= 0.65


def test_it_shrinks_an_oversized_command_result_to_fit_a_frame() -> None:
    control = "\x01" * (4 * 1024 * 1024)  # JSON-escaped as \u0001: six bytes each
    frame = envelope(
        "COMMAND_RESULT",
        {
            "stdout": control,
            "stderr": "",
            "exit_code": 0,
            "timed_out": False,
            "duration_seconds": 1.0,
            "output_truncated": False,
        },
        frame_id="r",
    )
    text = fit_frame(frame)
    assert len(text.encode()) <= MAX_MESSAGE_BYTES
    payload = json.loads(text)["payload"]
    assert payload["output_truncated"] is True and payload["exit_code"] == 0
    assert 0 < len(payload["stdout"]) < len(control)


def test_it_turns_other_oversized_responses_into_file_too_large() -> None:
    frame = envelope("FILE_CONTENTS", {"content": "\x01" * (4 * 1024 * 1024)}, frame_id="r")
    answer = json.loads(fit_frame(frame))
    assert (answer["type"], answer["id"], answer["payload"]["code"]) == ("ERROR", "r", "FILE_TOO_LARGE")
