"""Only ``core.realtime`` talks to the channel layer's groups and receives from it
(docs/architecture.md#how-the-code-is-written: one request/reply, one after-commit ring, one
doorbell wait).

The check reads the code, not the text: it parses every module of the server packages and
flags any attribute named ``group_send`` or ``receive`` — a call such as
``layer.receive(channel)``, and a reference such as ``async_to_sync(layer.group_send)``.
Comments and docstrings may name them. Exempt, and why:

- ``core/realtime/`` (its modules): the one place that does it;
- ``core/channel_layer.py``: the layers themselves (the in-memory layer's ``receive``
  wraps Channels' own with ``super().receive``);
- Channels' own consumer machinery (``AsyncConsumer.__call__`` reads a consumer's channel
  with ``channel_layer.receive`` and dispatches to its handlers): it lives in the
  ``channels`` package, and our consumers never call it by name;
- the ASGI ``receive`` callable a consumer's ``__call__(scope, receive, send)`` is handed
  (``core.consumers``): a parameter, not an attribute of the layer;
- tests (they ring and read the layer to check what the code does).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "remotes", "machines", "agents", "peers", "dispatch")
FORBIDDEN = frozenset({"group_send", "receive"})
REALTIME = sorted((ROOT / "core" / "realtime").glob("*.py"))  # the package, one module per concern
EXEMPT = frozenset({*(path.relative_to(ROOT).as_posix() for path in REALTIME), "core/channel_layer.py"})


def _uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN
    ]


def _sources() -> list[Path]:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 100, "the packages were not found"
    return files


def test_no_module_but_core_realtime_calls_group_send_or_receive_on_the_layer() -> None:
    offending = [use for path in _sources() if path.relative_to(ROOT).as_posix() not in EXEMPT for use in _uses(path)]
    assert offending == [], "use core.realtime (ring_on_commit, Subscription, request_reply):\n" + "\n".join(offending)


def test_the_check_sees_the_calls_it_forbids() -> None:
    # core.realtime does call both: a checker that found nothing there would prove nothing.
    found = {use.rsplit(".", 1)[1] for path in REALTIME for use in _uses(path)}
    assert found == {"group_send", "receive"}
