"""The scope of an agent token on the REST API (docs/agents.md#agent-tokens; the README's
table "What an agent token may do").

One table with a row for every route under ``/api/v1`` (and each of its methods): a row
says what the agent token gets and the test checks it, plus that a refused write changed
nothing. The agent ``me`` (alice's) calls; ``child`` is an agent ``me`` launched,
``sibling`` one it did not, and ``theirs`` carol's (the ``world`` fixture of
tests/agents/conftest.py). The table is checked against the routes that exist, so a new
route without a row fails here. The MCP tools' table is test_agent_token_scope_mcp.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient
from django.urls import URLPattern, URLResolver, get_resolver

from agents.approvals import approval_request
from agents.models import Agent, AgentEvent, Approval, ApprovalRule, Run
from core.models import ApiToken
from machines.models import DefaultMachine, Machine
from peers.models import Peer
from tests.agents.conftest import ALLOWED, FORBIDDEN, Api, World, error_of

pytestmark = pytest.mark.django_db(transaction=True)

PEER_ONLY = "peer only"  # a peer route: only a linked instance's signed request is accepted (401)
OPEN = "open"  # needs no credential (pairing claim, device login, token from a password)


@dataclass(frozen=True)
class Row:
    route: str  # the route as Django spells it under /api/v1/
    method: str
    path: Callable[[World], str]
    outcome: str
    status: int
    body: Any = None
    unchanged: Callable[[World], Any] | None = None  # a refused write: this reads the same before and after


def _run_status(run: Run) -> str:
    run.refresh_from_db()
    return run.status


def _agent_status(agent: Agent) -> str:
    agent.refresh_from_db()
    return agent.status


def _approval_of(agent: Agent) -> Approval:
    """The agent's pending approval (one is made at the first call; docs/agents.md#approvals)."""
    found = Approval.objects.filter(agent=agent, status="pending").first()
    return found or approval_request(agent=agent, tool_name="Bash", tool_input={"command": "ls"})


def _approval_status(agent: Agent) -> str:
    return _approval_of(agent).status


