"""The hook command Claude Code and codex run for each hook event (docs/agents.md "Hooks").

Usage: ``<python> hook_client.py <event>`` with the event's JSON on stdin, run by the CLI
through a shell with the CLI's environment. It posts
``{"event": <event>, "payload": <stdin as JSON, or null>}`` to
``{DISPATCH_URL}/api/v1/agents/{DISPATCH_AGENT_ID}/hooks`` with
``Authorization: Bearer {DISPATCH_MCP_TOKEN}`` and, when the answer's ``output`` is not
null, prints it as JSON on stdout for the CLI to read.

Standard library only, no Django and nothing of Dispatch: it runs under the server's
Python but must not need its virtualenv. It always exits 0 — a Dispatch outage must never
break the CLI — and says what went wrong on stderr, in one line. Without the three
variables (a person's own CLI session sharing a global hooks file) it does nothing.
"""

from __future__ import annotations

import sys

# Run as a script, Python puts the script's folder — agents/, which holds a ``types.py`` —
# first on sys.path, and the standard library's own ``import types`` would find that one.
# It is there unless Python runs with -I or -P (docs: sys.path, "safe_path").
if __name__ == "__main__" and not (sys.flags.isolated or getattr(sys.flags, "safe_path", False)):
    del sys.path[0]

# The rest of the imports only after that repair.
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

# Largest stdin read, in bytes; a larger payload is sent as null (the endpoint takes up to this).
MAX_STDIN = 1024 * 1024
# Seconds to wait for Dispatch's answer.
TIMEOUT = 10.0
# Characters of an error answer quoted on stderr.
QUOTED = 200


def _complain(what: str) -> None:
    text = " ".join(what.split())
    sys.stderr.write(f"dispatch hook: {text}\n")


def _payload(raw: bytes) -> Any:
    """The stdin JSON object, or None when it is too large, not JSON or not an object."""
    if len(raw) > MAX_STDIN:
        _complain(f"the event's JSON is over {MAX_STDIN} bytes; reported without it")
        return None
    try:
        parsed = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (UnicodeDecodeError, ValueError):
        _complain("the event's stdin is not JSON; reported without it")
        return None
    return parsed if isinstance(parsed, dict) else None


def report(event: str, raw: bytes, environ: dict[str, str]) -> dict[str, Any] | None:
    """Post one hook event to Dispatch; the ``output`` object of its answer, or None.

    Returns None at once when ``DISPATCH_URL``, ``DISPATCH_AGENT_ID`` or
    ``DISPATCH_MCP_TOKEN`` is missing from ``environ``. Never raises for network or
    answer errors: each is one line on stderr.
    """
    base = environ.get("DISPATCH_URL", "").rstrip("/")
    agent_id = environ.get("DISPATCH_AGENT_ID", "")
    token = environ.get("DISPATCH_MCP_TOKEN", "")
    if not (base and agent_id and token):
        return None
    if urllib.parse.urlsplit(base).scheme not in ("http", "https"):
        _complain(f"{event}: DISPATCH_URL must be an http(s) URL, not {base[:QUOTED]!r}")
        return None
    body = json.dumps({"event": event, "payload": _payload(raw)}).encode("utf-8")
    url = f"{base}/api/v1/agents/{urllib.parse.quote(agent_id, safe='')}/hooks"
    request = urllib.request.Request(  # noqa: S310 (the scheme is checked above)
        url,
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:  # noqa: S310 (checked above)
            answer = json.loads(response.read(MAX_STDIN).decode("utf-8"))
    except urllib.error.HTTPError as error:
        detail = error.read(QUOTED).decode("utf-8", "replace")
        _complain(f"{event}: Dispatch answered {error.code}: {detail}")
        return None
    except (OSError, ValueError) as error:  # refused, timed out, unreadable answer
        _complain(f"{event}: could not report to {base}: {error}")
        return None
    output = answer.get("output") if isinstance(answer, dict) else None
    return output if isinstance(output, dict) else None


def main(argv: list[str]) -> int:
    """Run as the hook command; always 0."""
    try:
        if len(argv) != 2:
            _complain("usage: hook_client.py <event>")
            return 0
        raw = sys.stdin.buffer.read(MAX_STDIN + 1)
        output = report(argv[1], raw, dict(os.environ))
        if output is not None:
            sys.stdout.write(json.dumps(output))
            sys.stdout.flush()
    except Exception as error:  # whatever happens here must not fail the CLI's hook
        _complain(f"unexpected error: {error!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
