"""CLI agent types: ``DISPATCH_AGENT_TYPES`` (docs/agents.md#agent-types).

``DISPATCH_AGENT_TYPES`` is a JSON object ``{"<type>": {"argv": [...],
"full_access_argv": [...], "kind": "llm" | "shell", "env": {...}}}``. ``argv`` is
required; ``full_access_argv`` (used instead of ``argv`` when the agent is launched with
``full_access``) defaults to ``argv``; ``env`` (extra environment variables, a Dispatch
extension for CLIs configured only through the environment, like opencode) defaults to
none. The placeholders ``{mcp_url}`` and ``{agent_id}`` may appear in argv and env
values; nothing else is substituted (JSON braces are left alone). Secrets never go in
argv: the agent's token is only in its environment (``DISPATCH_MCP_TOKEN``).

Two more keys say how Dispatch talks to the CLI (docs/agents.md):

- ``stop``: the keys a stop sends, in order, before the kill after the grace period —
  each a tmux key name (``"C-c"``, ``"Enter"``) or ``{"text": "/exit"}`` typed as is;
  default ``["C-c"]``;
- ``neutralise_prefix``: what goes before a message to an ``llm`` agent whose first
  non-blank character is ``!`` or ``/``, so it reaches the CLI as text and not as a shell
  or CLI command; default one space. ``shell`` agents get their messages unchanged (the
  text is the command);
- ``hooks``: ``"claude"``, ``"codex"`` or ``null`` — which CLI family the type runs, so
  Dispatch prepares it before launch (its config files, a trusted folder) and wires its
  hooks, through which it reports its state (docs/agents.md#what-dispatch-writes);
  default ``"claude"`` for a type named ``claude``, ``"codex"`` for ``codex``, else none;
- ``approval_timeout`` (seconds, a whole number from 1 to 86400) and ``approval_default``
  (``"deny"`` or ``"allow_once"``): how long the CLI's permission request waits for an
  answer and what it gets when nobody answers (docs/agents.md#approvals); default
  ``DISPATCH_APPROVAL_TIMEOUT`` / ``DISPATCH_APPROVAL_DEFAULT``.

This module imports nothing from Django so that settings can validate the variable at
start (a bad value is ``ValueError`` → ``ImproperlyConfigured``).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

EXPERT = "expert"
KINDS = ("llm", "shell")
_TYPE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,15}$")  # as agents.tmux.KEY_NAME
# Characters that turn the start of a message into a command in the CLIs' input box:
# ``!`` a shell command (Claude Code, codex), ``/`` a CLI command (``/exit``).
COMMAND_STARTS = ("!", "/")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_STOP_STEPS = 10
MAX_STOP_TEXT = 100

# One step of a stop sequence: ``("key", "<tmux key name>")`` or ``("text", "<typed text>")``.
StopStep = tuple[str, str]
DEFAULT_STOP: tuple[StopStep, ...] = (("key", "C-c"),)
DEFAULT_NEUTRALISE_PREFIX = " "
# The CLI families whose hooks Dispatch wires and whose config it prepares (agents.cli_prepare).
HOOK_FAMILIES = ("claude", "codex")
# What an unanswered permission request may default to (docs/agents.md#approvals).
APPROVAL_DEFAULTS = ("deny", "allow_once")
MAX_APPROVAL_TIMEOUT = 86400


@dataclass(frozen=True)
class AgentType:
    """One CLI agent type: its argv (without a shell), its kind, extra environment, the
    steps a stop sends (``stop``) and the prefix that keeps a message from being a command
    (``neutralise_prefix``; docs/agents.md) and the CLI family that reports through hooks
    (``hooks``: ``"claude"``, ``"codex"`` or ``None``)."""

    name: str
    argv: tuple[str, ...]
    full_access_argv: tuple[str, ...]
    kind: str
    env: Mapping[str, str] = field(default_factory=dict)
    stop: tuple[StopStep, ...] = DEFAULT_STOP
    neutralise_prefix: str = DEFAULT_NEUTRALISE_PREFIX
    hooks: str | None = None
    approval_timeout: int | None = None  # seconds; None: DISPATCH_APPROVAL_TIMEOUT
    approval_default: str | None = None  # "deny" | "allow_once"; None: DISPATCH_APPROVAL_DEFAULT

    def neutralise(self, text: str) -> str:
        """``text`` as it is pasted into this type's CLI (docs/agents.md#messages-are-text).

        ``text`` is the message as it will be pasted, control characters already removed
        (``agents.tmux.pasteable``): an ESC before the ``/`` would otherwise hide it here
        and vanish at the paste. For an ``llm`` type, a message whose first non-blank character is ``!`` or ``/``
        gets ``neutralise_prefix`` in front (only the start of the message counts: a CLI
        reads a command only there); anything else, and every message to a ``shell``
        type (the text is the command), is returned unchanged.
        """
        if self.kind != "llm" or not text.lstrip().startswith(COMMAND_STARTS):
            return text
        return self.neutralise_prefix + text

    @property
    def program(self) -> str:
        """The program the type runs (``argv[0]``)."""
        return self.argv[0]

    def missing_programs(self) -> list[str]:
        """The type's programs (normal and full-access) not found on ``PATH`` (nor executable
        paths), in argv order; empty when the type can run."""
        programs = dict.fromkeys([self.argv[0], self.full_access_argv[0]])
        return [program for program in programs if shutil.which(program) is None]

    def available(self) -> bool:
        """Whether both programs (normal and full-access) are found on ``PATH`` (or are executable paths)."""
        return not self.missing_programs()

    def command(self, *, full_access: bool, mcp_url: str, agent_id: str) -> list[str]:
        """The argv to run, placeholders filled in (one list element per argument)."""
        chosen = self.full_access_argv if full_access else self.argv
        return [_fill(part, mcp_url=mcp_url, agent_id=agent_id) for part in chosen]

    def environment(self, *, mcp_url: str, agent_id: str) -> dict[str, str]:
        """The type's extra environment variables, placeholders filled in."""
        return {key: _fill(value, mcp_url=mcp_url, agent_id=agent_id) for key, value in self.env.items()}


