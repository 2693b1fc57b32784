"""Start an agent's program with its secrets from a file, never from a command line.

``python -I agents/agent_exec.py ENV_FILE -- PROGRAM [ARG ...]`` is what a CLI agent's
tmux pane runs (``agents.tmux.TmuxRunner.start``). It reads ``ENV_FILE`` (JSON object
of variable names to string values, written mode 0600), deletes it, and ``execvpe``s the
program with:

- the pane's environment (the tmux server's, i.e. the user's shell environment, so the
  CLIs keep their own API keys and settings) **minus Dispatch's own configuration** —
  ``SECRET_KEY``, ``SECRET_KEY_FILE``, ``DATABASE_URL``, ``REDIS_URL``, ``ALLOWED_HOSTS``,
  ``DEBUG``, ``make``'s ``MAKEFLAGS``/``MAKELEVEL``/…, and every ``DISPATCH_*`` and
  ``DJANGO_*`` variable — which a tmux server
  started by Dispatch inherits from it (docs/agents.md#agent-types: the agent's environment
  carries its own ``DISPATCH_*`` variables, secrets never appear in argv);
- plus the file's variables: the launching Dispatch process's own environment (less the
  same configuration), so a tmux server started earlier with another environment does not
  decide what the agent sees, then ``DISPATCH_AGENT_ID``, ``DISPATCH_MCP_TOKEN``, ….

Standard library only (it runs with ``-I``: no site-packages, no project path). If the
program cannot be started it prints why and exits 127, so the pane's last lines and exit
status say so.
"""

from __future__ import annotations

import signal

# A stop's Ctrl-C that lands while this wrapper starts was meant for the program: ignore it
# here with a handler (not SIG_IGN, which the program would inherit; exec resets handlers).
# Only when run as the pane's program: agents.tmux imports ``agent_environment``.
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda signum, frame: None)

import json  # after the handler, to shorten the window
import os
import sys

# Dispatch's own configuration, never handed to an agent.
DENIED_NAMES = frozenset(
    {
        "SECRET_KEY",
        "SECRET_KEY_FILE",
        "DATABASE_URL",
        "REDIS_URL",
        "ALLOWED_HOSTS",
        "DEBUG",
        # ``make run``'s own variables: a ``make`` the agent runs would inherit its overrides.
        "MAKEFLAGS",
        "MFLAGS",
        "MAKELEVEL",
        "MAKEOVERRIDES",
    }
)
DENIED_PREFIXES = ("DISPATCH_", "DJANGO_")


def agent_environment(inherited: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """``inherited`` without Dispatch's configuration, then ``extra`` on top."""
    kept = {
        name: value
        for name, value in inherited.items()
        if name not in DENIED_NAMES and not name.startswith(DENIED_PREFIXES)
    }
    return {**kept, **extra}


def main(argv: list[str]) -> int:
    """Entry point; returns an exit status only when the program could not be started."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: agent_exec.py ENV_FILE -- PROGRAM [ARG ...]", file=sys.stderr)
        return 2
    env_file, program = argv[1], argv[3:]
    try:
        with open(env_file, encoding="utf-8") as handle:
            extra = json.load(handle)
    except (OSError, ValueError) as error:
        print(f"dispatch: cannot read the agent's environment file: {error}", file=sys.stderr)
        return 127
    finally:
        try:
            os.unlink(env_file)
        except OSError:
            pass
    if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        print("dispatch: the agent's environment file is not an object of strings", file=sys.stderr)
        return 127
    try:
        os.execvpe(program[0], program, agent_environment(dict(os.environ), extra))  # noqa: S606 - argv, no shell, by design
    except OSError as error:
        print(f"dispatch: cannot start {program[0]!r}: {error}", file=sys.stderr)
        return 127
    return 0  # not reached: execvpe replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv))
