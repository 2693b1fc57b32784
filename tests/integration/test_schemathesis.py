"""Schemathesis against a real ``serve``: the OpenAPI schema (``/api/schema/``) says what
the server does.

Every operation gets a few generated requests (positive and negative data, stateless)
with a non-staff user's token, and schemathesis's conformance checks judge each answer:
no 5xx; a status the operation documents; the documented content type; a body valid by
the response schema of its status (the API's ``{"error": {code, message, details}}``, the
device endpoints' RFC 6749 ``{"error", "error_description"}``); and a request valid by
the schema is not refused 400, unless the refusal depends on what exists on the server
(``refused_for_what_exists``, each by its words). The instance's only CLI agent type
runs a program that does not exist, so a generated launch never starts anything. The run
is bounded: ``DISPATCH_SCHEMATHESIS_EXAMPLES`` (default 6) requests per operation.

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
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.infra import Server, instance

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MAX_EXAMPLES = int(
    os.environ.get("DISPATCH_SCHEMATHESIS_EXAMPLES", "6")
)  # per operation: the whole run stays well under a minute
NEVER_AVAILABLE = json.dumps({"never": {"argv": ["/nonexistent/dispatch-never-agent"], "kind": "shell"}})
SEED = """
from django.contrib.auth import get_user_model
from agents import services
fuzz = get_user_model().objects.get(username="fuzz")
agent = services.agent_create(owner=fuzz, type="never", name="seeded", cwd="/tmp")
services.agent_event_record(agent=agent, type="system", message="seeded")
"""
EXCLUDED = {("DELETE", "/api/v1/auth/tokens/{token_id}"), ("GET", "/api/v1/events")}


def refused_for_what_exists(method: str, path: str, body: Any) -> bool:
    """Whether a 400 to a request valid by the schema is one that depends on what exists on
    the server (or on whose token calls), not on the request's shape, so that no schema can
    rule it out (each such refusal named by its exact words; any other 400 to valid data
    still fails the run)."""
    if not isinstance(body, dict):
        return False
    error = body.get("error")
    if method == "POST" and path == "/api/v1/machines/device/token":
        # A generated device_code names no pending authorization: RFC 8628 §3.5's answer.
        return error == "invalid_grant"
    if not isinstance(error, dict):
        return False
    message = str(error.get("message", ""))
    if method == "POST" and path == "/api/v1/agents":
        # The agent types are the instance's (its only CLI type is never available, so it has
        # no default type); a child is an agent's to launch, with its own token (the run has
        # a user's).
        return message.startswith(
            (
                "type is required: there is no default agent type here",
                "unknown agent type '",
                "agent type '",
                "child: only an agent (calling with its own",
            )
        ) or message.endswith("; omit location to launch here")  # the user's linked instances
    if method == "PUT" and path == "/api/v1/notifications/settings":
        # Which Apprise URLs are supported is up to the plugins apprise has.
        return message.startswith("Apprise URL #") and "Unsupported URL" in message
    if method == "POST" and path == "/api/v1/notifications/push-subscriptions":
        # A base64url point of the right length is still rarely on the P-256 curve; a host
        # name may be this machine's (localhost) or a user may hold the most subscriptions.
        return message.startswith(
            (
                "keys.p256dh is not a P-256 public key",
                "endpoint must be a push service on the internet",
                "at most 20 push subscriptions per user",
            )
        )
    # A page cursor is the server's own `next`, opaque to the schema.
    return method == "GET" and message == "invalid cursor"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, str]]:
    with instance(DISPATCH_AGENT_TYPES=NEVER_AVAILABLE) as inst:
        server = inst.serve()
        inst.create_user("fuzz")
        # Something for the lists to answer with, so their nullable fields are checked too.
        inst.manage("shell", "-c", SEED)
        yield server, inst.token("fuzz")


def _operations(server: Server, token: str) -> list[Any]:
    document = httpx.get(
        f"{server.url}/api/schema/", params={"format": "json"}, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert document.status_code == 200, document.text[:500]
    schema = schemathesis.openapi.from_dict(document.json())
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # an operation schemathesis cannot read is a schema bug
        operation = result.ok()
        if (operation.method.upper(), operation.path) not in EXCLUDED:
            operations.append(operation)
    return operations


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None


def test_generated_requests_get_no_5xx_and_only_documented_statuses(served: tuple[Server, str]) -> None:
    server, token = served
    operations = _operations(server, token)
    assert len(operations) > 20
    failures: list[str] = []
    headers = {"Authorization": f"Bearer {token}"}
    checks = [
        schemathesis.checks.not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        positive_data_acceptance,
    ]
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
            chosen = checks
            if response.status_code == 400 and refused_for_what_exists(
                case.operation.method.upper(), case.operation.path, _json(response.content)
            ):
                chosen = [check for check in checks if check is not positive_data_acceptance]
            case.validate_response(response, checks=chosen, headers=headers)
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
