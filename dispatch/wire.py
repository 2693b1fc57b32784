"""Strict JSON for every wire Dispatch reads (``/ws``, ``/ws/shim/``, JSON bodies).

RFC 8259 JSON only: ``NaN``/``Infinity`` and numbers too large for a float are refused
(echoing them would produce frames strict parsers reject), and nesting deep enough to
exhaust Python's recursion is refused as invalid rather than crashing the connection.
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


def loads(text: str | bytes) -> Any:
    """Parse ``text`` as strict JSON. Raises ``ValueError`` saying what is wrong."""
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def encodable(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (no lone surrogates from ``\\ud800`` escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
