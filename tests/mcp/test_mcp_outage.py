"""``/mcp`` while the database cannot be reached (docs/operating.md#health): looking the
token up fails, and the answer is 503 ``TEMPORARILY_UNAVAILABLE`` naming the database, with
``Retry-After``, never a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import OperationalError

from dispatch.mcp import app as mcp_app
from tests.mcp.test_app import asgi_post


async def test_a_token_lookup_on_a_database_that_is_down_is_503_with_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def down(headers: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(mcp_app, "authenticate", down)
    answer = await asgi_post(
        mcp_app.mcp_app,
        "/mcp",
        [(b"authorization", b"Bearer whatever"), (b"content-type", b"application/json")],
    )
    assert answer["status"] == 503
    assert answer["headers"][b"retry-after"] == b"5"
    error = json.loads(answer["body"])["error"]
    assert error["code"] == "TEMPORARILY_UNAVAILABLE"
    assert error["details"] == {"service": "database"}