def _fill(text: str, *, mcp_url: str, agent_id: str) -> str:
    return text.replace("{mcp_url}", mcp_url).replace("{agent_id}", agent_id)


_CLAUDE_MCP = json.dumps(
    {
        "mcpServers": {
            "dispatch": {
                "type": "http",
                "url": "{mcp_url}",
                # Claude Code expands ${VAR} in MCP configs: the token stays in the environment.
                "headers": {"Authorization": "Bearer ${DISPATCH_MCP_TOKEN}"},
            }
        }
    }
)
_OPENCODE_CONFIG = json.dumps(
    {
        "$schema": "https://opencode.ai/config.json",
        "mcp": {
            "dispatch": {
                "type": "remote",
                "url": "{mcp_url}",
                "headers": {"Authorization": "Bearer {env:DISPATCH_MCP_TOKEN}"},
            }
        },
    }
)

DEFAULT_AGENT_TYPES: dict[str, dict[str, Any]] = {
    "claude": {
        # Manual mode said outright: Claude Code 2.1 otherwise starts in its "auto mode",
        # where a classifier lets commands run that a person was meant to approve.
        "argv": ["claude", "--mcp-config", _CLAUDE_MCP, "--permission-mode", "default"],
        "full_access_argv": ["claude", "--mcp-config", _CLAUDE_MCP, "--dangerously-skip-permissions"],
        "kind": "llm",
        # Claude Code ignores one C-c (it asks for a second to exit).
        "stop": ["C-c", "C-c"],
        # Claude Code 2.1 trims leading whitespace before it reads a command (' /exit' still
        # exits, ' /clear' clears): a visible quote mark keeps a message text.
        "neutralise_prefix": "> ",
    },
    "codex": {
        "argv": [
            "codex",
            "-c",
            'mcp_servers.dispatch.url="{mcp_url}"',
            "-c",
            'mcp_servers.dispatch.bearer_token_env_var="DISPATCH_MCP_TOKEN"',
        ],
        "full_access_argv": [
            "codex",
            "-c",
            'mcp_servers.dispatch.url="{mcp_url}"',
            "-c",
            'mcp_servers.dispatch.bearer_token_env_var="DISPATCH_MCP_TOKEN"',
            "--dangerously-bypass-approvals-and-sandbox",
        ],
        "kind": "llm",
    },
    "opencode": {
        "argv": ["opencode"],
        "full_access_argv": ["opencode"],
        "kind": "llm",
        "env": {"OPENCODE_CONFIG_CONTENT": _OPENCODE_CONFIG},
    },
    # C-c ends a running command and clears the line, then the shell is asked to exit.
    "shell": {"argv": ["bash", "--norc", "-i"], "kind": "shell", "stop": ["C-c", {"text": "exit"}, "Enter"]},
}


