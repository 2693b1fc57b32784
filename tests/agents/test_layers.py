"""The agents app sits below peers and its domain below its edges (docs/architecture.md#the-layers).

Every ``import`` is read, function-level ones included (a lazy import that hides a circle
is a circle): no agents module but an edge names ``peers`` (an edge sits above every app's
domain, so it may), and no domain module of agents names an edge (REST, pages, admin, tools,
the event stream) or the project package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import agents

AGENTS = Path(agents.__file__).parent
EDGES = {
    "agents.api",
    "agents.views",
    "agents.admin",
    "agents.tools",
    "agents.tool_handlers",
    "agents.stream",
    "agents.urls",
    "agents.page_urls",
}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules() -> dict[str, Path]:
    return {"agents." + path.stem: path for path in AGENTS.glob("*.py") if path.stem != "__init__"}


def test_no_agents_module_but_an_edge_imports_peers() -> None:
    offenders = {
        name: sorted(n for n in imported(path) if n == "peers" or n.startswith("peers."))
        for name, path in modules().items()
        if name not in EDGES
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_agent_lifecycle_and_the_rows_import_no_edge() -> None:
    domain = ("services", "selectors", "lifecycle", "cli", "supervisor", "messages", "launching", "prompting", "hooks")
    offenders = {}
    for stem in domain:
        path = AGENTS / f"{stem}.py"
        if not path.exists():
            continue
        found = sorted(n for n in imported(path) if n in EDGES or n == "dispatch" or n.startswith("dispatch."))
        if found:
            offenders[stem] = found
    assert offenders == {}
