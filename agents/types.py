"""CLI agent types: ``DISPATCH_AGENT_TYPES`` (spec/agents.md §2).

``DISPATCH_AGENT_TYPES`` is a JSON object ``{"<type>": {"argv": [...],
"full_access_argv": [...], "kind": "llm" | "shell", "env": {...}}}``. ``argv`` is
required; ``full_access_argv`` (used instead of ``argv`` when the agent is launched with
``full_access``) defaults to ``argv``; ``env`` (extra environment variables, a Dispatch
extension for CLIs configured only through the environment, like opencode) defaults to
none. The placeholders ``{mcp_url}`` and ``{agent_id}`` may appear in argv and env
values; nothing else is substituted (JSON braces are left alone). Secrets never go in
argv: the agent's token is only in its environment (``DISPATCH_MCP_TOKEN``).

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


@dataclass(frozen=True)
class AgentType:
    """One CLI agent type: its argv (without a shell), its kind and extra environment."""

    name: str
    argv: tuple[str, ...]
    full_access_argv: tuple[str, ...]
    kind: str
    env: Mapping[str, str] = field(default_factory=dict)

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
        "argv": ["claude", "--mcp-config", _CLAUDE_MCP],
        "full_access_argv": ["claude", "--mcp-config", _CLAUDE_MCP, "--dangerously-skip-permissions"],
        "kind": "llm",
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
    "shell": {"argv": ["bash", "--norc", "-i"], "kind": "shell"},
}


def parse_agent_types(raw: str | Mapping[str, Any] | None) -> dict[str, AgentType]:
    """``DISPATCH_AGENT_TYPES`` (JSON text or an already-parsed mapping) as ``AgentType``s.

    Empty or ``None`` gives the defaults (``claude``, ``codex``, ``opencode``, ``shell``).
    A given value replaces the defaults entirely. Raises ``ValueError`` saying what is
    wrong: not a JSON object, a type named ``expert`` or not matching
    ``[a-z][a-z0-9_-]{0,39}``, an empty ``argv`` or one with a non-string or NUL-holding
    element, an unknown ``kind``, an ``env`` that is not an object of string values.
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
        unknown = sorted(set(entry) - {"argv", "full_access_argv", "kind", "env"})
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
        types[name] = AgentType(name=name, argv=argv, full_access_argv=full, kind=kind, env=dict(env))
    return types


def _argv(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of strings")
    if not all(isinstance(part, str) and "\x00" not in part for part in value) or not value[0]:
        raise ValueError(f"{where} must be a list of strings without NUL, the first one a program")
    return tuple(value)