def parse_agent_types(raw: str | Mapping[str, Any] | None) -> dict[str, AgentType]:
    """``DISPATCH_AGENT_TYPES`` (JSON text or an already-parsed mapping) as ``AgentType``s.

    Empty or ``None`` gives the defaults (``claude``, ``codex``, ``opencode``, ``shell``).
    A given value replaces the defaults entirely. Raises ``ValueError`` saying what is
    wrong: not a JSON object, a type named ``expert`` or not matching
    ``[a-z][a-z0-9_-]{0,39}``, an empty ``argv`` or one with a non-string or NUL-holding
    element, an unknown ``kind``, an ``env`` that is not an object of string values, a
    ``stop`` that is not a list of 1-10 key names or ``{"text": ...}`` steps (1-100
    characters, no control characters), a ``neutralise_prefix`` that is not 1-20
    characters without control characters or that itself starts a command, a ``hooks``
    that is not ``"claude"``, ``"codex"`` or null, an ``approval_timeout`` that is not a
    whole number of seconds from 1 to 86400, an ``approval_default`` that is not
    ``"deny"`` or ``"allow_once"``.
    """
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        spec: Any = DEFAULT_AGENT_TYPES
    elif isinstance(raw, str):
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"DISPATCH_AGENT_TYPES is not valid JSON: {exc}") from None
    else:
        spec = raw
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError("DISPATCH_AGENT_TYPES must be a non-empty JSON object of types")
    types: dict[str, AgentType] = {}
    for name, entry in spec.items():
        where = f"DISPATCH_AGENT_TYPES[{name!r}]"
        if not isinstance(name, str) or not _TYPE_NAME.match(name) or name == EXPERT:
            raise ValueError(
                f"{where}: a type name is 1-40 of a-z, 0-9, '_' or '-', starting with a letter, not 'expert'"
            )
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be an object with argv and kind")
        unknown = sorted(
            set(entry)
            - {
                "argv",
                "full_access_argv",
                "kind",
                "env",
                "stop",
                "neutralise_prefix",
                "hooks",
                "approval_timeout",
                "approval_default",
            }
        )
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}")
        argv = _argv(entry.get("argv"), f"{where}.argv")
        full = _argv(entry["full_access_argv"], f"{where}.full_access_argv") if "full_access_argv" in entry else argv
        kind = entry.get("kind", "llm")
        if kind not in KINDS:
            raise ValueError(f"{where}.kind must be 'llm' or 'shell', not {kind!r}")
        env = entry.get("env", {})
        if not isinstance(env, Mapping) or not all(
            isinstance(key, str) and _ENV_NAME.match(key) and isinstance(value, str) and "\x00" not in value
            for key, value in env.items()
        ):
            raise ValueError(f"{where}.env must be an object of environment variable names to strings")
        stop = _stop(entry["stop"], f"{where}.stop") if "stop" in entry else DEFAULT_STOP
        prefix = entry.get("neutralise_prefix", DEFAULT_NEUTRALISE_PREFIX)
        if (
            not isinstance(prefix, str)
            or not 1 <= len(prefix) <= 20
            or _CONTROL.search(prefix)
            or prefix.lstrip().startswith(COMMAND_STARTS)
        ):
            raise ValueError(
                f"{where}.neutralise_prefix must be 1-20 characters without control characters, "
                "not starting with '!' or '/'"
            )
        hooks = entry.get("hooks", name if name in HOOK_FAMILIES else None)
        if hooks is not None and hooks not in HOOK_FAMILIES:
            raise ValueError(f"{where}.hooks must be 'claude', 'codex' or null, not {hooks!r}")
        timeout = entry.get("approval_timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= MAX_APPROVAL_TIMEOUT
        ):
            raise ValueError(
                f"{where}.approval_timeout must be a whole number of seconds from 1 to {MAX_APPROVAL_TIMEOUT}"
            )
        default = entry.get("approval_default")
        if default is not None and default not in APPROVAL_DEFAULTS:
            raise ValueError(f"{where}.approval_default must be 'deny' or 'allow_once', not {default!r}")
        types[name] = AgentType(
            name=name,
            argv=argv,
            full_access_argv=full,
            kind=kind,
            env=dict(env),
            stop=stop,
            neutralise_prefix=prefix,
            hooks=hooks,
            approval_timeout=timeout,
            approval_default=default,
        )
    return types


def _stop(value: Any, where: str) -> tuple[StopStep, ...]:
    """A ``stop`` value as ``StopStep``s; ``ValueError`` saying what is wrong."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_STOP_STEPS:
        raise ValueError(f"{where} must be a list of 1-{MAX_STOP_STEPS} steps")
    steps: list[StopStep] = []
    for index, step in enumerate(value):
        if isinstance(step, str) and KEY_NAME.match(step):
            steps.append(("key", step))
            continue
        if isinstance(step, Mapping) and set(step) == {"text"}:
            text = step["text"]
            if isinstance(text, str) and 1 <= len(text) <= MAX_STOP_TEXT and not _CONTROL.search(text):
                steps.append(("text", text))
                continue
        raise ValueError(
            f'{where}[{index}] must be a tmux key name like "C-c" or "Enter", or '
            f'{{"text": "..."}} of 1-{MAX_STOP_TEXT} characters without control characters'
        )
    return tuple(steps)


def _argv(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of strings")
    if not all(isinstance(part, str) and "\x00" not in part for part in value) or not value[0]:
        raise ValueError(f"{where} must be a list of strings without NUL, the first one a program")
    return tuple(value)
