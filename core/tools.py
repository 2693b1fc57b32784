"""One tool as a model or an MCP client sees it, and the rule that names remote tools.

A ``Tool`` is a name, a description, the JSON Schema of its arguments (``parameters``:
MCP's ``inputSchema``, Chat Completions' ``parameters``) and an async call. Tools are built
per caller and per request — the machine tools (``machines.tools``), the agent tools
(``agents.tools``; both in docs/mcp.md#tools) and one tool per remote function — and put
together by ``agents.tools.tool_set``; ``dispatch.mcp`` and the expert agent render them
in their own protocol.

``tool_name`` and ``remote_tool_names`` are the naming rule of docs/mcp.md#tools:
what model APIs accept as a tool name, ``[A-Za-z0-9_-]{1,64}``.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from core.errors import InvalidRequest

ToolHandler = Callable[[dict[str, Any]], Awaitable[Any]]

ProgressReport = Callable[[float, "float | None", "str | None"], Awaitable[None]]
"""``await report(progress, total, message)``: a long tool call's progress (MCP
``notifications/progress``: ``progress`` grows with every report, ``total`` when known,
``message`` for humans, e.g. the command's latest output line)."""

OutputReport = Callable[[str, str], Awaitable[None]]
"""``await sink(stream, text)``: a chunk of a running command's output as it streams
(``stream`` ``"stdout"`` or ``"stderr"``; ``text`` the chunk's UTF-8 text, in order, not
split on lines). Binary (base64) output is not passed."""


@dataclass(frozen=True)
class ToolCall:
    """What the edge running a tool call tells the tool about that call (``TOOL_CALL``).

    ``progress``: where to report progress, or ``None`` (nobody listens). ``call_key``:
    a string naming this call among its user's calls in flight, so that it can be cancelled
    from any process (``"mcp:<token hash>:<JSON-RPC id>"`` for an MCP ``tools/call``,
    ``"agent:<agent id>:<run id>"`` for the built-in agent), stored on the in-flight
    operation rows the call starts; ``None`` when no edge will ever cancel by key.
    ``output``: where the tool sends a streamed command's output chunks as they arrive
    (``machines.tools``: ``local_pc_execute_command`` runs streamed when ``progress`` or
    ``output`` is set), or ``None``. The built-in agent uses it for its output tail
    (the last 20 lines, which the one-line ``progress`` message cannot rebuild).
    """

    progress: ProgressReport | None = None
    call_key: str | None = None
    output: OutputReport | None = None


TOOL_CALL: ContextVar[ToolCall | None] = ContextVar("dispatch_tool_call", default=None)
"""The ``ToolCall`` of the tool call running in this context (set by the edge around
``await tool(arguments)``; ``None`` outside one)."""

TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_NAME_MAX = 64
HASH_DIGITS = 6
SCHEMA_MESSAGE_MAX = 500  # characters of jsonschema's message kept in a refusal

_OUTSIDE_ALPHABET = re.compile(r"[^A-Za-z0-9_-]")


