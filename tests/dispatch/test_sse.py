"""The one server-sent-event encoder (``dispatch.sse``): the frames every stream wrote by
hand before, byte for byte, and the spec's rules for what a hand-written frame got wrong
or could not say (multi-line data, line ends in a field, comments)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatch.sse import KEEP_ALIVE, sse_comment, sse_event, sse_json

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=20,
)


@given(value=JSON, frame_id=st.integers(min_value=0), event=st.sampled_from(["snapshot", "agent.upsert", "pane"]))
def test_an_id_event_and_json_frame_is_the_one_the_live_streams_wrote(value: Any, frame_id: int, event: str) -> None:
    # agents.stream and peers.stream wrote this f-string.
    old = f"id: {frame_id}\nevent: {event}\ndata: {json.dumps(value, separators=(',', ':'))}\n\n"
    assert sse_event(id=frame_id, event=event, data=sse_json(value)) == old


@given(value=JSON)
def test_an_event_and_json_frame_is_the_one_machine_operations_wrote(value: Any) -> None:
    old = f"event: output\ndata: {json.dumps(value, separators=(',', ':'))}\n\n"
    assert sse_event(event="output", data=sse_json(value)) == old


def test_the_mcp_stream_opening_and_the_keep_alive_are_unchanged() -> None:
    assert sse_event(retry=1000) == "retry: 1000\n\n"
    assert KEEP_ALIVE == ": keep-alive\n\n"
    assert sse_event(event="message", data="{}") == "event: message\ndata: {}\n\n"


def test_json_data_is_one_ascii_line_whatever_the_text_holds() -> None:
    data = sse_json({"text": "a\nb\r\nc\u2028é\ud800"})
    assert data.isascii() and "\n" not in data and "\r" not in data
    assert json.loads(data) == {"text": "a\nb\r\nc\u2028é\ud800"}


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        ("a\nb", ["a", "b"]),
        ("a\r\nb\rc", ["a", "b", "c"]),
        ("a\n", ["a", ""]),
        ("", [""]),
        # Only CR and LF end a line: U+2028 and a form feed are data.
        ("a\u2028b\x0cc", ["a\u2028b\x0cc"]),
    ],
)
def test_multi_line_data_is_one_data_field_per_line(data: str, lines: list[str]) -> None:
    assert sse_event(data=data) == "".join(f"data: {line}\n" for line in lines) + "\n"
    assert _client_data(sse_event(data=data)) == data.replace("\r\n", "\n").replace("\r", "\n")


@pytest.mark.parametrize(
    "fields",
    [
        {"id": "a\nb"},
        {"id": "a\rb"},
        {"id": "a\0b"},
        {"event": "a\nb"},
        {"retry": -1},
        {"retry": True},
        {},
    ],
)
def test_a_field_that_would_break_the_frame_is_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        sse_event(**fields)


def test_a_comment_is_one_colon_line_per_line() -> None:
    assert sse_comment("a\nb") == ": a\n: b\n\n"
    assert sse_comment() == ":\n\n"


def _client_data(frame: str) -> str:
    """The ``data`` a client dispatches for one frame (the spec's "process the field" steps)."""
    values = [line[len("data: ") :] for line in frame.split("\n") if line.startswith("data: ")]
    return "\n".join(values)
