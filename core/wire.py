"""Strict JSON for every wire Dispatch reads (``/ws``, ``/ws/shim/``, JSON bodies).

RFC 8259 JSON only: ``NaN``/``Infinity`` and numbers too large for a float are refused
(echoing them would produce frames strict parsers reject), strings holding a lone
surrogate escape (``"\ud800"``, not Unicode; RFC 8259 §8.2) are refused because no
UTF-8 wire or channel layer can carry them, and nesting deep enough to exhaust Python's
recursion is refused as invalid rather than crashing the connection — and so is anything
nested deeper than ``MAX_DEPTH`` (64) arrays/objects: deeper values parse, but later
copies (the in-memory channel layer deep-copies every message) and ``json.dumps`` recurse
further than the parser did and would fail far from the edge.

``encode`` writes the frames the server sends on ``/ws`` and ``/ws/shim/`` (the shim
package, which imports nothing from ``core``, writes its own with
``machines.shim.protocol.encode``; a test holds the two alike). Both read and write with
orjson, which is several times faster than the standard library on the hot path; the
standard library stays as the fallback that decides (and words) every refusal, so the
wire accepts and refuses exactly what it did before (docs/ws-protocol.md). The one
visible difference: orjson spells a few floats differently (``0.00001``, ``1e-7`` where
Python writes ``1e-05``, ``1e-07``), the same numbers in valid JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is too large")
    return value


MAX_DEPTH = 64


INT_MIN = -(2**63)
INT_MAX = 2**63 - 1
"""The channel layer (msgpack) carries signed 64-bit integers only (its unsigned range is
refused too: the in-memory layer would accept it and Redis would not)."""


def _path(parts: tuple[Any, ...]) -> str:
    """``("args", "xs", 2)`` -> ``args.xs[2]``; the root is ``(root)``."""
    text = ""
    if len(parts) > 8:
        parts = (*parts[:8], "…")
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(root)"


def problem(value: Any, limit: int = MAX_DEPTH, *, root: tuple[Any, ...] = ()) -> str | None:
    """The first thing in a parsed JSON ``value`` the channel layer cannot carry, naming
    its path (``args.n: integer 18446744073709551616 is outside the signed 64-bit range``),
    or ``None``. Checks integers outside ``INT_MIN``..``INT_MAX``, non-finite floats,
    strings and keys holding a lone surrogate, and nesting deeper than ``limit``.
    ``root`` names where ``value`` sits (``("arguments",)``: paths read ``arguments.n``).
    Iterative: any depth is safe to check."""
    stack: list[tuple[Any, tuple[Any, ...], int]] = [(value, root, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, bool) or item is None:
            continue
        if isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                shown = str(item) if abs(item) < 10**40 else f"{str(item)[:20]}… ({len(str(abs(item)))} digits)"
                return f"{_path(where)}: integer {shown} is outside the signed 64-bit range"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{_path(where)}: {item} is not a finite number"
        elif isinstance(item, str):
            if not encodable(item):
                return f"{_path(where)}: a string holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"
        elif isinstance(item, dict | list):
            if depth + 1 > limit:
                return f"{_path(where)}: nested too deeply (more than {limit} levels)"
            if isinstance(item, dict):
                for key, child in item.items():
                    if isinstance(key, str) and not encodable(key):
                        return (
                            f"{_path(where)}: a key holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"
                        )
                    stack.append((child, (*where, key), depth + 1))
            else:
                stack.extend((child, (*where, index), depth + 1) for index, child in enumerate(item))
    return None


# A float at least this large may be an integer literal orjson widened: it reads an integer
# beyond the unsigned 64-bit range as a float, where the standard parser keeps an int (and
# the wire refuses it). No integer orjson keeps as an int is this large and still signed.
_WIDENED = 2.0**63


def _fits(value: Any, depth: int = 1) -> bool:
    """Whether an orjson-parsed ``value`` is one :func:`problem` has nothing to say about:
    no integer outside the signed 64-bit range, no float that is not finite or that orjson
    may have widened from an integer, nesting at most ``MAX_DEPTH`` deep. orjson refuses
    lone surrogates, NaN/Infinity and ``1e400`` by itself, so strings are not looked at.
    A cheap walk (the hot path's): ``False`` only says "ask the standard parser"."""
    if type(value) is dict:
        children: Any = value.values()
    elif type(value) is list:
        children = value
    else:
        return _scalar_fits(value)
    if depth > MAX_DEPTH:
        return False
    for child in children:
        kind = type(child)
        if kind is str or kind is bool or child is None:
            continue
        if kind is int:
            if not INT_MIN <= child <= INT_MAX:
                return False
        elif kind is float:
            if not -_WIDENED < child < _WIDENED:
                return False
        elif not _fits(child, depth + 1):
            return False
    return True


def _scalar_fits(value: Any) -> bool:
    if type(value) is int:
        return INT_MIN <= value <= INT_MAX
    if type(value) is float:
        return -_WIDENED < value < _WIDENED
    return True


def _strict_loads(text: str | bytes) -> Any:
    """The standard library's strict parse: the reference for what the wire accepts, and
    the words of every refusal."""
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    found = problem(value)
    if found is not None:
        raise ValueError(found)
    return value


def loads(text: str | bytes) -> Any:
    """Parse ``text`` as strict JSON that the channel layer can carry. Raises ``ValueError``
    saying what is wrong and where: not JSON, NaN/Infinity, a number too large for a float
    (``1e400``), an integer outside the signed 64-bit range, a lone surrogate, nesting
    deeper than ``MAX_DEPTH`` (see :func:`problem`).

    orjson parses first; whatever it refuses, or parses into something :func:`_fits`
    doubts, is parsed again by the standard library, which returns or refuses it as the
    wire always has (it also reads what orjson does not, such as a UTF-16 body)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return _strict_loads(text)
    if _fits(value):
        return value
    return _strict_loads(text)


def lenient_object(text: str | bytes) -> dict[str, Any] | None:
    """Parse a frame :func:`loads` refused, accepting what the strict parse refuses (NaN,
    big integers, lone surrogates, deep nesting), so that a field of it (a
    ``remote-call-result``'s ``requestId``, a request's ``nonce``) can still be read with
    :func:`lenient_field`; ``None`` when it is not a JSON object at all. Parse once per
    frame: the text can be up to the frame limit."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def lenient_field(frame: dict[str, Any] | None, field: str, *, nested: bool = True) -> Any:
    """The top-level ``field`` of a :func:`lenient_object` (or, with ``nested``, its
    ``body.field``); ``None`` when absent or when there is no object."""
    if frame is None:
        return None
    if field in frame or not nested:
        return frame.get(field)
    body = frame.get("body")
    return body.get(field) if isinstance(body, dict) else None


def encodable(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (no lone surrogates from ``\\ud800`` escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# Dataclasses and datetimes go to the standard library, which refuses them as before.
_ORJSON_OPTIONS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


def encode(message: Any) -> str:
    """Serialise one outgoing frame: compact JSON, non-ASCII text kept as is.

    A string may hold a lone surrogate (a client's ``"\\ud800"`` escape decodes to one),
    which UTF-8 cannot carry: sending the frame would fail. Such a frame is written with
    ``\\u`` escapes instead, which mean the same JSON.

    orjson writes it; what orjson refuses (a lone surrogate, a key that is not a string,
    an integer beyond 64 bits, nesting past its limit) is written by the standard library,
    which also raises ``TypeError`` for a value JSON cannot hold, as before. A non-finite
    float (no checked input carries one) is written as ``null``, never as ``NaN``.
    """
    try:
        return orjson.dumps(message, option=_ORJSON_OPTIONS).decode()
    except TypeError:
        return _encode_standard(message)


def _encode_standard(message: Any) -> str:
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
    if not text.isascii() and not encodable(text):
        return json.dumps(message, separators=(",", ":"))
    return text
