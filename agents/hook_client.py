"""The hook command Claude Code and codex run for each hook event (docs/agents.md#hooks).

Usage: ``<python> hook_client.py <event>`` with the event's JSON on stdin, run by the CLI
through a shell with the CLI's environment. It posts
``{"event": <event>, "payload": <stdin as JSON, or null>}`` to
``{DISPATCH_URL}/api/v1/agents/{DISPATCH_AGENT_ID}/hooks`` with
``Authorization: Bearer {DISPATCH_MCP_TOKEN}`` and, when the answer's ``output`` is not
null, prints it as JSON on stdout for the CLI to read.

A ``PermissionRequest`` answered ``"approval": {"status": "pending", ...}`` waits for its
answer (docs/agents.md#approvals): the client reads
``GET .../hooks/approvals/{id}`` every ``poll_seconds`` until the ``output`` comes — a
person's, a supervising agent's, or the default Dispatch records when the approval
expires — and prints it. It gives up (printing nothing, so the CLI shows its own dialog)
``GRACE`` seconds after the approval's ``wait_seconds``, or at once when Dispatch refuses
the token (the agent was stopped) or no longer knows the approval; a Dispatch briefly
unreachable meanwhile is asked again.

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
import time
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
# Seconds the client keeps asking for an approval's answer past the approval's own wait
# (Dispatch records the expiry and its default then); the CLI's hook timeout is longer
# (agents.cli_prepare.APPROVAL_HOOK_MARGIN).
GRACE = 20.0
# Bounds of the pause between two reads of a pending approval, seconds.
POLL_MIN = 0.2
POLL_MAX = 5.0


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
    hooks_url = f"{base}/api/v1/agents/{urllib.parse.quote(agent_id, safe='')}/hooks"
    try:
        answer = _call(hooks_url, token, body)
    except urllib.error.HTTPError as error:
        detail = error.read(QUOTED).decode("utf-8", "replace")
        _complain(f"{event}: Dispatch answered {error.code}: {detail}")
        return None
    except (OSError, ValueError) as error:  # refused, timed out, unreadable answer
        _complain(f"{event}: could not report to {base}: {error}")
        return None
    output = answer.get("output") if isinstance(answer, dict) else None
    if isinstance(output, dict):
        return output
    approval = answer.get("approval") if isinstance(answer, dict) else None
    if isinstance(approval, dict) and approval.get("status") == "pending" and isinstance(approval.get("id"), str):
        return wait_for_answer(f"{hooks_url}/approvals/{urllib.parse.quote(approval['id'], safe='')}", token, approval)
    return None


def _call(url: str, token: str, body: bytes | None = None) -> Any:
    """POST ``body`` (or GET without one) to ``url`` with the token; the answer's JSON.
    Raises ``urllib.error.HTTPError`` for an error status, ``OSError``/``ValueError`` for
    the rest."""
    request = urllib.request.Request(  # noqa: S310 (the scheme is checked by report)
        url,
        data=body,
        method="POST" if body is not None else "GET",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:  # noqa: S310 (checked by report)
        return json.loads(response.read(MAX_STDIN).decode("utf-8"))


def wait_for_answer(
    url: str,
    token: str,
    approval: dict[str, Any],
    *,
    sleep: Any = time.sleep,
    clock: Any = time.monotonic,
) -> dict[str, Any] | None:
    """Read the pending ``approval`` at ``url`` every ``poll_seconds`` until its ``output``
    (a dict) comes, and return it; ``None`` — nothing printed, the CLI asks in its own
    dialog — when Dispatch refuses the token (401, 403) or no longer has the approval
    (404), when it is answered without an output, or ``GRACE`` seconds after its
    ``wait_seconds``. Network errors and other statuses are retried until then."""
    try:
        pause = min(max(float(approval.get("poll_seconds", 1.0)), POLL_MIN), POLL_MAX)
        wait = max(float(approval.get("wait_seconds", 0.0)), 0.0)
    except (TypeError, ValueError):
        pause, wait = 1.0, 0.0
    deadline = clock() + wait + GRACE
    said_unreachable = False
    while clock() < deadline:
        sleep(pause)
        try:
            answer = _call(url, token)
        except urllib.error.HTTPError as error:
            if error.code in (401, 403, 404):
                detail = error.read(QUOTED).decode("utf-8", "replace")
                _complain(f"PermissionRequest: Dispatch answered {error.code} while waiting: {detail}")
                return None
            continue
        except (OSError, ValueError) as error:
            if not said_unreachable:
                _complain(f"PermissionRequest: Dispatch unreachable while waiting for the approval: {error}")
                said_unreachable = True
            continue
        output = answer.get("output") if isinstance(answer, dict) else None
        if isinstance(output, dict):
            return output
        current = answer.get("approval") if isinstance(answer, dict) else None
        if not isinstance(current, dict) or current.get("status") != "pending":
            return None
    _complain("PermissionRequest: no answer from Dispatch in time; the CLI asks itself")
    return None


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
