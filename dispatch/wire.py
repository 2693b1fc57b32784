"""Strict JSON for every wire Dispatch reads (``/ws``, ``/ws/shim/``, JSON bodies).

RFC 8259 JSON only: ``NaN``/``Infinity`` and numbers too large for a float are refused
(echoing them would produce frames strict parsers reject), strings holding a lone
surrogate escape (``"\ud800"``, not Unicode; RFC 8259 §8.2) are refused because no
UTF-8 wire or channel layer can carry them, and nesting deep enough to exhaust Python's
recursion is refused as invalid rather than crashing the connection — and so is anything
nested deeper than ``MAX_DEPTH`` (64) arrays/objects: deeper values parse, but later
copies (the in-memory channel layer deep-copies every message) and ``json.dumps`` recurse
further than the parser did and would fail far from the edge.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is too large")
    return value


MAX_DEPTH = 64


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests arrays/objects more than ``limit`` levels (iterative walk)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def loads(text: str | bytes) -> Any:
    """Parse ``text`` as strict JSON. Raises ``ValueError`` saying what is wrong (including
    nesting deeper than ``MAX_DEPTH``)."""
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if isinstance(value, dict | list) and _too_deep(value, MAX_DEPTH):
        raise ValueError(f"nested too deeply (more than {MAX_DEPTH} levels)")
    escaped = b"\\u" in text if isinstance(text, bytes) else "\\u" in text
    if escaped and not encodable(json.dumps(value, ensure_ascii=False)):
        raise ValueError("a string holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text")
    return value


def encodable(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (no lone surrogates from ``\\ud800`` escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
