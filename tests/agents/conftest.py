"""Shared pieces of the agents tests: agent factories, an API client, live-event capture,
CLI agents' tmux and messages, the world of the agent-token scope tables."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from channels.layers import get_channel_layer
from django.test import Client
from django.utils import timezone

from agents import messages, services
from agents.models import Agent, AgentMessage, Approval, ApprovalRule, Run
from agents.tmux import TmuxRunner
from agents.tokens import agent_token_mint
from core.models import ApiToken
from machines.models import Machine
from peers.models import Peer


@pytest.fixture
def workdir(tmp_path: Path) -> str:
    """An existing absolute directory for agents to work in."""
    return str(tmp_path)


@pytest.fixture
def make_agent(workdir: str) -> Callable[..., Agent]:
    """``make_agent(owner, type="expert", name="helper", **kw)`` through ``agent_create``."""

    def make(owner: Any, type: str = "expert", name: str = "helper", **kwargs: Any) -> Agent:
        kwargs.setdefault("cwd", workdir)
        return services.agent_create(owner=owner, type=type, name=name, **kwargs)

    return make


def force_status(agent: Agent, status: str) -> Agent:
    """Put ``agent`` in ``status`` behind the service's back (test setup only)."""
    Agent.objects.filter(pk=agent.pk).update(status=status)
    agent.refresh_from_db()
    return agent


class Api:
    """A Django test client speaking JSON with a bearer token."""

    def __init__(self, token: str) -> None:
        self.client = Client()
        self.headers = {"authorization": f"Bearer {token}"}

    def get(self, path: str, **params: Any) -> Any:
        return self.client.get(path, params, headers=self.headers)

    def post(self, path: str, body: Any = None) -> Any:
        return self.client.post(path, body or {}, content_type="application/json", headers=self.headers)

    def delete(self, path: str) -> Any:
        return self.client.delete(path, headers=self.headers)


@pytest.fixture
def api(owner_token: str) -> Api:
    return Api(owner_token)


@pytest.fixture
def outsider_api(outsider_token: str) -> Api:
    return Api(outsider_token)


def error_of(response: Any) -> dict[str, Any]:
    """The ``error`` object of a response in the one error shape (asserting the shape)."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    error: dict[str, Any] = body["error"]
    return error


class LiveEvents:
    """A channel subscribed to one user's live-events group, as the ws/SSE edges will be.

    Receives on one private event loop: the Redis layer's receive buffers belong to the
    loop that first waits on them.
    """

    def __init__(self, user_id: int) -> None:
        self.user_id = user_id
        self.loop = asyncio.new_event_loop()
        self.layer = get_channel_layer()
        self.channel = self.loop.run_until_complete(self.layer.new_channel())
        self.loop.run_until_complete(self.layer.group_add(services.user_events_group(user_id), self.channel))

    def drain(self) -> list[dict[str, Any]]:
        """Every message delivered so far (each arrives within 0.2 s of its send)."""

        async def take() -> list[dict[str, Any]]:
            received = []
            while True:
                try:
                    received.append(await asyncio.wait_for(self.layer.receive(self.channel), 0.2))
                except TimeoutError:
                    return received

        return self.loop.run_until_complete(take())

    def names(self) -> list[str]:
        return [message["event"] for message in self.drain()]

    def close(self) -> None:
        self.loop.run_until_complete(self.layer.group_discard(services.user_events_group(self.user_id), self.channel))
        self.loop.close()


@pytest.fixture
def live_events() -> Iterator[Callable[[Any], LiveEvents]]:
    """``live_events(user)``: start capturing ``user``'s live events."""
    opened: list[LiveEvents] = []

    def open_for(user: Any) -> LiveEvents:
        opened.append(LiveEvents(user.pk))
        return opened[-1]

    yield open_for
    for events in opened:
        events.close()


# --- CLI agents in tmux (test_cli_delivery.py, test_cli_supervisor.py) ----------------------


@pytest.fixture
def runner(private_tmux: TmuxRunner) -> TmuxRunner:
    """The private tmux server ``cli`` uses in this test (``tests/conftest.py``)."""
    return private_tmux


def status_of(agent: Agent) -> str:
    return Agent.objects.get(pk=agent.pk).status


def send(agent: Agent, content: str) -> AgentMessage:
    return messages.message_send(recipient=agent, content=content, sender_user=agent.owner)


# --- the agent-token scope tables (test_agent_token_scope_rest.py, _mcp.py) ------------------

ALLOWED = "allowed"  # the scope lets it through: the answer is the route's or tool's own (the row says which)
FORBIDDEN = "forbidden"  # 403 PERMISSION_DENIED: the agent token may not do this

# The pending approvals of ``sibling`` and ``me`` the world starts with (MCP rows name them
# without a query: their arguments are built in async code).
SIBLING_APPROVAL = "apr_00000000sib1"
MY_APPROVAL = "apr_0000000000me"


@dataclass
class World:
    owner: Any
    me: Agent
    child: Agent
    sibling: Agent
    theirs: Agent
    api: Api
    token: str
    machine: Machine
    user_token: ApiToken
    peer: Peer
    message: AgentMessage
    child_run: Run
    sibling_run: Run


@pytest.fixture
def world(owner: Any, outsider: Any, owner_token: str, make_agent: Any) -> World:
    me = make_agent(owner, name="me")
    force_status(me, Agent.Status.RUNNING)
    child = make_agent(owner, name="child", launched_by=me)
    sibling = make_agent(owner, name="sibling")
    theirs = make_agent(outsider, name="theirs")
    for agent in (child, sibling, theirs):
        force_status(agent, Agent.Status.RUNNING)
    machine = Machine.objects.create(user=owner, machine_id="laptop", hostname="laptop")
    peer = Peer.objects.create(owner=owner, label="cloud", instance_id="inst_cloud", url="http://127.0.0.1:9")
    message = AgentMessage.objects.create(recipient_agent=sibling, content="hello", sender_user=owner)
    token = agent_token_mint(agent=me)
    ApprovalRule.objects.create(owner=owner, tool="Read", action="allow")
    # Pending: see _approval_of in test_agent_token_scope_rest.py.
    for approval_id, agent in ((SIBLING_APPROVAL, sibling), (MY_APPROVAL, me)):
        Approval.objects.create(
            id=approval_id,
            agent=agent,
            tool_name="Bash",
            tool_input={"command": "ls"},
            tool_summary="ls",
            expires_at=timezone.now() + timedelta(minutes=5),
        )
    return World(
        owner=owner,
        me=me,
        child=child,
        sibling=sibling,
        theirs=theirs,
        api=Api(token),
        token=token,
        machine=machine,
        user_token=ApiToken.objects.get(user=owner),
        peer=peer,
        message=message,
        child_run=Run.objects.create(agent=child, input={"instruction": "x", "input": None}),
        sibling_run=Run.objects.create(agent=sibling, input={"instruction": "x", "input": None}),
    )