REST: list[Row] = [
    # --- credentials: never an agent's business -------------------------------------------------
    Row("auth/token", "POST", lambda w: "auth/token", OPEN, 400, {}),
    Row("auth/tokens", "GET", lambda w: "auth/tokens", FORBIDDEN, 403),
    Row(
        "auth/tokens/<int:token_id>",
        "DELETE",
        lambda w: f"auth/tokens/{w.user_token.pk}",
        FORBIDDEN,
        403,
        unchanged=lambda w: ApiToken.objects.get(pk=w.user_token.pk).revoked_at,
    ),
    # --- remotes: its owner's, to list and call --------------------------------------------------
    Row("remotes", "GET", lambda w: "remotes", ALLOWED, 200),
    Row(
        "remotes/<path:remotename>/call",
        "POST",
        lambda w: "remotes/weather/call",
        ALLOWED,
        404,  # REMOTE_NOT_CONNECTED: the scope let it reach the remote registry
        {"function": "get_forecast", "args": {}},
    ),
    # --- machines -------------------------------------------------------------------------------
    Row("machines/device/code", "POST", lambda w: "machines/device/code", OPEN, 400, {}),
    Row("machines/device/token", "POST", lambda w: "machines/device/token", OPEN, 400, {}),
    Row("machines", "GET", lambda w: "machines", ALLOWED, 200),
    Row(
        "machines/default",
        "PUT",
        lambda w: "machines/default",
        FORBIDDEN,
        403,
        {"machine_id": "laptop"},
        unchanged=lambda w: DefaultMachine.objects.filter(user=w.owner).count(),
    ),
    Row(
        "machines/<str:machine_id>",
        "DELETE",
        lambda w: "machines/laptop",
        FORBIDDEN,
        403,
        unchanged=lambda w: Machine.objects.get(pk=w.machine.pk).revoked_at,
    ),
    Row("sessions/<str:session_id>/machines", "GET", lambda w: f"sessions/{w.me.pk}/machines", ALLOWED, 200),
    Row("sessions/<str:session_id>/machines", "GET", lambda w: f"sessions/{w.sibling.pk}/machines", FORBIDDEN, 403),
    Row(
        "sessions/<str:session_id>/ops",
        "POST",
        lambda w: f"sessions/{w.me.pk}/ops",
        ALLOWED,
        404,  # MACHINE_NOT_ATTACHED: routed in its own session, where no shim is attached
        {"op": "FILE_STAT", "payload": {"path": "/tmp"}},
    ),
    Row(
        "sessions/<str:session_id>/ops",
        "POST",
        lambda w: "sessions/default/ops",
        FORBIDDEN,
        403,
        {"op": "FILE_STAT", "payload": {"path": "/tmp"}},
    ),
    Row("sessions/<str:session_id>/ops", "GET", lambda w: f"sessions/{w.me.pk}/ops", ALLOWED, 200),
    Row("sessions/<str:session_id>/ops", "GET", lambda w: f"sessions/{w.sibling.pk}/ops", FORBIDDEN, 403),
    Row(
        "sessions/<str:session_id>/ops/<str:request_id>/cancel",
        "POST",
        lambda w: f"sessions/{w.me.pk}/ops/3f2b9c1e-8d4a-4c3b-9f00-5e6d7c8b9a01/cancel",
        ALLOWED,
        404,  # OPERATION_NOT_FOUND: looked up in its own session
        {},
    ),
    Row(
        "sessions/<str:session_id>/ops/<str:request_id>/cancel",
        "POST",
        lambda w: f"sessions/{w.sibling.pk}/ops/3f2b9c1e-8d4a-4c3b-9f00-5e6d7c8b9a01/cancel",
        FORBIDDEN,
        403,
        {},
    ),
    Row(
        "sessions/<str:session_id>/pipe",
        "POST",
        lambda w: f"sessions/{w.me.pk}/pipe",
        ALLOWED,
        404,  # MACHINE_NOT_ATTACHED: routed in its own session
        {"source": {"machine": "a", "argv": ["true"]}, "destination": {"machine": "b", "argv": ["cat"]}},
    ),
    Row(
        "sessions/<str:session_id>/pipe",
        "POST",
        lambda w: f"sessions/{w.sibling.pk}/pipe",
        FORBIDDEN,
        403,
        {"source": {"machine": "a", "argv": ["true"]}, "destination": {"machine": "b", "argv": ["cat"]}},
    ),
    Row(
        "sessions/<str:session_id>/copy",
        "POST",
        lambda w: f"sessions/{w.me.pk}/copy",
        ALLOWED,
        404,
        {"source_machine": "a", "source_path": "/a", "destination_machine": "b", "destination_path": "/b"},
    ),
    Row(
        "sessions/<str:session_id>/copy",
        "POST",
        lambda w: f"sessions/{w.sibling.pk}/copy",
        FORBIDDEN,
        403,
        {"source_machine": "a", "source_path": "/a", "destination_machine": "b", "destination_path": "/b"},
    ),
    # --- agents: read all of its owner's; stop/start/archive itself and those it launched --------
    Row("agents", "GET", lambda w: "agents", ALLOWED, 200),
    Row("agents", "POST", lambda w: "agents", ALLOWED, 201, {"type": "expert", "name": "helper2"}),
    Row(  # no giving a new agent more than it has
        "agents",
        "POST",
        lambda w: "agents",
        FORBIDDEN,
        403,
        {"type": "expert", "name": "helper3", "full_access": True},
        unchanged=lambda w: Agent.objects.count(),
    ),
    Row("agent-types", "GET", lambda w: "agent-types", ALLOWED, 200),
    Row("messages/<str:message_id>", "GET", lambda w: f"messages/{w.message.pk}", ALLOWED, 200),
    Row("agents/<str:agent_id>", "GET", lambda w: f"agents/{w.sibling.pk}", ALLOWED, 200),
    Row("agents/<str:agent_id>", "GET", lambda w: f"agents/{w.theirs.pk}", ALLOWED, 404),  # not its owner's
    Row("agents/<str:agent_id>", "DELETE", lambda w: f"agents/{w.child.pk}", ALLOWED, 200),
    Row(
        "agents/<str:agent_id>",
        "DELETE",
        lambda w: f"agents/{w.sibling.pk}",
        FORBIDDEN,
        403,
        unchanged=lambda w: _agent_status(w.sibling),
    ),
    Row("agents/<str:agent_id>/stop", "POST", lambda w: f"agents/{w.child.pk}/stop", ALLOWED, 200),
    # A CLI's hooks report for the agent whose token it holds, and for no other agent.
    Row(
        "agents/<str:agent_id>/hooks",
        "POST",
        lambda w: f"agents/{w.me.pk}/hooks",
        ALLOWED,
        200,
        {"event": "Stop", "payload": {}},
    ),
    Row(
        "agents/<str:agent_id>/hooks",
        "POST",
        lambda w: f"agents/{w.child.pk}/hooks",
        FORBIDDEN,
        403,
        {"event": "Stop", "payload": {}},
        unchanged=lambda w: _agent_status(w.child),
    ),
    Row(
        "agents/<str:agent_id>/stop",
        "POST",
        lambda w: f"agents/{w.sibling.pk}/stop",
        FORBIDDEN,
        403,
        unchanged=lambda w: _agent_status(w.sibling),
    ),
    Row("agents/<str:agent_id>/start", "POST", lambda w: f"agents/{w.child.pk}/start", ALLOWED, 409),  # running
    Row(
        "agents/<str:agent_id>/start",
        "POST",
        lambda w: f"agents/{w.sibling.pk}/start",
        FORBIDDEN,
        403,
        unchanged=lambda w: _agent_status(w.sibling),
    ),
    Row(
        "agents/<str:agent_id>/prompt",
        "POST",
        lambda w: f"agents/{w.sibling.pk}/prompt",
        ALLOWED,
        202,
        {"instruction": "hi"},
    ),
    Row("agents/<str:agent_id>/events", "GET", lambda w: f"agents/{w.sibling.pk}/events", ALLOWED, 200),
    Row("agents/<str:agent_id>/messages", "GET", lambda w: f"agents/{w.sibling.pk}/messages", ALLOWED, 200),
    Row(
        "agents/<str:agent_id>/messages",
        "POST",
        lambda w: f"agents/{w.sibling.pk}/messages",
        ALLOWED,
        201,
        {"content": "hi"},
    ),
    Row("agents/<str:agent_id>/runs", "GET", lambda w: f"agents/{w.sibling.pk}/runs", ALLOWED, 200),
    Row("runs/<str:run_id>", "GET", lambda w: f"runs/{w.sibling_run.pk}", ALLOWED, 200),
    Row("runs/<str:run_id>/cancel", "POST", lambda w: f"runs/{w.child_run.pk}/cancel", ALLOWED, 200),
    Row(
        "runs/<str:run_id>/cancel",
        "POST",
        lambda w: f"runs/{w.sibling_run.pk}/cancel",
        FORBIDDEN,
        403,
        unchanged=lambda w: _run_status(w.sibling_run),
    ),
    Row("events", "GET", lambda w: "events", ALLOWED, 200),  # the SSE stream
    # --- approvals: a supervising agent answers other agents' requests, never its own; rules are a
    # person's (docs/agents.md#approvals) ----------------------------------------------------
    Row("approvals", "GET", lambda w: "approvals", ALLOWED, 200),
    Row("approvals/<str:approval_id>", "GET", lambda w: f"approvals/{_approval_of(w.sibling).pk}", ALLOWED, 200),
    Row(
        "approvals/<str:approval_id>/answer",
        "POST",
        lambda w: f"approvals/{_approval_of(w.sibling).pk}/answer",
        ALLOWED,
        200,
        {"decision": "allow_once"},
    ),
    Row(
        "approvals/<str:approval_id>/answer",
        "POST",
        lambda w: f"approvals/{_approval_of(w.me).pk}/answer",
        FORBIDDEN,
        403,
        {"decision": "allow_once"},
        unchanged=lambda w: _approval_status(w.me),
    ),
    Row("approval-rules", "GET", lambda w: "approval-rules", ALLOWED, 200),
    Row(
        "approval-rules",
        "POST",
        lambda w: "approval-rules",
        FORBIDDEN,
        403,
        {"tool": "Bash", "action": "allow"},
        unchanged=lambda w: ApprovalRule.objects.count(),
    ),
    Row(
        "approval-rules/<str:rule_id>",
        "DELETE",
        lambda w: f"approval-rules/{ApprovalRule.objects.get(owner=w.owner).pk}",
        FORBIDDEN,
        403,
        unchanged=lambda w: ApprovalRule.objects.count(),
    ),
    # A CLI's PermissionRequest hook waits on its own approval, not another agent's.
    Row(
        "agents/<str:agent_id>/hooks/approvals/<str:approval_id>",
        "GET",
        lambda w: f"agents/{w.me.pk}/hooks/approvals/{_approval_of(w.me).pk}",
        ALLOWED,
        200,
    ),
    Row(
        "agents/<str:agent_id>/hooks/approvals/<str:approval_id>",
        "GET",
        lambda w: f"agents/{w.child.pk}/hooks/approvals/{_approval_of(w.child).pk}",
        FORBIDDEN,
        403,
    ),
    # --- keys into a pane, notifications: a person's -------------------------------------------
    Row(
        "agents/<str:agent_id>/keys",
        "POST",
        lambda w: f"agents/{w.child.pk}/keys",
        FORBIDDEN,
        403,
        {"keys": ["Enter"]},
        unchanged=lambda w: AgentEvent.objects.filter(agent=w.child).count(),
    ),
    Row("notifications", "GET", lambda w: "notifications", ALLOWED, 200),
    Row("notifications/settings", "GET", lambda w: "notifications/settings", FORBIDDEN, 403),
    Row("notifications/settings", "PUT", lambda w: "notifications/settings", FORBIDDEN, 403, {"apprise_urls": []}),
    Row("notifications/push-subscriptions", "POST", lambda w: "notifications/push-subscriptions", FORBIDDEN, 403, {}),
    Row("notifications/viewing", "POST", lambda w: "notifications/viewing", FORBIDDEN, 403, {"client_id": "c"}),
    Row("notifications/test", "POST", lambda w: "notifications/test", FORBIDDEN, 403),
    # --- peers: no pairing, linking, relabelling or unlinking ------------------------------------
    Row("peers/claim", "POST", lambda w: "peers/claim", OPEN, 400, {}),
    Row("peers/offers", "POST", lambda w: "peers/offers", FORBIDDEN, 403, {}),
    Row(
        "peers/link",
        "POST",
        lambda w: "peers/link",
        FORBIDDEN,
        403,
        {"url": "http://127.0.0.1:9", "code": "ABCD-EFGH"},
        unchanged=lambda w: Peer.objects.count(),
    ),
    Row("peers", "GET", lambda w: "peers", FORBIDDEN, 403),
    Row(
        "peers/<int:peer_id>",
        "PATCH",
        lambda w: f"peers/{w.peer.pk}",
        FORBIDDEN,
        403,
        {"label": "renamed"},
        unchanged=lambda w: Peer.objects.get(pk=w.peer.pk).label,
    ),
    Row(
        "peers/<int:peer_id>",
        "DELETE",
        lambda w: f"peers/{w.peer.pk}",
        FORBIDDEN,
        403,
        unchanged=lambda w: Peer.objects.get(pk=w.peer.pk).revoked_at,
    ),
    # --- the peer API: signed requests of a linked instance only --------------------------------
    Row("peers/events", "GET", lambda w: "peers/events", PEER_ONLY, 401),
    Row("peers/launch", "POST", lambda w: "peers/launch", PEER_ONLY, 401, {}),
    Row("peers/messages", "POST", lambda w: "peers/messages", PEER_ONLY, 401, {}),
    Row("peers/messages/batch", "POST", lambda w: "peers/messages/batch", PEER_ONLY, 401, {"messages": []}),
    Row("peers/repos", "GET", lambda w: "peers/repos", PEER_ONLY, 401),
    Row("peers/agents/<str:agent_id>/stop", "POST", lambda w: f"peers/agents/{w.me.pk}/stop", PEER_ONLY, 401, {}),
    Row(
        "peers/agents/<str:agent_id>/archive",
        "POST",
        lambda w: f"peers/agents/{w.me.pk}/archive",
        PEER_ONLY,
        401,
        {},
    ),
    Row("peers/unlink", "POST", lambda w: "peers/unlink", PEER_ONLY, 401, {}),
    Row("peers/approvals", "GET", lambda w: "peers/approvals", PEER_ONLY, 401),
    Row(
        "peers/approvals/<str:approval_id>/answer",
        "POST",
        lambda w: f"peers/approvals/{_approval_of(w.sibling).pk}/answer",
        PEER_ONLY,
        401,
        {"decision": "allow_once"},
        unchanged=lambda w: _approval_status(w.sibling),
    ),
]


