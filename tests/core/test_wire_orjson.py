"""The wire reads and writes with orjson and refuses exactly what it refused before
(core.wire): every refusal is worded by the standard parser."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import wire

REFUSED = {
    "18446744073709551616": "(root): integer 18446744073709551616 is outside the signed 64-bit range",
    "[18446744073709551615]": "[0]: integer 18446744073709551615 is outside the signed 64-bit range",
    '{"a": -9223372036854775809}': "a: integer -9223372036854775809 is outside the signed 64-bit range",
    '{"n": 123456789012345678901234567890}': "n: integer 123456789012345678901234567890 is outside the signed "
    "64-bit range",
    "1e400": "number 1e400 is too large",
    "[NaN]": "NaN is not valid JSON",
    '{"a": -Infinity}': "-Infinity is not valid JSON",
    '["\\ud800"]': "[0]: a string holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text",
    '{"\\udcff": 1}': "(root): a key holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text",
    "[" * 65 + "]" * 65: "[0][0][0][0][0][0][0][0].…: nested too deeply (more than 64 levels)",
    "[" * 5000 + "]" * 5000: "nested too deeply",
}


@pytest.mark.parametrize(("text", "message"), REFUSED.items())
def test_it_refuses_what_the_channel_layer_cannot_carry_in_the_same_words(text: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        wire.loads(text)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "text",
    [
        "[" * 64 + "]" * 64,
        "9223372036854775807",
        "-9223372036854775808",
        "[1e19, -1e19, 1e-400, -0, -0.0]",
        '{"a": 1, "a": 2}',
        '"\\ud83d\\ude00 \\u0000"',
        "\ufeff[1]",
        "[1,]",
        "",
    ],
)
def test_it_reads_or_refuses_like_the_standard_parser(text: str) -> None:
    try:
        expected: Any = ("read", json.loads(text))
    except ValueError as exc:
        expected = ("refused", type(exc), str(exc))
    try:
        found: Any = ("read", wire.loads(text))
    except ValueError as exc:
        found = ("refused", type(exc), str(exc))
    assert found == expected


def test_it_reads_a_body_in_utf_16_as_before() -> None:
    assert wire.loads('{"a": [1]}'.encode("utf-16")) == {"a": [1]}


def test_it_never_writes_a_token_strict_parsers_reject() -> None:
    text = wire.encode({"a": math.nan, "b": [math.inf, -math.inf]})
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f"wrote {name}")) == {"a": None, "b": [None, None]}


@pytest.mark.parametrize(
    "value",
    [
        {"text": "Grüße, 東京 ✓", "n": [1, 2.5, None, True, 2**63 - 1]},
        {"name": "bad\udcff.txt", "nested": {"deeper": ["\ud800"]}},
        {1: "a key that is not a string"},
        {"big": 2**70},
        {"control": "\x00\x1f\x7f\u2028", "quote": '"\\'},
    ],
)
def test_an_encoded_frame_reads_back_as_the_standard_library_writes_it(value: Any) -> None:
    assert json.loads(wire.encode(value)) == json.loads(json.dumps(value))


def test_it_still_refuses_to_write_what_json_cannot_hold() -> None:
    with pytest.raises(TypeError):
        wire.encode({"a": object()})


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_a_frame_reads_back_as_the_standard_parser_reads_it(value: Any) -> None:
    text = json.dumps(value, ensure_ascii=False)
    expected = wire.problem(value)
    if expected is not None:
        with pytest.raises(ValueError, match="^" + re.escape(expected) + "$"):
            wire.loads(text)
        return
    assert wire.loads(text) == json.loads(text)
    assert json.loads(wire.encode(value)) == value
