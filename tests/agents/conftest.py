"""Shared pieces of the agents tests: agent factories, an API client, live-event capture."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from channels.layers import get_channel_layer
from django.test import Client

from agents import services
from agents.models import Agent


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