def api_v1_routes() -> set[str]:
    """Every route under ``/api/v1/``, as Django spells it (``agents/<str:agent_id>``)."""
    found: set[str] = set()

    def walk(patterns: list[Any], prefix: str) -> None:
        for entry in patterns:
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, prefix + str(entry.pattern))
            elif isinstance(entry, URLPattern):
                found.add(prefix + str(entry.pattern))

    walk(get_resolver().url_patterns, "")
    return {route.removeprefix("api/v1/") for route in found if route.startswith("api/v1/")}


def test_the_table_has_a_row_for_every_route_under_api_v1() -> None:
    assert api_v1_routes() == {row.route for row in REST}


def _request(world: World, row: Row) -> tuple[int, Any]:
    path = "/api/v1/" + row.path(world)
    headers = {"authorization": f"Bearer {world.token}"}
    if row.route == "events":  # a stream: read its status, then let it go
        response = async_to_sync(AsyncClient().get)(path, headers=headers)
        return response.status_code, None
    client = world.api.client
    data = json.dumps(row.body) if row.body is not None else None
    response = client.generic(row.method, path, data or "", content_type="application/json", headers=headers)
    body = response.json() if response.get("Content-Type", "").startswith("application/json") else None
    return response.status_code, body


@pytest.mark.parametrize("row", REST, ids=[f"{row.method} {row.route} {row.outcome} {i}" for i, row in enumerate(REST)])
def test_an_agent_token_gets_what_its_scope_says_on_every_route(world: World, row: Row, settings: Any) -> None:
    settings.DEFAULT_CWD = "/tmp"
    before = row.unchanged(world) if row.unchanged else None
    status, body = _request(world, row)
    assert status == row.status, (row, body)
    if row.outcome == FORBIDDEN:
        error = error_of_body(body)
        assert error["code"] == "PERMISSION_DENIED", body
        assert "agent" in error["message"], body
    elif row.outcome == ALLOWED and body is not None and status >= 400:
        assert error_of_body(body)["code"] not in ("PERMISSION_DENIED", "NOT_AUTHENTICATED", "AUTHENTICATION_FAILED")
    if row.unchanged is not None:
        assert row.unchanged(world) == before, "a refused request changed state"


