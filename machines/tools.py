"""The machine tools, ready for agents and MCP (docs/mcp.md#tools).

``machine_tools(user=…, session_id=…)`` builds ``list_machines`` and the ``local_pc_*``
tools (``core.tools.Tool``) with JSON-schema parameters and descriptions computed for
this request (they list the attached machines when two or more are attached). Calling one
validates the arguments against its schema and runs it; an operation's result is the
response payload plus the ``machine_id`` that served it.

Every operation tool takes ``target_machines`` (a list of names, or ``"*"``:
every attached machine with the capability), exclusive with ``target_machine``; its
result is then ``{"results": [{machine_id, name, ok, result | error}]}``, one entry per
machine. ``local_pc_pipe`` streams a command's stdout on one machine into a command's
stdin on another. When the edge running the call listens for progress
(``core.tools.TOOL_CALL``), ``local_pc_execute_command`` runs streamed and reports the
bytes of output so far with the latest complete output line (``OutputProgress``), and
``local_pc_file_copy`` and ``local_pc_pipe`` report bytes moved — at most
``PROGRESS_PER_SECOND`` reports a second, and always a final one.

A command that may outlive a connector's ~60 s cut on a tool call runs behind a handle
(``COMMAND_HANDLE_TOOL_NAMES``, docs/live-operations.md#long-commands-handles):
``local_pc_command_start`` returns a ``command_id`` at once, ``local_pc_command_read`` and
``local_pc_command_wait`` page its output and result, ``local_pc_command_cancel`` stops it;
any server process answers each (``machines.services.command_runs``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Awaitable, Callable
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.models import User

from core.errors import InvalidRequest
from core.tools import TOOL_CALL, OutputReport, ProgressReport, Tool, ToolHandler
from core.validation import parse_plain
from machines import selectors
from machines.schemas import CALLER_PAYLOAD_MODELS, SessionCopyBody, SessionPipeBody
from machines.services import command_runs, live, router
from machines.services.copy import copy_between_machines
from machines.services.live import Output
from machines.services.operations import machine_op
from machines.shim.protocol import MessageType

PROGRESS_PER_SECOND = 4  # at most this many progress reports a second (plus the final one)
PROGRESS_LINE_MAX = 200  # characters of the latest output line a progress report carries
PARTIAL_LINE_MAX = 4096  # characters of an unfinished line kept per stream

ROUTING_NOTE = (
    "If you don't pass target_machine, the router picks based on capability, your default machine and recency."
)

_TARGET = {
    "type": ["string", "null"],
    "description": "Machine id, host name, display name or a unique prefix; unset: the router decides.",
}
_TARGETS = {
    "anyOf": [
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"const": "*"},
    ],
    "description": 'Run on each of these machines in parallel ("*": every attached machine that can); '
    "exclusive with target_machine. The result is then per machine.",
}
FAN_OUT_NOTE = (
    ' Give target_machines (a list of machine names, or "*" for every attached machine that can) instead of '
    "target_machine to run it on several machines in parallel: the result is then "
    '{"results": [{machine_id, name, ok, result | error}]}, one entry per machine, so one unreachable machine '
    "is one failed entry."
)
_SESSION = {"type": "string", "description": "The machine session to act in (default: your own)."}


def _schema(op: str) -> dict[str, Any]:
    """The input schema of ``op``'s tool: its caller payload model's
    (``machines.schemas.CALLER_PAYLOAD_MODELS``, from ``machines.shim.payloads``), plus where
    to run it. Unknown arguments are refused (a typo is not silently ignored)."""
    payload = CALLER_PAYLOAD_MODELS[op].model_json_schema()
    properties = {name: _tool_property(schema) for name, schema in payload["properties"].items()}
    return {
        "type": "object",
        "properties": {**properties, "target_machine": _TARGET, "target_machines": _TARGETS, "session_id": _SESSION},
        "required": payload.get("required", []),
        "additionalProperties": False,
    }


def _tool_property(schema: dict[str, Any]) -> dict[str, Any]:
    """A payload property's schema as a tool states it: without pydantic's ``title`` (the
    name again: words a model reads for nothing), and an optional field (``anyOf [X,
    null]``, default ``null``) as ``X``: a tool call leaves it out rather than sending null."""
    schema = {key: value for key, value in schema.items() if key != "title"}
    branches = schema.get("anyOf")
    if schema.get("default", ...) is None and isinstance(branches, list) and {"type": "null"} in branches:
        others = [branch for branch in branches if branch != {"type": "null"}]
        if len(others) == 1:
            rest = {key: value for key, value in schema.items() if key not in ("anyOf", "default")}
            schema = {**others[0], **rest}
    return schema


# name → (operation, summary, parameters)
OPERATION_TOOLS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "local_pc_execute_command": (
        "EXECUTE_COMMAND",
        "Run a command on a machine: argv without a shell, or command through the user's shell. "
        "Returns stdout, stderr, exit_code, timed_out, duration_seconds, output_truncated. While it runs, "
        "progress notifications (when your client asks for them) carry the bytes of output so far and the "
        "latest output line; cancelling the call stops the command.",
        _schema(MessageType.EXECUTE_COMMAND),
    ),
    "local_pc_file_read": (
        "FILE_READ",
        "Read a file (utf-8 or base64; page through large files with offset and length in bytes).",
        _schema(MessageType.FILE_READ),
    ),
    "local_pc_file_write": (
        "FILE_WRITE",
        "Write (or append to) a file.",
        _schema(MessageType.FILE_WRITE),
    ),
    "local_pc_file_list": (
        "FILE_LIST",
        "List a directory (optionally recursive, filtered by a glob).",
        _schema(MessageType.FILE_LIST),
    ),
    "local_pc_file_stat": (
        "FILE_STAT",
        "Describe a path: exists, is_file, is_dir, size, mtime, mode; sha256 with hash: true.",
        _schema(MessageType.FILE_STAT),
    ),
    "local_pc_file_delete": (
        "FILE_DELETE",
        "Delete a file or (with recursive) a directory.",
        _schema(MessageType.FILE_DELETE),
    ),
    "local_pc_file_move": (
        "FILE_MOVE",
        "Move or rename a path on one machine.",
        _schema(MessageType.FILE_MOVE),
    ),
}


def _copy_parameters() -> dict[str, Any]:
    """``local_pc_file_copy``'s input schema: ``SessionCopyBody``'s fields but the REST
    route's own (``stream``, ``request_id``: a tool call reports progress and is cancelled
    by its edge), plus the session."""
    body = SessionCopyBody.model_json_schema()
    properties = {
        name: _tool_property(schema) for name, schema in body["properties"].items() if name not in COPY_REST_ONLY
    }
    return {
        "type": "object",
        "properties": {**properties, "session_id": _SESSION},
        "required": body["required"],
        "additionalProperties": False,
    }


COPY_REST_ONLY = ("stream", "request_id")
COPY_PARAMETERS = _copy_parameters()
PIPE_DESCRIPTIONS = {
    "source": "{machine, argv | command, cwd?}: its stdout is piped",
    "destination": "{machine, argv | command, cwd?}: reads the pipe on stdin",
    "timeout_seconds": "bounds the whole pipe",
}


def _pipe_parameters() -> dict[str, Any]:
    """``local_pc_pipe``'s input schema: ``SessionPipeBody``'s fields but ``request_id`` (a
    tool call is cancelled by its edge), each with what it is for a model, plus the session."""
    body = SessionPipeBody.model_json_schema()
    properties = {
        name: {**_tool_property(schema), "description": PIPE_DESCRIPTIONS[name]}
        for name, schema in body["properties"].items()
        if name != "request_id"
    }
    return {
        "type": "object",
        "properties": {**properties, "session_id": _SESSION},
        "required": body["required"],
        "additionalProperties": False,
    }


PIPE_PARAMETERS = _pipe_parameters()
PIPE_SUMMARY = (
    "Pipe the stdout of a command on one machine into the stdin of a command on another, through the platform "
    "(constant memory; both machines need shell). Each end is {machine, argv | command, cwd?}. Returns "
    "{request_id, bytes, source: {exit_code, stderr, ...}, destination: {exit_code, stdout, stderr, ...}}. "
    "The source failing closes the destination's stdin; the destination exiting first stops the source. "
    "No target_machines: a pipe joins exactly two machines."
)
LIST_PARAMETERS = {"type": "object", "properties": {"session_id": _SESSION}, "additionalProperties": False}


_COMMAND_ID = {
    "type": "string",
    "pattern": command_runs.COMMAND_ID_PATTERN.pattern,
    "description": "The command_id local_pc_command_start returned.",
}
_OFFSET = {
    "type": "object",
    "properties": {"stdout": {"type": "integer", "minimum": 0}, "stderr": {"type": "integer", "minimum": 0}},
    "additionalProperties": False,
    "description": "Bytes of each stream already read: pass the previous answer's next_offset to get only "
    "what is new (default: from the start).",
}


def _start_parameters() -> dict[str, Any]:
    """``local_pc_command_start``'s input schema: ``local_pc_execute_command``'s, with
    ``target_machines`` kept only to be refused with a clear message (a handle follows one
    command on one machine)."""
    schema = _schema(MessageType.EXECUTE_COMMAND)
    targets = {
        "description": "Not supported here: a handle follows one command on one machine "
        "(use local_pc_execute_command to run on several)."
    }
    return {**schema, "properties": {**schema["properties"], "target_machines": targets}}


COMMAND_HANDLE_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "local_pc_command_start": (
        "Start a command that may run longer than a minute and return at once with "
        '{command_id, machine, machine_id, status: "running", started_at}; follow it with '
        "local_pc_command_read, local_pc_command_wait and local_pc_command_cancel. Same arguments as "
        "local_pc_execute_command (one machine). The output is kept up to 1 MiB per stream; the handle is "
        "forgotten an hour after the command ends.",
        _start_parameters(),
    ),
    "local_pc_command_read": (
        "Read a started command: {command_id, status: running|finished|failed|cancelled|lost, stdout, stderr, "
        "next_offset: {stdout, stderr}, stdout_bytes, stderr_bytes, output_truncated} and, once it ended, "
        "exit_code, timed_out, duration_seconds (error when failed or lost). Pass next_offset back as offset "
        "to read only the new output.",
        {
            "type": "object",
            "properties": {"command_id": _COMMAND_ID, "offset": _OFFSET, "session_id": _SESSION},
            "required": ["command_id"],
            "additionalProperties": False,
        },
    ),
    "local_pc_command_wait": (
        "Wait until a started command ends or timeout_seconds pass (default "
        f"{command_runs.WAIT_DEFAULT_SECONDS:g}, at most {command_runs.WAIT_MAX_SECONDS:g}), then answer as "
        "local_pc_command_read (status still running when the wait ran out: wait again).",
        {
            "type": "object",
            "properties": {
                "command_id": _COMMAND_ID,
                "timeout_seconds": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": command_runs.WAIT_MAX_SECONDS,
                    "description": "Seconds to wait at most.",
                },
                "offset": _OFFSET,
                "session_id": _SESSION,
            },
            "required": ["command_id"],
            "additionalProperties": False,
        },
    ),
    "local_pc_command_cancel": (
        "Stop a started command (its process group is killed on the machine) and answer its state as "
        "local_pc_command_read, with cancel_sent (whether a stop was sent: it was running, or lost while "
        "still in flight).",
        {
            "type": "object",
            "properties": {"command_id": _COMMAND_ID, "session_id": _SESSION},
            "required": ["command_id"],
            "additionalProperties": False,
        },
    ),
}
COMMAND_HANDLE_TOOL_NAMES = frozenset(COMMAND_HANDLE_TOOLS)
"""The tools of a command behind a handle (docs/live-operations.md#long-commands-handles):
they run commands, so a token needs the shell scope for them."""

MACHINE_TOOL_NAMES = frozenset(
    ["list_machines", *OPERATION_TOOLS, "local_pc_file_copy", "local_pc_pipe", *COMMAND_HANDLE_TOOL_NAMES]
)
"""The names ``machine_tools`` gives (a call of one needs no other tool: they shadow the rest)."""


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
            handler=lambda arguments: database_sync_to_async(selectors.list_machines)(
                user=user, session_id=session_of(arguments)
            ),
        )
    ]
    for name, (op, summary, parameters) in OPERATION_TOOLS.items():
        tools.append(
            Tool(
                name=name,
                description=summary + FAN_OUT_NOTE + note,
                parameters=parameters,
                handler=_operation(user, op, session_of, caller),
            )
        )

    async def copy(arguments: dict[str, Any]) -> Any:
        progress = _progress_throttle()
        try:
            return await copy_between_machines(
                user=user,
                session_id=session_of(arguments),
                source_machine=arguments["source_machine"],
                source_path=arguments["source_path"],
                destination_machine=arguments["destination_machine"],
                destination_path=arguments["destination_path"],
                overwrite=bool(arguments.get("overwrite", False)),
                caller=caller,
                on_progress=None if progress is None else progress.bytes_moved,
            )
        finally:
            if progress is not None:
                await progress.finish()

    async def pipe(arguments: dict[str, Any]) -> Any:
        body = parse_plain(SessionPipeBody, {k: v for k, v in arguments.items() if k != "session_id"})
        progress = _progress_throttle()
        try:
            return await live.pipe(
                user=user,
                session_id=session_of(arguments),
                source=body.source,
                destination=body.destination,
                timeout_seconds=body.timeout_seconds,
                caller=caller,
                on_progress=None if progress is None else progress.bytes_moved,
            )
        finally:
            if progress is not None:
                await progress.finish()

    tools.append(
        Tool(
            name="local_pc_file_copy",
            description="Copy a file from one machine to another through the platform, verified by SHA-256. "
            "Progress notifications (when your client asks for them) carry the bytes copied of the total." + note,
            parameters=COPY_PARAMETERS,
            handler=copy,
        )
    )
    tools.append(Tool(name="local_pc_pipe", description=PIPE_SUMMARY + note, parameters=PIPE_PARAMETERS, handler=pipe))
    handlers = _command_handle_handlers(user, session_of, caller)
    for name, (summary, parameters) in COMMAND_HANDLE_TOOLS.items():
        description = summary + note if name == "local_pc_command_start" else summary
        tools.append(Tool(name=name, description=description, parameters=parameters, handler=handlers[name]))
    return tools


def _command_handle_handlers(
    user: User, session_of: Callable[[dict[str, Any]], str], caller: str
) -> dict[str, ToolHandler]:
    """The handlers of ``COMMAND_HANDLE_TOOLS``, each acting in the call's session (the
    session guard may refuse it: an agent acts only in its own); read, wait and cancel
    find the run among ``user``'s runs of that session, else ``NOT_FOUND``."""

    async def start(arguments: dict[str, Any]) -> Any:
        if arguments.get("target_machines") is not None:
            raise InvalidRequest(
                "local_pc_command_start runs one command on one machine: give target_machine, not target_machines "
                "(local_pc_execute_command runs on several)"
            )
        payload = {k: v for k, v in arguments.items() if k not in ("target_machine", "target_machines", "session_id")}
        return await command_runs.command_start(
            user=user,
            session_id=session_of(arguments),
            payload=payload,
            target_machine=arguments.get("target_machine"),
            caller=caller,
        )

    async def read(arguments: dict[str, Any]) -> Any:
        return await command_runs.command_read(
            user=user,
            session_id=session_of(arguments),
            command_id=arguments.get("command_id"),
            offset=arguments.get("offset"),
        )

    async def wait(arguments: dict[str, Any]) -> Any:
        return await command_runs.command_wait(
            user=user,
            session_id=session_of(arguments),
            command_id=arguments.get("command_id"),
            timeout_seconds=arguments.get("timeout_seconds"),
            offset=arguments.get("offset"),
        )

    async def cancel(arguments: dict[str, Any]) -> Any:
        return await command_runs.command_cancel(
            user=user, session_id=session_of(arguments), command_id=arguments.get("command_id")
        )

    return {
        "local_pc_command_start": start,
        "local_pc_command_read": read,
        "local_pc_command_wait": wait,
        "local_pc_command_cancel": cancel,
    }


