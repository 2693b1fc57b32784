"""The peer API with CLI agents in real tmux (docs/peers.md#the-peer-api): a peer launches a ``shell``
agent here, messages it through its supervisor, and stops it.

Every test runs a private tmux server killed afterwards (as tests/agents/test_cli_agents.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from agents import cli
from agents.models import Agent, AgentMessage
from agents.tmux import TmuxRunner
from tests.agents.test_cli_agents import supervise_until
from tests.peers.conftest import FakePeer
from tests.peers.signing import peer_post

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.django_db,
]


@pytest.fixture
def runner(private_tmux: TmuxRunner) -> TmuxRunner:
    """The private tmux server ``cli`` uses in this test (``tests/conftest.py``)."""
    return private_tmux


@pytest.fixture
def repo_root(tmp_path: Path, settings: Any) -> str:
    root = os.path.realpath(tmp_path / "repos")
    os.makedirs(root)
    settings.REPO_ROOTS = [root]
    return root


@pytest.fixture
def cloud(make_peer: Any, owner: Any) -> FakePeer:
    return make_peer(owner, label="Cloud")


def launch_shell(client: Client, fake: FakePeer, cwd: str, prompt: str) -> Agent:
    response = peer_post(
        client,
        fake,
        "/api/v1/peers/launch",
        {
            "name": "sh",
            "prompt": prompt,
            "type": "shell",
            "cwd": cwd,
            "launched_by": {"instance_id": fake.instance_id, "agent_id": "agt_planner1", "name": "planner"},
        },
    )
    assert response.status_code == 201, response.content
    assert response.json()["status"] == "running"
    return Agent.objects.get(pk=response.json()["agent_id"])


def test_a_peer_launches_a_shell_agent_running_its_prompt_without_a_preamble(client, cloud, owner, repo_root, runner):
    agent = launch_shell(client, cloud, repo_root, "echo peer-$((40+2))")

    assert agent.owner == owner and agent.type == "shell" and agent.cwd == repo_root
    assert agent.launched_by_peer == {"instance_id": cloud.instance_id, "agent_id": "agt_planner1", "name": "planner"}
    supervise_until(runner, lambda: "peer-42" in cli.pane_text(agent=agent, runner=runner), "the prompt's output")
    first = AgentMessage.objects.get(recipient_agent=agent)
    assert first.content == "echo peer-$((40+2))"  # a shell is no model: the preamble is not typed into it


def test_a_peers_message_is_pasted_into_a_shell_agent_by_the_supervisor(client, cloud, repo_root, runner):
    agent = launch_shell(client, cloud, repo_root, "")

    response = peer_post(
        client,
        cloud,
        "/api/v1/peers/messages",
        {
            "to_agent_id": agent.pk,
            "content": "echo from-peer-$((6*7))",
            "from": {"instance_id": cloud.instance_id, "agent_id": "agt_planner1", "name": "planner"},
        },
    )

    assert response.status_code == 200, response.content
    message = AgentMessage.objects.get(pk=response.json()["message_id"])
    assert message.status == "queued" and message.sender_peer == cloud.peer
    supervise_until(runner, lambda: "from-peer-42" in cli.pane_text(agent=agent, runner=runner), "the message")
    message.refresh_from_db()
    assert message.status == "delivered"


def test_a_peer_stops_the_shell_agent_it_launched(client, cloud, repo_root, runner):
    agent = launch_shell(client, cloud, repo_root, "")

    response = peer_post(client, cloud, f"/api/v1/peers/agents/{agent.pk}/stop", {})

    assert response.status_code == 200, response.content
    assert response.json()["status"] in {"stopping", "stopped"}
    supervise_until(runner, lambda: Agent.objects.get(pk=agent.pk).status == "stopped", "the agent to stop")


def test_a_peer_launched_shell_agent_has_the_launch_context_in_its_environment(client, cloud, repo_root, runner):
    agent = launch_shell(client, cloud, repo_root, 'echo "ctx=$DISPATCH_LAUNCH_CONTEXT"')

    supervise_until(
        runner,
        lambda: "ctx=[Dispatch] You were launched from" in cli.pane_text(agent=agent, runner=runner),
        "the launch context in the environment",
    )
    assert "Cloud:agt_planner1" in cli.pane_text(agent=agent, runner=runner)