def error_of_body(body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    return error


def test_a_launch_with_an_agent_token_records_the_launcher_and_that_agent_may_stop_it(world: World) -> None:
    launched = world.api.post("/api/v1/agents", {"type": "expert", "name": "worker", "cwd": "/tmp"})
    assert launched.status_code == 201, launched.content
    agent = Agent.objects.get(pk=launched.json()["id"])
    assert agent.launched_by_id == world.me.pk
    assert world.api.post(f"/api/v1/agents/{agent.pk}/stop").status_code == 200
    assert _agent_status(agent) == Agent.Status.STOPPED


def test_a_full_access_agent_may_launch_a_full_access_agent(world: World) -> None:
    Agent.objects.filter(pk=world.me.pk).update(full_access=True)
    launched = world.api.post("/api/v1/agents", {"type": "expert", "name": "w", "cwd": "/tmp", "full_access": True})
    assert launched.status_code == 201, launched.content
    assert launched.json()["full_access"] is True


def test_a_user_token_still_manages_every_agent_and_machine(world: World, owner_token: str) -> None:
    user = Api(owner_token)
    full = user.post("/api/v1/agents", {"type": "expert", "name": "w", "cwd": "/tmp", "full_access": True})
    assert full.status_code == 201, full.content
    assert user.post(f"/api/v1/agents/{world.sibling.pk}/stop").status_code == 200
    assert (
        user.client.put(
            "/api/v1/machines/default",
            {"machine_id": "laptop"},
            content_type="application/json",
            headers=user.headers,
        ).status_code
        == 200
    )
    assert user.get(f"/api/v1/sessions/{world.sibling.pk}/machines").status_code == 200
    assert user.delete("/api/v1/machines/laptop").status_code == 200


def test_a_refusal_names_the_rule(world: World) -> None:
    refused = world.api.post(f"/api/v1/agents/{world.sibling.pk}/stop")
    assert error_of(refused)["message"] == (
        f"agent '{world.me.pk}' may stop, start or archive only itself and the agents it launched, "
        f"not '{world.sibling.pk}'"
    )
    other = world.api.get("/api/v1/sessions/default/machines")
    assert error_of(other)["message"] == (
        f"an agent token acts only in its own session ('{world.me.pk}'), not in 'default'"
    )
