"""The CLIs' hooks: how Claude Code and codex report their state to Dispatch (docs/agents.md).

``hook_command(event)`` is the shell command each hook runs: Dispatch's own Python running
``agents/hook_client.py <event>``, which posts the event's stdin JSON to
``POST /api/v1/agents/{DISPATCH_AGENT_ID}/hooks`` with the agent's token.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

HOOK_CLIENT = Path(__file__).resolve().parent / "hook_client.py"


def hook_command(event: str) -> str:
    """The shell command a CLI runs for hook ``event`` (e.g. ``"SessionStart"``):
    ``shlex.join([sys.executable, "<abs path of agents/hook_client.py>", event])``, quoted
    for the POSIX shell both CLIs run hooks through."""
    return shlex.join([sys.executable, str(HOOK_CLIENT), event])
