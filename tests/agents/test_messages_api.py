"""Messages and prompts over REST and /ws (docs/agents.md#messages-and-their-status,
docs/agents.md#prompts-and-runs).

``POST /api/v1/agents/{id}/messages``, ``GET /api/v1/agents/{id}/messages``,
``GET /api/v1/messages/{id}``, ``POST /api/v1/agents/{id}/prompt`` on a CLI agent, the
``send-agent-prompt`` reply for a CLI agent, agent-token senders and launchers, and the
stop/start of expert agents. CLI agents here have no tmux session (their messages stay
``queued``) except in the last tests, which run a real ``shell`` agent on a private tmux
server and call the supervisor (``supervisor.supervise_once``) as the background service would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from agents import cli, supervisor
from agents.models import Agent, AgentMessage, Run
from agents.services import run_claim_next, run_enqueue
from agents.tmux import TmuxRunner
from agents.tokens import agent_token_mint
from core import wire
from tests.agents.conftest import Api, error_of, force_status

pytestmark = pytest.mark.django_db


@pytest.fixture
def shell(owner: Any, make_agent: Any) -> Agent:
    """A running ``shell`` agent of ``owner`` (no tmux session: messages stay queued)."""
    return force_status(make_agent(owner, type="shell", name="sh"), Agent.Status.RUNNING)


@pytest.fixture
def expert(owner: Any, make_agent: Any) -> Agent:
    return make_agent(owner, name="thinker")


# --- POST /agents/{id}/messages ------------------------------------------------------------


def test_a_message_to_a_cli_agent_is_201_queued_with_its_sender(api: Api, owner: Any, shell: Agent) -> None:
    response = api.post(f"/api/v1/agents/{shell.pk}/messages", {"content": "echo hi\nand more"})

    assert response.status_code == 201, response.content
    body = response.json()
    stored = AgentMessage.objects.get()
    assert body == {
        "id": stored.pk,
        "sender_agent_id": None,
        "sender_user": owner.username,
        "recipient_agent_id": shell.pk,
        "content": "echo hi\nand more",
        "status": "queued",
        "error": "",
        "created_at": body["created_at"],
        "pasted_at": None,
        "delivered_at": None,
    }
    assert not Run.objects.exists()


def test_a_message_to_an_expert_agent_queues_a_run_and_is_delivered(api: Api, expert: Agent) -> None:
    response = api.post(f"/api/v1/agents/{expert.pk}/messages", {"content": "summarise"})

    assert response.status_code == 201
    assert response.json()["status"] == "delivered" and response.json()["delivered_at"]
    assert Run.objects.get(agent=expert).input == {"instruction": "summarise", "input": None}


def test_a_message_to_a_stopped_agent_is_409(api: Api, shell: Agent) -> None:
    force_status(shell, Agent.Status.STOPPED)

    response = api.post(f"/api/v1/agents/{shell.pk}/messages", {"content": "hello"})

    assert response.status_code == 409
    assert error_of(response)["code"] == "CONFLICT"
    assert not AgentMessage.objects.exists()


def test_an_agent_token_sends_as_the_agent(owner: Any, make_agent: Any, shell: Agent) -> None:
    sender = force_status(make_agent(owner, type="shell", name="boss"), Agent.Status.RUNNING)
    as_agent = Api(agent_token_mint(agent=sender))

    sent = as_agent.post(f"/api/v1/agents/{shell.pk}/messages", {"content": "from boss"})
    prompted = as_agent.post(f"/api/v1/agents/{shell.pk}/prompt", {"instruction": "also from boss"})

    assert sent.status_code == 201 and prompted.status_code == 202
    assert sent.json()["sender_agent_id"] == sender.pk and sent.json()["sender_user"] is None
    rows = AgentMessage.objects.order_by("pk")
    assert [(m.sender_agent_id, m.sender_user_id, m.content) for m in rows] == [
        (sender.pk, None, "from boss"),
        (sender.pk, None, "also from boss"),
    ]


def test_an_agent_token_launch_records_the_launcher_and_child_makes_it_the_parent(
    owner: Any, make_agent: Any, workdir: str
) -> None:
    launcher = force_status(make_agent(owner, type="shell", name="boss"), Agent.Status.RUNNING)
    as_agent = Api(agent_token_mint(agent=launcher))

    child = as_agent.post("/api/v1/agents", {"type": "expert", "name": "kid", "cwd": workdir, "child": True})
    sibling = as_agent.post("/api/v1/agents", {"type": "expert", "name": "sib", "cwd": workdir})

    assert child.status_code == 201 and sibling.status_code == 201
    assert (child.json()["parent"], child.json()["launched_by"]) == (launcher.pk, launcher.pk)
    assert (sibling.json()["parent"], sibling.json()["launched_by"]) == (None, launcher.pk)
    assert child.json()["owner"] == owner.username


def test_a_user_cannot_launch_a_child_without_being_an_agent(api: Api, workdir: str) -> None:
    response = api.post("/api/v1/agents", {"type": "expert", "name": "kid", "cwd": workdir, "child": True})

    assert response.status_code == 400
    assert "child" in error_of(response)["message"]
    assert not Agent.objects.exists()


# --- GET /agents/{id}/messages, GET /messages/{id} ----------------------------------------


def test_messages_are_listed_newest_first_and_paged_with_a_cursor(api: Api, owner: Any, shell: Agent) -> None:
    from django.utils import timezone

    start = timezone.now() - timedelta(minutes=5)
    for n in range(7):
        AgentMessage.objects.create(
            recipient_agent=shell, sender_user=owner, content=f"m{n}", created_at=start + timedelta(seconds=n)
        )

    first = api.get(f"/api/v1/agents/{shell.pk}/messages", limit=3).json()
    second = api.get(f"/api/v1/agents/{shell.pk}/messages", limit=3, before=first["next"]).json()
    third = api.get(f"/api/v1/agents/{shell.pk}/messages", limit=3, before=second["next"]).json()

    assert [m["content"] for m in first["messages"]] == ["m6", "m5", "m4"]
    assert [m["content"] for m in second["messages"]] == ["m3", "m2", "m1"]
    assert [m["content"] for m in third["messages"]] == ["m0"] and third["next"] is None
    assert len(api.get(f"/api/v1/agents/{shell.pk}/messages").json()["messages"]) == 7


def test_the_list_also_shows_what_the_agent_sent(api: Api, owner: Any, make_agent: Any, shell: Agent) -> None:
    other = force_status(make_agent(owner, type="shell", name="other"), Agent.Status.RUNNING)
    AgentMessage.objects.create(recipient_agent=other, sender_agent=shell, content="outgoing")

    listed = api.get(f"/api/v1/agents/{shell.pk}/messages").json()["messages"]

    assert [(m["content"], m["recipient_agent_id"]) for m in listed] == [("outgoing", other.pk)]


def test_the_default_page_is_50_and_the_limit_at_most_200(api: Api, owner: Any, shell: Agent) -> None:
    AgentMessage.objects.bulk_create(
        AgentMessage(recipient_agent=shell, sender_user=owner, content=f"m{n}") for n in range(60)
    )

    page = api.get(f"/api/v1/agents/{shell.pk}/messages").json()

    assert len(page["messages"]) == 50 and page["next"]
    assert len(api.get(f"/api/v1/agents/{shell.pk}/messages", limit=200).json()["messages"]) == 60
    assert api.get(f"/api/v1/agents/{shell.pk}/messages", limit=201).status_code == 400


def test_one_message_is_shown_by_its_id(api: Api, owner: Any, shell: Agent) -> None:
    message_id = api.post(f"/api/v1/agents/{shell.pk}/messages", {"content": "hi"}).json()["id"]

    response = api.get(f"/api/v1/messages/{message_id}")

    assert response.status_code == 200
    assert response.json()["content"] == "hi" and response.json()["status"] == "queued"


# --- POST /agents/{id}/prompt on a CLI agent ------------------------------------------------


def test_prompting_a_cli_agent_is_202_with_a_message_id(api: Api, owner: Any, shell: Agent) -> None:
    response = api.post(f"/api/v1/agents/{shell.pk}/prompt", {"instruction": "make -C app"})

    assert response.status_code == 202
    message = AgentMessage.objects.get()
    assert response.json() == {"message_id": message.pk}
    assert (message.content, message.status, message.sender_user_id) == ("make -C app", "queued", owner.pk)
    assert not Run.objects.exists()


def test_prompting_an_expert_agent_is_still_202_with_a_run_id(api: Api, expert: Agent) -> None:
    response = api.post(f"/api/v1/agents/{expert.pk}/prompt", {"instruction": "hi"})

    assert response.status_code == 202
    assert response.json() == {"run_id": Run.objects.get().pk}
    assert not AgentMessage.objects.exists()


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"instruction": "x", "input": {"a": 1}}, 400),
        ({"instruction": "x", "options": {"instruction": "y"}}, 400),
        ({"instruction": "x", "options": {"remotes": "weather"}}, 400),
        ({"instruction": "   "}, 400),
        ({"instruction": "a\x00b"}, 400),
        ({}, 400),
    ],
)
def test_a_bad_prompt_to_a_cli_agent_is_refused(api: Api, shell: Agent, body: Any, status: int) -> None:
    response = api.post(f"/api/v1/agents/{shell.pk}/prompt", body)

    assert response.status_code == status, response.content
    assert error_of(response)["code"] in {"INVALID_REQUEST", "VALIDATION_ERROR"}
    assert not AgentMessage.objects.exists()


# --- expert stop / start -----------------------------------------------------------------


def test_stopping_an_expert_cancels_its_runs_and_start_makes_it_running_again(api: Api, expert: Agent) -> None:
    running = run_enqueue(agent=expert, instruction="a")
    queued = run_enqueue(agent=expert, instruction="b")
    run_claim_next(process_id="p")

    stopped = api.post(f"/api/v1/agents/{expert.pk}/stop")

    assert stopped.status_code == 200 and stopped.json()["status"] == "stopped"
    assert set(Run.objects.filter(pk__in=[running.pk, queued.pk]).values_list("status", flat=True)) == {"cancelled"}
    refused = api.post(f"/api/v1/agents/{expert.pk}/prompt", {"instruction": "x"})
    assert refused.status_code == 409 and error_of(refused)["message"] == f"agent '{expert.pk}' is not running"
    assert api.post(f"/api/v1/agents/{expert.pk}/stop").status_code == 409

    started = api.post(f"/api/v1/agents/{expert.pk}/start")

    assert started.status_code == 200 and started.json()["status"] == "running"
    assert api.post(f"/api/v1/agents/{expert.pk}/start").status_code == 409
    assert api.post(f"/api/v1/agents/{expert.pk}/prompt", {"instruction": "x"}).status_code == 202


# --- /ws send-agent-prompt on a CLI agent -----------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_send_agent_prompt_to_a_cli_agent_replies_with_the_message_id(
    owner: Any, owner_token: str, make_agent: Any, ws_connect: Any
) -> None:
    from channels.db import database_sync_to_async

    shell = await database_sync_to_async(lambda: force_status(make_agent(owner, type="shell"), "running"))()
    async with ws_connect(token=owner_token) as ws:
        body = {"agentId": shell.pk, "instruction": "ls -la", "options": {"remotes": ["weather"]}}
        await ws.send({"action": "send-agent-prompt", "nonce": "p1", "body": body})
        reply = await ws.reply("p1")

    message = await database_sync_to_async(AgentMessage.objects.get)()
    assert reply == {"message": "prompt accepted", "agentId": shell.pk, "messageId": message.pk, "nonce": "p1"}
    assert (message.content, message.status, message.sender_user_id) == ("ls -la", "queued", owner.pk)


@pytest.mark.django_db(transaction=True)
async def test_send_agent_prompt_to_a_stopped_cli_agent_is_an_error_reply(
    owner: Any, owner_token: str, make_agent: Any, ws_connect: Any
) -> None:
    from channels.db import database_sync_to_async

    shell = await database_sync_to_async(lambda: force_status(make_agent(owner, type="shell"), "stopped"))()
    async with ws_connect(token=owner_token) as ws:
        reply = await ws.request("send-agent-prompt", {"agentId": shell.pk, "instruction": "ls"})

    assert reply == {"error": f"agent '{shell.pk}' is not running (status stopped)", "nonce": "n1"}


OPTIONS_OK: list[Any] = [None, {}, {"remotes": ["weather"]}, {"remotes": [{"name": "w", "prefix": "w_"}]}, {"k": 1}]
OPTIONS_BAD: list[Any] = [
    "text",
    [],
    {"instruction": "x"},
    {"input": 1},
    {"remotes": "weather"},
    {"remotes": [{"name": "w", "prefix": "bad prefix!"}]},
    {"tools": "all"},
]
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20))


@pytest.mark.django_db(transaction=True)
@hypothesis_settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    # Weighted towards frames that should be accepted, so both outcomes are well exercised.
    target=st.sampled_from(["mine", "mine", "mine", "theirs", "unknown", "junk"]),
    instruction=st.one_of(
        st.text(min_size=1, max_size=200).filter(lambda text: text.strip() != ""),
        st.text(max_size=200),
        st.sampled_from(["", "  ", "\x00", "ok"]),
        json_leaf,
    ),
    options=st.one_of(st.sampled_from(OPTIONS_OK), st.sampled_from(OPTIONS_BAD)),
    input=st.one_of(st.none(), st.none(), json_leaf),
)
def test_any_send_agent_prompt_frame_for_a_cli_agent_gets_one_honest_reply(
    owner: Any,
    member: Any,
    owner_token: str,
    ws_connect: Any,
    workdir: str,
    target: str,
    instruction: Any,
    options: Any,
    input: Any,
) -> None:
    from agents.services import agent_create

    mine = Agent.objects.filter(owner=owner, type="shell").first() or force_status(
        agent_create(owner=owner, type="shell", name="mine", cwd=workdir), "running"
    )
    theirs = Agent.objects.filter(owner=member, type="shell").first() or force_status(
        agent_create(owner=member, type="shell", name="theirs", cwd=workdir), "running"
    )
    agent_id = {"mine": mine.pk, "theirs": theirs.pk, "unknown": "agt_ffffffffffff", "junk": "x\x00y"}[target]
    body: dict[str, Any] = {"agentId": agent_id, "instruction": instruction, "input": input}
    if options is not None:
        body["options"] = options
    before = AgentMessage.objects.count()

    async def exchange() -> tuple[dict[str, Any], dict[str, Any]]:
        async with ws_connect(token=owner_token) as ws:
            await ws.send({"action": "send-agent-prompt", "nonce": "h", "body": body})
            reply = await ws.reply("h")
            pong = await ws.request("ping")  # the session survives whatever it was sent
            return reply, pong

    reply, pong = asyncio.run(exchange())

    assert "error" not in pong
    should_accept = (
        target == "mine"
        and isinstance(instruction, str)
        and instruction.strip() != ""
        and "\x00" not in instruction
        and options in OPTIONS_OK
        and input is None
    )
    event("accepted" if should_accept else "refused")
    if should_accept:
        message = AgentMessage.objects.order_by("-pk").first()
        assert message is not None and AgentMessage.objects.count() == before + 1
        assert reply == {"message": "prompt accepted", "agentId": mine.pk, "messageId": message.pk, "nonce": "h"}
        assert (message.recipient_agent_id, message.content) == (mine.pk, instruction)
    else:
        assert set(reply) == {"error", "nonce"} and isinstance(reply["error"], str) and reply["error"], reply
        assert AgentMessage.objects.count() == before
    if wire.problem(body) is not None:
        # A value the channel layer cannot carry (an integer outside 64 bits) is refused at
        # the JSON edge, naming it, before anything else is looked at.
        assert reply["error"] == f"invalid JSON: {wire.problem({'body': body})}"
    elif target == "theirs":
        assert reply["error"] == f"no agent '{theirs.pk}'"


# --- end to end with a real shell agent ------------------------------------------------------


@pytest.fixture
def runner(private_tmux: TmuxRunner) -> TmuxRunner:
    """The private tmux server ``cli`` uses in this test (``tests/conftest.py``)."""
    return private_tmux


def supervise_until(runner: TmuxRunner, condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        supervisor.supervise_once(runner=runner)
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_message_to_a_real_shell_agent_is_pasted_by_the_supervisor_and_shows_delivered(
    api: Api, runner: TmuxRunner, workdir: str
) -> None:
    launched = api.post(
        "/api/v1/agents", {"type": "shell", "name": "sh", "cwd": workdir, "prompt": "echo first-$((1+1))"}
    )
    assert launched.status_code == 201, launched.content
    agent_id = launched.json()["id"]
    name = f"dispatch_{agent_id}"
    supervise_until(runner, lambda: "first-2" in runner.capture(name), "the prompt's output")

    sent = api.post(f"/api/v1/agents/{agent_id}/messages", {"content": "echo second-$((6*7)) \\\n  && echo whole"})
    assert sent.status_code == 201 and sent.json()["status"] == "queued"
    message_id = sent.json()["id"]

    def delivered() -> bool:
        return bool(api.get(f"/api/v1/messages/{message_id}").json()["status"] == "delivered")

    supervise_until(runner, delivered, "the message to be delivered")
    supervise_until(runner, lambda: "whole" in runner.capture(name), "the message's output")
    screen = runner.capture(name)
    assert "second-42" in screen and "whole" in screen
    shown = api.get(f"/api/v1/messages/{message_id}").json()
    assert shown["delivered_at"] is not None and shown["error"] == ""
    listed = api.get(f"/api/v1/agents/{agent_id}/messages").json()["messages"]
    assert [(m["content"], m["status"]) for m in listed] == [
        ("echo second-$((6*7)) \\\n  && echo whole", "delivered"),
        ("echo first-$((1+1))", "delivered"),
    ]

    stopping = api.post(f"/api/v1/agents/{agent_id}/stop")
    assert stopping.status_code == 200 and stopping.json()["status"] == "stopping"
    supervise_until(
        runner, lambda: api.get(f"/api/v1/agents/{agent_id}").json()["status"] == "stopped", "the agent to stop"
    )
    refused = api.post(f"/api/v1/agents/{agent_id}/messages", {"content": "too late"})
    assert refused.status_code == 409
    started = api.post(f"/api/v1/agents/{agent_id}/start")
    assert started.status_code == 200 and started.json()["status"] == "running"
    archived = api.delete(f"/api/v1/agents/{agent_id}")
    assert archived.status_code == 200 and archived.json()["status"] == "archived"
    assert name not in runner.owned_sessions(cli.instance_identity_get().instance_id)