class ProgressThrottle:
    """Progress reports of one tool call, at most ``PROGRESS_PER_SECOND`` a second.

    ``update(progress, total, message)`` records the state and sends it at once when the
    last report is old enough, else once the interval has passed (a timer task), so the
    latest state always goes out; ``finish()`` sends the final state (always one report
    per call, even without any update). ``progress`` only grows between reports (MCP
    "Progress": it MUST increase); a state whose ``progress`` did not grow is not sent.
    """

    def __init__(self, report: ProgressReport) -> None:
        self.report = report
        self.progress = 0.0
        self.total: float | None = None
        self.message: str | None = None
        self._sent: float | None = None  # the progress of the last report
        self._sent_at = -1e9
        self._timer: asyncio.Task[None] | None = None

    async def update(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        """Record the state (bytes so far, total, message) and report it when the interval allows."""
        self.progress, self.total = max(self.progress, progress), total
        if message is not None:
            self.message = message
        wait = self._sent_at + 1 / PROGRESS_PER_SECOND - asyncio.get_running_loop().time()
        if wait <= 0:
            await self._send()
        elif self._timer is None:
            self._timer = asyncio.create_task(self._later(wait))

    async def bytes_moved(self, bytes_done: int, bytes_total: int | None = None) -> None:
        """``on_progress`` of a copy or a pipe: bytes moved, of ``bytes_total`` when known."""
        await self.update(float(bytes_done), None if bytes_total is None else float(bytes_total))

    async def _later(self, wait: float) -> None:
        await asyncio.sleep(wait)
        self._timer = None
        await self._send()

    async def _send(self) -> None:
        if self._sent is not None and self.progress <= self._sent:
            return
        self._sent, self._sent_at = self.progress, asyncio.get_running_loop().time()
        await self.report(self.progress, self.total, self.message)

    async def finish(self) -> None:
        """Send the final state (the first report when none went out yet)."""
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)
            self._timer = None
        await self._send()


