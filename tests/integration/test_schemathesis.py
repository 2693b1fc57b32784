"""Schemathesis against a real ``serve`` (issue 11 item 12; spec/overview.md "Error shapes").

Every operation of ``/api/schema/`` gets a few generated requests (positive and negative
data, stateless) with a non-staff user's token. No answer may be a 5xx, and every status
an operation answers must be one its schema documents. The instance's only CLI agent type
runs a program that does not exist, so a generated launch never starts anything.

Left out: ``DELETE /api/v1/auth/tokens/{token_id}`` (it would revoke the run's own token)
and ``GET /api/v1/events`` (a server-sent event stream that stays open: no response ends).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.infra import Server, instance

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MAX_EXAMPLES = int(
    os.environ.get("DISPATCH_SCHEMATHESIS_EXAMPLES", "6")
)  # per operation: the whole run stays well under a minute
NEVER_AVAILABLE = json.dumps({"never": {"argv": ["/nonexistent/dispatch-never-agent"], "kind": "shell"}})
EXCLUDED = {("DELETE", "/api/v1/auth/tokens/{token_id}"), ("GET", "/api/v1/events")}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, str]]:
    with instance(DISPATCH_AGENT_TYPES=NEVER_AVAILABLE) as inst:
        server = inst.serve()
        inst.create_user("fuzz")
        yield server, inst.token("fuzz")


def _operations(server: Server, token: str) -> list[Any]:
    document = httpx.get(
        f"{server.url}/api/schema/", params={"format": "json"}, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert document.status_code == 200, document.text[:500]
    schema = schemathesis.openapi.from_dict(document.json())
    operations = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) not in EXCLUDED:
            operations.append(operation)
    return operations


def test_generated_requests_get_no_5xx_and_only_documented_statuses(served: tuple[Server, str]) -> None:
    server, token = served
    operations = _operations(server, token)
    assert len(operations) > 20
    failures: list[str] = []
    headers = {"Authorization": f"Bearer {token}"}
    checks = [schemathesis.checks.not_a_server_error, status_code_conformance]
    seen: dict[int, int] = {}  # status -> answers

    for operation in operations:

        @given(case=strategies.one_of(*(operation.as_strategy(generation_mode=mode) for mode in GenerationMode)))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            response = case.call(base_url=server.url, headers=headers, timeout=15)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            case.validate_response(response, checks=checks, headers=headers)
            if response.status_code >= 400:  # every error under /api/ is JSON with an "error" member
                assert response.headers.get("content-type", [""])[0].startswith("application/json"), response.text
                assert "error" in json.loads(response.content), response.text

        try:
            run()
        except (Exception, BaseExceptionGroup) as exc:  # each failing operation, all reported together
            failures.append(f"{operation.method.upper()} {operation.path}: {str(exc)[:600]}")
    assert server.running, server.log()
    assert not failures, "\n\n".join(failures)
    # The run reached the routes: successes and refusals both.
    assert sum(count for status, count in seen.items() if status < 300) >= 10, seen
    assert sum(count for status, count in seen.items() if 400 <= status < 500) >= 10, seen
    print(f"schemathesis: {len(operations)} operations, statuses {dict(sorted(seen.items()))}")
