"""Every write of the peers app is a service (docs/architecture.md#the-layers): no module
of ``peers`` outside ``peers/services/`` (and the migrations) calls an ORM write method.
The loops, the peer client, the HTTP exchanges and the edges call ``peers.services``
instead.

The check reads the source with ``ast``: a call of a method named like an ORM write
(``save``, ``create``, ``update``, ``delete``, ``select_for_update`` …) on anything counts,
so a ``dict.update`` outside the services would be refused too — name it otherwise (``|``,
``dict(…, **…)``) rather than teach this test types.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "peers"
ORM_WRITES = frozenset(
    {
        "save",
        "create",
        "get_or_create",
        "update_or_create",
        "update",
        "delete",
        "bulk_create",
        "bulk_update",
        "select_for_update",
    }
)


def orm_writes_in(source: str) -> list[tuple[int, str]]:
    """``(line, "receiver.method")`` for every call of an ORM write method in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ORM_WRITES:
            found.append((node.lineno, f"{ast.unparse(node.func.value)}.{node.func.attr}"))
    return sorted(found)


def modules_outside_services() -> list[Path]:
    return [
        path
        for path in sorted(PEERS.rglob("*.py"))
        if not {"services", "migrations"} & set(path.relative_to(PEERS).parts[:-1])
    ]


def test_the_checker_sees_writes_however_they_are_spelled() -> None:
    source = (
        "def f(peer, rows):\n"
        "    peer.save(update_fields=['label'])\n"
        "    Peer.objects.filter(pk=1).update(label='x')\n"
        "    rows.select_for_update().first().delete()\n"
        "    Receipt.objects.bulk_create([])\n"
        "    Peer.objects.get(pk=1)\n"
    )
    assert orm_writes_in(source) == [
        (2, "peer.save"),
        (3, "Peer.objects.filter(pk=1).update"),
        (4, "rows.select_for_update"),
        (4, "rows.select_for_update().first().delete"),
        (5, "Receipt.objects.bulk_create"),
    ]


def test_no_peers_module_outside_services_writes() -> None:
    modules = modules_outside_services()
    names = {path.relative_to(ROOT).as_posix() for path in modules}
    # The scan reads the modules that used to write (a moved tree would make it vacuous).
    assert {"peers/outbox_drain.py", "peers/pairing_exchange.py", "peers/mirror.py", "peers/remote_launch.py"} <= names
    assert "peers/services/shadows.py" not in names and not any("/migrations/" in name for name in names)
    writes = [
        f"{path.relative_to(ROOT)}:{line}: {method}()"
        for path in modules
        for line, method in orm_writes_in(path.read_text(encoding="utf-8"))
    ]
    assert writes == [], "writes outside peers/services/ (move them into a service):\n" + "\n".join(writes)