class OutputProgress(ProgressThrottle):
    """``local_pc_execute_command``'s progress: ``on_output`` (``machine_op``'s callback)
    counts the raw bytes of output so far and keeps the latest complete non-blank output
    line (stdout or stderr, cut to ``PROGRESS_LINE_MAX`` characters; in a fan-out
    prefixed with the machine's name) as the report's message; ``finish`` counts an
    unfinished last line as complete."""

    def __init__(self, report: ProgressReport, *, fan_out: bool = False) -> None:
        super().__init__(report)
        self.fan_out = fan_out
        self.bytes = 0
        self._partial: dict[tuple[str, str], str] = {}  # (machine name, stream) -> unfinished line

    async def on_output(self, output: Output) -> None:
        """Count one output frame and report."""
        text = output.data
        if output.encoding == "base64":
            try:
                raw = base64.b64decode(output.data)
            except (binascii.Error, ValueError):
                raw = b""
            self.bytes += len(raw)
            text = raw.decode("utf-8", "replace")
        else:
            self.bytes += len(output.data.encode("utf-8", "surrogatepass"))
        key = (output.name, output.stream)
        *lines, rest = (self._partial.get(key, "") + text).split("\n")
        self._partial[key] = rest[-PARTIAL_LINE_MAX:]
        line = next((line for line in reversed(lines) if line.strip()), None)
        await self.update(float(self.bytes), None, None if line is None else self._message(output.name, line))

    def _message(self, name: str, line: str) -> str:
        line = line.strip()
        return (f"{name}: {line}" if self.fan_out else line)[:PROGRESS_LINE_MAX]

    async def finish(self) -> None:
        for (name, _stream), rest in self._partial.items():
            if rest.strip():
                self.message = self._message(name, rest)
        self._partial.clear()
        await super().finish()


