"""The remote call as an HTTP operation, shared by the Remotes page and the REST route."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.models import User

from core.errors import InvalidRequest
from remotes import services
from remotes.protocol import RemoteCallBody, parse_body


def parse_args_json(text: str) -> dict[str, Any]:
    """Parse a form's JSON arguments; ``InvalidRequest`` unless they are a JSON object."""
    try:
        args = json.loads(text or "{}")
    except ValueError as exc:
        raise InvalidRequest(f"args is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise InvalidRequest("args must be a JSON object")
    return args


async def call_from_body(*, user: User, body: Any) -> Any:
    """Validate ``{remotename, function, args, timeout?}`` and run ``remote_call``.

    Raises ``InvalidRequest`` for a bad body and ``RemoteError`` for a failed call.
    """
    parsed: RemoteCallBody = parse_body(RemoteCallBody, body)
    return await services.remote_call(
        user=user,
        remotename=parsed.remotename,
        function=parsed.function,
        args=parsed.args,
        timeout=None if parsed.timeout is None else float(parsed.timeout),
    )
