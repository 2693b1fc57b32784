"""The machine tools, ready for agents and MCP (machines.md §6 "Tools").

``machine_tools(user=…, session_id=…)`` builds ``list_machines`` and the ``local_pc_*``
tools (``core.tools.Tool``) with JSON-schema parameters and descriptions computed for
this request (they list the attached machines when two or more are attached). Calling one
validates the arguments against its schema and runs it; an operation's result is the
response payload plus the ``machine_id`` that served it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.models import User

from core.tools import Tool, ToolHandler
from machines.services import router
from machines.services.copy import copy_between_machines
from machines.services.operations import list_machines, machine_op

ROUTING_NOTE = (
    "If you don't pass target_machine, the router picks based on capability, your default machine and recency."
)

_TARGET = {
    "type": ["string", "null"],
    "description": "Machine id, host name, display name or a unique prefix; unset: the router decides.",
}
_SESSION = {"type": "string", "description": "The machine session to act in (default: your own)."}
_PATH = {"type": "string", "description": "Absolute path, or relative to the machine's first allowed root."}


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {**properties, "target_machine": _TARGET, "session_id": _SESSION},
        "required": required,
        "additionalProperties": False,
    }


# name → (operation, summary, parameters)
OPERATION_TOOLS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "local_pc_execute_command": (
        "EXECUTE_COMMAND",
        "Run a command on a machine: argv without a shell, or command through the user's shell. "
        "Returns stdout, stderr, exit_code, timed_out, duration_seconds, output_truncated.",
        _schema(
            {
                "argv": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "command": {"type": "string"},
                "cwd": {"type": "string"},
                "timeout_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 600},
                "env": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            [],
        ),
    ),
    "local_pc_file_read": (
        "FILE_READ",
        "Read a file (utf-8 or base64; page through large files with offset and length in bytes).",
        _schema(
            {
                "path": _PATH,
                "encoding": {"enum": ["utf-8", "base64"], "default": "utf-8"},
                "offset": {"type": "integer", "minimum": 0},
                "length": {"type": "integer", "minimum": 1},
            },
            ["path"],
        ),
    ),
    "local_pc_file_write": (
        "FILE_WRITE",
        "Write (or append to) a file.",
        _schema(
            {
                "path": _PATH,
                "content": {"type": "string"},
                "encoding": {"enum": ["utf-8", "base64"], "default": "utf-8"},
                "create_parents": {"type": "boolean"},
                "append": {"type": "boolean"},
            },
            ["path", "content"],
        ),
    ),
    "local_pc_file_list": (
        "FILE_LIST",
        "List a directory (optionally recursive, filtered by a glob).",
        _schema(
            {
                "path": _PATH,
                "glob": {"type": "string"},
                "recursive": {"type": "boolean"},
                "include_hidden": {"type": "boolean"},
                "max_entries": {"type": "integer", "minimum": 1, "maximum": 10000},
            },
            ["path"],
        ),
    ),
    "local_pc_file_stat": (
        "FILE_STAT",
        "Describe a path: exists, is_file, is_dir, size, mtime, mode; sha256 with hash: true.",
        _schema({"path": _PATH, "hash": {"type": "boolean"}}, ["path"]),
    ),
    "local_pc_file_delete": (
        "FILE_DELETE",
        "Delete a file or (with recursive) a directory.",
        _schema({"path": _PATH, "recursive": {"type": "boolean"}, "missing_ok": {"type": "boolean"}}, ["path"]),
    ),
    "local_pc_file_move": (
        "FILE_MOVE",
        "Move or rename a path on one machine.",
        _schema({"src": _PATH, "dst": _PATH, "overwrite": {"type": "boolean"}}, ["src", "dst"]),
    ),
}

COPY_PARAMETERS = {
    "type": "object",
    "properties": {
        "source_machine": {"type": "string"},
        "source_path": _PATH,
        "destination_machine": {"type": "string"},
        "destination_path": _PATH,
        "overwrite": {"type": "boolean", "default": False},
        "session_id": _SESSION,
    },
    "required": ["source_machine", "source_path", "destination_machine", "destination_path"],
    "additionalProperties": False,
}
LIST_PARAMETERS = {"type": "object", "properties": {"session_id": _SESSION}, "additionalProperties": False}

async def machine_tools(
    *, user: User, session_id: str, caller: str, session_guard: Callable[[str], None] | None = None
) -> list[Tool]:
    """``list_machines`` and the ``local_pc_*`` tools for ``user`` acting in ``session_id``.

    A call's ``session_id`` argument picks another session of the user; ``session_guard``,
    when given, is called with it first and may refuse it by raising ``DispatchError``
    (an agent acts only in its own session: ``agents.tokens.agent_scope_session``).

    Descriptions are computed now: with two or more machines attached they say how the
    router decides and list the machines by name.
    """
    attached = await database_sync_to_async(router.attached_candidates)(user=user, session_id=session_id)
    note = ""
    if len(attached) >= 2:
        names = ", ".join(f"{c.name} ({', '.join(c.granted_capabilities) or 'no capabilities'})" for c in attached)
        note = f" {ROUTING_NOTE} Attached machines: {names}."
    elif len(attached) == 1:
        note = f" Attached machine: {attached[0].name}."
    else:
        note = " No machine is attached to this session right now."

    def session_of(arguments: dict[str, Any]) -> str:
        chosen = str(arguments.get("session_id") or session_id)
        if session_guard is not None:
            session_guard(chosen)
        return chosen

    tools = [
        Tool(
            name="list_machines",
            description="List the machines attached to the session, with status, capabilities and which is default.",
            parameters=LIST_PARAMETERS,
            handler=lambda arguments: database_sync_to_async(list_machines)(
                user=user, session_id=session_of(arguments)
            ),
        )
    ]
    for name, (op, summary, parameters) in OPERATION_TOOLS.items():
        tools.append(
            Tool(
                name=name,
                description=summary + note,
                parameters=parameters,
                handler=_operation(user, op, session_of, caller),
            )
        )

    async def copy(arguments: dict[str, Any]) -> Any:
        return await copy_between_machines(
            user=user,
            session_id=session_of(arguments),
            source_machine=arguments["source_machine"],
            source_path=arguments["source_path"],
            destination_machine=arguments["destination_machine"],
            destination_path=arguments["destination_path"],
            overwrite=bool(arguments.get("overwrite", False)),
            caller=caller,
        )

    tools.append(
        Tool(
            name="local_pc_file_copy",
            description="Copy a file from one machine to another through the platform, verified by SHA-256." + note,
            parameters=COPY_PARAMETERS,
            handler=copy,
        )
    )
    return tools


def _operation(user: User, op: str, session_of: Callable[[dict[str, Any]], str], caller: str) -> ToolHandler:
    async def run(arguments: dict[str, Any]) -> Any:
        payload = {k: v for k, v in arguments.items() if k not in ("target_machine", "session_id")}
        response = await machine_op(
            user=user,
            session_id=session_of(arguments),
            op=op,
            payload=payload,
            target_machine=arguments.get("target_machine"),
            caller=caller,
        )
        return {**response["payload"], "machine_id": response["machine_id"]}

    return run