def _output_handler(
    progress: OutputProgress | None, output: OutputReport | None
) -> Callable[[Output], Awaitable[None]]:
    """``machine_op``'s ``on_output`` for a tool call: each frame goes to the progress
    report (when a client listens) and, as ``(stream, text)``, to the edge's ``output``
    sink (the built-in agent's output tail; base64 frames are decoded, invalid UTF-8
    replaced)."""

    async def on_output(event: Output) -> None:
        if progress is not None:
            await progress.on_output(event)
        if output is not None:
            text = event.data
            if event.encoding == "base64":
                try:
                    text = base64.b64decode(event.data).decode("utf-8", "replace")
                except (binascii.Error, ValueError):
                    return
            await output(event.stream, text)

    return on_output


def _progress_throttle() -> ProgressThrottle | None:
    """A ``ProgressThrottle`` for the running tool call, or ``None`` when nobody listens."""
    call = TOOL_CALL.get()
    return None if call is None or call.progress is None else ProgressThrottle(call.progress)


def _operation(user: User, op: str, session_of: Callable[[dict[str, Any]], str], caller: str) -> ToolHandler:
    async def run(arguments: dict[str, Any]) -> Any:
        payload = {k: v for k, v in arguments.items() if k not in ("target_machine", "target_machines", "session_id")}
        target_machines = arguments.get("target_machines")
        if target_machines is not None and arguments.get("target_machine") is not None:
            raise InvalidRequest("target_machine and target_machines are exclusive: give one of them")
        call = TOOL_CALL.get()
        progress = None
        if op == "EXECUTE_COMMAND" and call is not None and call.progress is not None:
            progress = OutputProgress(call.progress, fan_out=target_machines is not None)
        extra: dict[str, Any] = {}
        if target_machines is not None:
            extra["target_machines"] = target_machines
        output = call.output if op == "EXECUTE_COMMAND" and call is not None else None
        if progress is not None or output is not None:
            extra["on_output"] = _output_handler(progress, output)
        try:
            response = await machine_op(
                user=user,
                session_id=session_of(arguments),
                op=op,
                payload=payload,
                target_machine=arguments.get("target_machine"),
                caller=caller,
                **extra,
            )
        finally:
            if progress is not None:
                await progress.finish()
        if target_machines is not None:
            return response  # {"results": [...]}, one per machine
        return {**response["payload"], "machine_id": response["machine_id"]}

    return run
