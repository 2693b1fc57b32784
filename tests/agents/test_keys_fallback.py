"""The keys fallback (agents/keys.py, docs/agents.md#keys), against a real tmux pane.

A shell agent runs ``cat -vT`` in a private tmux server (``private_tmux``): a key pressed
from the page or the API shows in the pane as ``cat -vT`` prints it (Down is ``^[[B``).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.test import Client

from agents import cli
from agents.models import Agent, AgentEvent
from agents.tmux import TmuxRunner
from tests.agents.conftest import Api, error_of, force_status

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.django_db,
]


def wait_for(condition: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def cat_agent(owner, private_tmux: TmuxRunner, workdir: str) -> Agent:
    """A running shell agent whose pane runs ``cat -vT`` (it echoes every key it reads)."""
    agent = cli.agent_launch(owner=owner, type="shell", name="sh", prompt="", cwd=workdir, runner=private_tmux)
    assert agent.status == "running"
    name = cli.session_name(agent)
    wait_for(lambda: private_tmux.capture(name).strip(), "the shell to start")
    private_tmux.paste(name, "exec cat -vT", enter=True, bracketed=False)
    # The shell replaces itself with cat (same pid): from then on the pane's reader is cat.
    pid = private_tmux.pane_state(name).pid
    wait_for(lambda: Path(f"/proc/{pid}/comm").read_text().strip() == "cat", "the pane's process to be cat")
    return agent


def pane(runner: TmuxRunner, agent: Agent) -> str:
    return runner.capture(cli.session_name(agent))


def test_the_page_presses_down_and_enter_in_the_pane_and_the_timeline_says_who(owner, private_tmux, cat_agent):
    client = Client()
    client.force_login(owner)
    for key in ("Down", "Enter"):
        response = client.post(f"/agents/{cat_agent.pk}/keys", {"keys": key})
        assert response.status_code == 302
    # cat -vT prints the line it read: Down's escape sequence, then Enter ends the line.
    wait_for(
        lambda: pane(private_tmux, cat_agent).split("exec cat -vT", 1)[1].count("^[[B") == 2,
        "Down echoed by the terminal, then printed by cat on Enter",
    )
    notes = list(AgentEvent.objects.filter(agent=cat_agent, message__startswith="keys sent by").order_by("id"))
    assert [note.message for note in notes] == ["keys sent by alice: Down", "keys sent by alice: Enter"]
    assert notes[0].metadata == {"keys": ["Down"], "by": "alice"}
    page = client.get(f"/agents/{cat_agent.pk}/").content.decode()
    assert "keys sent by alice: Enter" in page
    assert 'data-key="C-c"' in page


def test_the_api_presses_a_list_of_keys_in_order(owner_token, private_tmux, cat_agent):
    response = Api(owner_token).post(f"/api/v1/agents/{cat_agent.pk}/keys", {"keys": ["y", "n", "Tab", "Enter"]})
    assert response.status_code == 200, response.content
    assert response.json()["message"] == "keys sent by alice: y n Tab Enter"
    wait_for(lambda: "yn^I" in pane(private_tmux, cat_agent), "y n Tab in the pane")


@pytest.mark.parametrize(
    "keys",
    [["ls\n"], ["Escape"], ["C-d"], ["Down", "echo pwned"], [], "Down", [1], ["Enter"] * 9, None],
)
def test_the_api_refuses_anything_but_the_allowed_key_names_and_sends_nothing(
    owner_token, private_tmux, cat_agent, keys
):
    before = pane(private_tmux, cat_agent)
    response = Api(owner_token).post(f"/api/v1/agents/{cat_agent.pk}/keys", {"keys": keys})
    assert response.status_code == 400
    error = error_of(response)
    assert "Up, Down, Enter, Esc, Tab, y, n, C-c" in error["message"]
    # A fence: keys the refused request sent would reach cat first and show before it.
    private_tmux.paste(cli.session_name(cat_agent), "fence-1", enter=True, bracketed=False)
    wait_for(lambda: pane(private_tmux, cat_agent).count("fence-1") == 2, "the fence, echoed and printed by cat")
    assert pane(private_tmux, cat_agent).rstrip() == f"{before.rstrip()}\nfence-1\nfence-1"
    assert not AgentEvent.objects.filter(agent=cat_agent, message__startswith="keys sent").exists()


def test_another_users_agent_is_404_on_the_page_and_the_api(member, outsider_token, private_tmux, cat_agent):
    client = Client()
    client.force_login(member)
    assert client.post(f"/agents/{cat_agent.pk}/keys", {"keys": "Enter"}).status_code == 404
    assert Api(outsider_token).post(f"/api/v1/agents/{cat_agent.pk}/keys", {"keys": ["Enter"]}).status_code == 404
    assert not AgentEvent.objects.filter(agent=cat_agent, message__startswith="keys sent").exists()


def test_the_page_form_needs_the_csrf_token(owner, private_tmux, cat_agent):
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner)
    assert client.post(f"/agents/{cat_agent.pk}/keys", {"keys": "Enter"}).status_code == 403
    assert not AgentEvent.objects.filter(agent=cat_agent, message__startswith="keys sent").exists()


def test_an_agent_token_cannot_press_keys(owner, private_tmux, cat_agent):
    from agents.tokens import agent_token_mint

    token = agent_token_mint(agent=cat_agent)
    response = Api(token).post(f"/api/v1/agents/{cat_agent.pk}/keys", {"keys": ["Enter"]})
    assert response.status_code == 403
    assert error_of(response)["code"] == "PERMISSION_DENIED"


def test_a_dead_pane_gets_nothing_and_a_clear_409(owner_token, private_tmux, cat_agent):
    name = cli.session_name(cat_agent)
    private_tmux.send_keys(name, ["C-d"])  # cat reads EOF and exits; remain-on-exit keeps the pane
    wait_for(lambda: private_tmux.pane_state(name).dead, "the pane to die")
    response = Api(owner_token).post(f"/api/v1/agents/{cat_agent.pk}/keys", {"keys": ["Down"]})
    assert response.status_code == 409
    assert "no live pane" in error_of(response)["message"]
    assert private_tmux.exists(name)  # the tmux server is still up (no crash on a dead pane)


def test_a_stopped_agent_is_409(owner_token, private_tmux, cat_agent):
    force_status(cat_agent, "stopped")
    response = Api(owner_token).post(f"/api/v1/agents/{cat_agent.pk}/keys", {"keys": ["Down"]})
    assert response.status_code == 409
    assert "stopped" in error_of(response)["message"]


def test_a_shadow_or_expert_agent_is_refused_saying_why(owner, owner_token, make_agent):
    from peers.models import Peer

    expert = make_agent(owner, type="expert", name="thinker")
    link = Peer.objects.create(
        owner=owner,
        instance_id="inst_0123456789ab",
        label="Cloud",
        url="http://127.0.0.1:9",
        public_key="k",
        fingerprint="f",
        inbound_digest="d" * 64,
        inbound_prefix="d",
        outbound_token_encrypted="x",
    )
    shadow = Agent.objects.create(
        owner=owner, name="remote", type="claude", status="running", cwd="/srv", peer=link, peer_agent_id="agt_x"
    )
    api = Api(owner_token)
    refused = api.post(f"/api/v1/agents/{shadow.pk}/keys", {"keys": ["Enter"]})
    assert refused.status_code == 400 and "linked instance" in error_of(refused)["message"]
    refused = api.post(f"/api/v1/agents/{expert.pk}/keys", {"keys": ["Enter"]})
    assert refused.status_code == 400 and "no pane" in error_of(refused)["message"]
