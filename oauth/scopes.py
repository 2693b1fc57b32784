"""What an OAuth token's scopes let it do over MCP (docs/mcp.md#oauth-scopes).

``mcp`` is every tool. The narrower scopes each add one kind of tool, so a user can grant
"remotes only" (``mcp:remotes``), "machines read-only" (``mcp:machines:read``) or "everything
but a shell" (all but ``mcp:machines:shell``) on the consent page. A header token (API or
agent token) has no scopes: ``Caller.scopes`` is ``None`` and every tool is its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from core.tools import NATIVE, Tool
from machines.tools import MACHINE_TOOL_NAMES

ALL = "mcp"
AGENTS = "mcp:agents"
REMOTES = "mcp:remotes"
MACHINES_READ = "mcp:machines:read"
MACHINES_WRITE = "mcp:machines:write"
MACHINES_SHELL = "mcp:machines:shell"
NARROW = (AGENTS, REMOTES, MACHINES_READ, MACHINES_WRITE, MACHINES_SHELL)
"""The scopes a user may pick instead of ``mcp``, in the order the consent page lists them."""

_MACHINE_READ = frozenset(["list_machines", "local_pc_file_read", "local_pc_file_list", "local_pc_file_stat"])
_MACHINE_WRITE = frozenset(["local_pc_file_write", "local_pc_file_delete", "local_pc_file_move", "local_pc_file_copy"])


def tool_scope(tool: Tool) -> str:
    """The narrow scope a tool needs: a remote's function ``mcp:remotes``; a machine tool
    by what it can do (reading, writing files, or running anything — a machine tool not
    named here counts as a shell, the safe side); every other native tool ``mcp:agents``."""
    if tool.source != NATIVE:
        return REMOTES
    if tool.name in _MACHINE_READ:
        return MACHINES_READ
    if tool.name in _MACHINE_WRITE:
        return MACHINES_WRITE
    if tool.name in MACHINE_TOOL_NAMES:
        return MACHINES_SHELL
    return AGENTS


def allows(scopes: frozenset[str] | None, tool: Tool) -> bool:
    """Whether a caller with ``scopes`` (``None``: a header token, unrestricted) may list and call ``tool``."""
    return scopes is None or ALL in scopes or tool_scope(tool) in scopes


def granted(requested: Iterable[str]) -> list[str]:
    """``requested`` reduced to what means something: ``["mcp"]`` when it includes ``mcp``
    (the narrow ones add nothing to it), else the known narrow scopes in their listed order."""
    wanted = set(requested)
    if ALL in wanted:
        return [ALL]
    return [scope for scope in NARROW if scope in wanted]