def cap(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with a note saying so when cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[cut: {len(text)} characters, only the first {limit} shown]"


NATIVE = ":native"
"""``Tool.source`` of a tool of Dispatch's own: no remote can be named so (a remote's name
starts with a letter or digit), so a remote named ``native`` is still a remote."""


@dataclass(frozen=True)
class Tool:
    """A tool bound to its caller: ``await tool(arguments)`` returns a JSON value or raises
    ``DispatchError``.

    ``checked`` (the default): ``arguments`` are validated against ``parameters`` first
    (JSON Schema 2020-12), a failure raising ``InvalidRequest("invalid arguments for
    <name>: …")``; ``False`` when the handler checks them itself (a remote's function:
    ``remotes.services.remote_call``, with its own message). ``refusal_max``: an
    ``InvalidRequest`` message longer than this is cut (``cap``), since it goes back to a
    model. ``source`` is ``NATIVE`` or the name of the remote the tool calls.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    handler: ToolHandler
    source: str = NATIVE
    checked: bool = True
    refusal_max: int | None = None

    async def __call__(self, arguments: dict[str, Any]) -> Any:
        """Validate ``arguments`` (when ``checked``) and run the handler."""
        try:
            if self.checked:
                self._check(arguments)
            return await self.handler(arguments)
        except InvalidRequest as exc:
            if self.refusal_max is None or len(exc.message) <= self.refusal_max:
                raise
            raise InvalidRequest(cap(exc.message, self.refusal_max), exc.details) from None

    def _check(self, arguments: dict[str, Any]) -> None:
        error = best_match(Draft202012Validator(self.parameters).iter_errors(arguments))
        if error is None:
            return
        where = "/".join(str(p) for p in error.absolute_path)[:200]
        # jsonschema quotes the offending value whole: a 200,000-character argument must not
        # come back as a 200,000-character error.
        message = _alternatives_message(error) or error.message
        if len(message) > SCHEMA_MESSAGE_MAX:
            message = message[:SCHEMA_MESSAGE_MAX] + " …[cut]"
        raise InvalidRequest(f"invalid arguments for {self.name}: {message}" + (f" (at '{where}')" if where else ""))


def _alternatives_message(error: Any) -> str | None:
    """For a ``oneOf``/``anyOf`` of ``required`` alternatives (``{"oneOf": [{"required":
    ["argv"]}, {"required": ["command"]}]}``), say which members are wanted instead of
    jsonschema's "is not valid under any of the given schemas"."""
    if error.validator not in ("oneOf", "anyOf") or not isinstance(error.validator_value, list):
        return None
    names: list[str] = []
    for branch in error.validator_value:
        required = branch.get("required") if isinstance(branch, dict) else None
        if not (isinstance(branch, dict) and set(branch) == {"required"} and isinstance(required, list)):
            return None
        names.append(" and ".join(str(name) for name in required))
    if not names:
        return None
    given = error.instance if isinstance(error.instance, dict) else {}
    present = [name for branch in error.validator_value for name in branch["required"] if name in given]
    how = "exactly one" if error.validator == "oneOf" else "at least one"
    if present and error.validator == "oneOf":
        return f"needs {how} of {', '.join(names)}, not {' and '.join(present)}"
    return f"needs {how} of {', '.join(names)}"


# --- names (docs/mcp.md#tools) --------------------------------------------------------------------


def remote_full_name(remotename: str, function: str) -> str:
    """``remote__<remotename>__<function>`` before any sanitising (the hashed form)."""
    return f"remote__{remotename}__{function}"


def _hashed(name: str, full_name: str) -> str:
    """``name`` cut to fit and ended with ``_`` + 6 hex digits of SHA-256(``full_name``)."""
    digest = hashlib.sha256(full_name.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_DIGITS]
    return f"{name[: TOOL_NAME_MAX - HASH_DIGITS - 1]}_{digest}"


def tool_name(full_name: str) -> str:
    """The tool name for ``full_name``: characters outside ``[A-Za-z0-9_-]`` become
    ``_``; a name still over 64 characters is cut and ends with ``_`` + 6 hex digits of
    the SHA-256 of the full name. The result always matches ``TOOL_NAME_PATTERN``."""
    name = _OUTSIDE_ALPHABET.sub("_", full_name) or "_"
    return _hashed(name, full_name) if len(name) > TOOL_NAME_MAX else name


def remote_tool_names(functions: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The tool name of each ``(remotename, function)`` pair.

    Each gets ``tool_name(remote__<remotename>__<function>)``; pairs whose names collide
    (``a.b`` and ``a/b`` both give ``a_b``) all get the hash suffix instead, computed from
    their distinct full names, so every pair keeps a name of its own.
    """
    plain = {pair: tool_name(remote_full_name(*pair)) for pair in functions}
    taken = Counter(plain.values())
    names: dict[tuple[str, str], str] = {}
    for pair, name in plain.items():
        if taken[name] > 1:
            name = _hashed(_OUTSIDE_ALPHABET.sub("_", remote_full_name(*pair)), remote_full_name(*pair))
        names[pair] = name
    return names
