"""Approvals attacked over real sockets (docs/agents.md#hooks, docs/agents.md#approvals): two
``manage.py serve`` processes on one PostgreSQL and Redis.

- a forged hook call — no token, another agent's, the owner's own user token, another
  user's — records nothing;
- answers racing from the two processes (a person on one, a supervising agent on the
  other): exactly one wins each approval, the other is told who; a replay is told too;
- a request whose input holds a 2^70 integer or NaN is refused (400, nothing recorded);
  the largest 64-bit ones and odd unicode go through the hook, the Redis channel layer
  (msgpack) and back out intact;
- "Always allow" with a suggestion longer than a rule's pattern (PostgreSQL's varchar
  refused it: a 500) answers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.infra import Instance, Server, instance

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(120),
]

_SETUP = """
import json
from django.contrib.auth.models import User
from agents.models import Agent
from agents.tokens import agent_token_mint
from core.services import api_token_create
admin = User.objects.get(username="admin")
bob = User.objects.create_user("bob", password="pw-secret-123")
def agent(owner, name):
    return Agent.objects.create(owner=owner, name=name, type="claude", status="running", cwd="/tmp")
worker, boss, bobs = agent(admin, "worker"), agent(admin, "boss"), agent(bob, "bobs")
print(json.dumps({
    "worker": worker.pk, "boss": boss.pk, "bobs": bobs.pk,
    "worker_token": agent_token_mint(agent=worker), "boss_token": agent_token_mint(agent=boss),
    "bobs_token": agent_token_mint(agent=bobs), "bob_token": api_token_create(user=bob, name="t").raw,
}))
"""


@dataclass
class World:
    inst: Instance
    a: Server
    b: Server
    ids: dict[str, str]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with instance(postgres=True, redis=True, database_prefix="dispatch_it_t2apr_") as inst:
        a, b = inst.serve(wait=False), inst.serve(wait=False)
        a.wait_healthy()
        b.wait_healthy()
        ids = json.loads(inst.manage("shell", "-c", _SETUP).stdout.strip().splitlines()[-1])
        ids["admin_token"] = inst.admin_token
        yield World(inst=inst, a=a, b=b, ids=ids)


def call(server: Server, method: str, path: str, token: str | None, body: Any = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"{server.url}{path}", headers=headers, json=body, timeout=15)


def hook_request(world: World, token: str | None, *, command: Any = "ls", suggestions: Any = None) -> httpx.Response:
    payload = {
        "hook_event_name": "PermissionRequest",
        "tool_name": "Bash",
        "tool_input": {"command": command},
        "permission_suggestions": suggestions or [],
    }
    body = {"event": "PermissionRequest", "payload": payload}
    return call(world.a, "POST", f"/api/v1/agents/{world.ids['worker']}/hooks", token, body)


def approvals_of(world: World) -> list[dict[str, Any]]:
    listed = call(world.b, "GET", "/api/v1/approvals?status=all&limit=500", world.ids["admin_token"])
    assert listed.status_code == 200, listed.text
    rows: list[dict[str, Any]] = listed.json()["approvals"]
    return rows


def test_a_forged_hook_call_records_nothing(world: World) -> None:
    before = len(approvals_of(world))
    ids = world.ids
    assert hook_request(world, None).status_code == 401
    assert hook_request(world, ids["boss_token"]).status_code == 403  # another agent of the same owner
    assert hook_request(world, ids["admin_token"]).status_code == 403  # the owner, as a person
    assert hook_request(world, ids["bobs_token"]).status_code == 404  # another user's agent
    assert hook_request(world, ids["bob_token"]).status_code == 404
    assert hook_request(world, "x" * 43).status_code == 401
    assert len(approvals_of(world)) == before
    # nor may another agent read what the worker's hook waits on
    pending = hook_request(world, ids["worker_token"]).json()["approval"]["id"]
    path = f"/api/v1/agents/{ids['worker']}/hooks/approvals/{pending}"
    assert call(world.b, "GET", path, ids["boss_token"]).status_code == 403
    assert call(world.b, "GET", path, ids["bob_token"]).status_code == 404
    assert call(world.b, "GET", path, ids["worker_token"]).json()["output"] is None


def test_answers_racing_from_two_processes_one_wins_each_and_a_replay_is_told(world: World) -> None:
    ids = world.ids
    pending = [hook_request(world, ids["worker_token"], command=f"make deploy-{n}").json() for n in range(8)]
    approval_ids = [answer["approval"]["id"] for answer in pending]
    outcomes: dict[str, list[tuple[str, int, Any]]] = {approval_id: [] for approval_id in approval_ids}

    def answer(server: Server, token: str, who: str, decision: str, approval_id: str, start: threading.Barrier) -> None:
        start.wait()
        response = call(server, "POST", f"/api/v1/approvals/{approval_id}/answer", token, {"decision": decision})
        outcomes[approval_id].append((who, response.status_code, response.json()))

    for approval_id in approval_ids:
        start = threading.Barrier(2)
        threads = [
            threading.Thread(
                target=answer, args=(world.a, ids["admin_token"], "admin", "allow_once", approval_id, start)
            ),
            threading.Thread(target=answer, args=(world.b, ids["boss_token"], "boss", "deny", approval_id, start)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)

    final = {row["id"]: row for row in approvals_of(world)}
    for approval_id, results in outcomes.items():
        statuses = sorted(status for _, status, _ in results)
        assert statuses == [200, 409], results
        winner = next(who for who, status, _ in results if status == 200)
        loser_body = next(body for _, status, body in results if status == 409)
        assert loser_body["error"]["code"] == "APPROVAL_ANSWERED"
        expected = ("allowed", "allow_once") if winner == "admin" else ("denied", "deny")
        assert (final[approval_id]["status"], final[approval_id]["decision"]) == expected
        # the hook reads the winner's answer
        output = call(
            world.a, "GET", f"/api/v1/agents/{ids['worker']}/hooks/approvals/{approval_id}", ids["worker_token"]
        ).json()["output"]
        assert output["hookSpecificOutput"]["decision"]["behavior"] == ("allow" if winner == "admin" else "deny")
        replay = call(
            world.b, "POST", f"/api/v1/approvals/{approval_id}/answer", ids["admin_token"], {"decision": "deny"}
        )
        assert replay.status_code == 409 and replay.json()["error"]["details"]["status"] == expected[0]


def test_a_2_pow_70_integer_or_nan_is_refused_and_the_largest_one_and_odd_unicode_go_through_intact(
    world: World,
) -> None:
    ids = world.ids
    hooks = f"{world.a.url}/api/v1/agents/{ids['worker']}/hooks"
    headers = {"Authorization": f"Bearer {ids['worker_token']}", "Content-Type": "application/json"}

    def body(tool_input: dict[str, Any]) -> dict[str, Any]:
        return {
            "event": "PermissionRequest",
            "payload": {"hook_event_name": "PermissionRequest", "tool_name": "Bash", "tool_input": tool_input},
        }

    before = len(approvals_of(world))
    # past 64 bits (the Redis layer's msgpack carries no more): 400 naming where, nothing recorded
    huge = httpx.post(hooks, json=body({"command": "x", "n": 2**70}), headers=headers, timeout=15)
    assert huge.status_code == 400 and "payload.tool_input.n" in huge.json()["error"]["message"]
    raw = json.dumps(body({"command": "x", "f": 1.5})).replace("1.5", "NaN")
    assert httpx.post(hooks, content=raw, headers=headers, timeout=15).status_code == 400
    assert len(approvals_of(world)) == before

    odd = {"command": "echo \u202eevil\u200b \U0001f600 \u0301", "n": 2**63 - 1, "neg": -(2**63), "f": -0.1}
    asked = httpx.post(hooks, json=body(odd), headers=headers, timeout=15)
    assert asked.status_code == 200, asked.text
    approval_id = asked.json()["approval"]["id"]
    shown = call(world.b, "GET", f"/api/v1/approvals/{approval_id}", ids["admin_token"])
    assert shown.status_code == 200 and shown.json()["tool_input"] == odd
    answered = call(
        world.b, "POST", f"/api/v1/approvals/{approval_id}/answer", ids["admin_token"], {"decision": "deny"}
    )
    assert answered.status_code == 200, answered.text


def test_always_allow_with_a_suggestion_longer_than_a_rule_answers_on_postgresql(world: World) -> None:
    ids = world.ids
    suggestion = [{"type": "addRules", "rules": [{"toolName": "Bash", "ruleContent": "x" * 3000 + ":*"}]}]
    approval_id = hook_request(world, ids["worker_token"], command="ls /srv", suggestions=suggestion).json()[
        "approval"
    ]["id"]
    answered = call(
        world.b, "POST", f"/api/v1/approvals/{approval_id}/answer", ids["admin_token"], {"decision": "allow_always"}
    )
    assert answered.status_code == 200, answered.text
    rules = call(world.a, "GET", f"/api/v1/approval-rules?agent_id={ids['worker']}", ids["admin_token"]).json()
    assert [rule["pattern"] for rule in rules["rules"]] == ["ls /srv"]
