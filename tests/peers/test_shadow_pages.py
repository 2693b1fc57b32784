"""Shadow agents in the web pages (the agents list and the agent page; docs/peers.md#shadow-agents).

Shadow rows are made directly, as the mirroring subscriber would leave them: an ``Agent``
with ``peer`` and ``peer_agent_id``, and mirrored events with the peer's timestamps.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents.models import Agent, AgentEvent, AgentMessage
from agents.services import agent_create
from agents.views import nest_agents
from tests.peers.conftest import FakePeer

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser(owner: Any) -> Client:
    client = Client()
    client.force_login(owner)
    return client


@pytest.fixture
def cloud(owner: Any, make_peer: Callable[..., FakePeer]) -> FakePeer:
    return make_peer(owner, label="Cloud", last_seen_at=timezone.now())


def shadow(peer: FakePeer, name: str = "builder", status: str = "running", **fields: Any) -> Agent:
    """A shadow agent of ``peer`` as the mirror creates it."""
    fields.setdefault("peer_agent_id", "agt_" + name.encode().hex()[:12].ljust(12, "0"))
    return Agent.objects.create(
        owner=peer.peer.owner, name=name, type="claude", status=status, cwd="/srv/repo", peer=peer.peer, **fields
    )


def mirror(agent: Agent, type: str, message: str, *, seconds_ago: float) -> AgentEvent:
    """A mirrored event ``seconds_ago`` in the past (the peer's original time)."""
    return AgentEvent.objects.create(
        agent=agent,
        type=type,
        message=message,
        mirrored=True,
        created_at=timezone.now() - timedelta(seconds=seconds_ago),
    )


def row_order(page: str) -> list[str]:
    return re.findall(r'data-agent="(agt_[0-9a-f]+)" data-depth="(\d+)"', page)  # type: ignore[return-value]


# --- the Agents page ---------------------------------------------------------------------


def test_the_list_shows_local_and_shadow_agents_together_with_the_peers_badge(browser, owner, cloud, tmp_path):
    local = agent_create(owner=owner, type="expert", name="planner", cwd=str(tmp_path))
    remote = shadow(cloud, "builder")

    page = browser.get("/").content.decode()

    assert f'data-agent="{local.pk}"' in page and f'data-agent="{remote.pk}"' in page
    remote_row = page[page.index(f'data-agent="{remote.pk}"') :].split("</tr>")[0]
    local_row = page[page.index(f'data-agent="{local.pk}"') :].split("</tr>")[0]
    assert '<span class="badge peer-badge"' in remote_row and ">Cloud</span>" in remote_row
    assert "peer-badge" not in local_row


def test_a_stale_shadow_is_marked_stale_in_the_list(browser, cloud):
    live = shadow(cloud, "live-one")
    stale = shadow(cloud, "stale-one", stale=True)

    page = browser.get("/agents/fragment").content.decode()

    stale_row = page[page.index(f'data-agent="{stale.pk}"') :].split("</tr>")[0]
    live_row = page[page.index(f'data-agent="{live.pk}"') :].split("</tr>")[0]
    assert 'class="shadow stale' in stale_row and "stale-badge" in stale_row
    assert "stale" not in live_row.replace("live-one", "")


def test_sub_agents_are_nested_under_their_parent_local_and_shadow(browser, owner, cloud, tmp_path):
    parent = agent_create(owner=owner, type="expert", name="lead", cwd=str(tmp_path))
    remote_parent = shadow(cloud, "remote-lead")
    remote_child = shadow(cloud, "remote-helper", parent=remote_parent)
    local_child = agent_create(owner=owner, type="expert", name="helper", cwd=str(tmp_path), parent=parent)
    grandchild = shadow(cloud, "on-cloud", parent=local_child)  # launched on the peer by a local child

    page = browser.get("/").content.decode()

    # Newest first among the top-level agents, each followed by its own sub-agents.
    assert row_order(page) == [
        (remote_parent.pk, "0"),
        (remote_child.pk, "1"),
        (parent.pk, "0"),
        (local_child.pk, "1"),
        (grandchild.pk, "2"),
    ]
    assert f"child of {local_child.pk}" in page


def test_nesting_keeps_a_child_whose_parent_is_on_another_page_and_survives_a_cycle(owner, cloud):
    orphan_parent = shadow(cloud, "old")
    a = shadow(cloud, "a")
    b = shadow(cloud, "b", parent=a)
    a.parent = b  # a cycle cannot come from the services, but the page must not loop on it
    child = shadow(cloud, "child", parent=orphan_parent)

    rows = nest_agents([child, b, a])

    assert [(row.agent.name, row.depth) for row in rows] == [("child", 0), ("b", 0), ("a", 1)]


def test_the_launch_form_offers_the_users_live_peers_as_locations(browser, owner, member, make_peer):
    now = timezone.now()
    make_peer(owner, label="Cloud", last_seen_at=now - timedelta(seconds=30))
    make_peer(owner, label="laptop", last_seen_at=now - timedelta(minutes=6))
    make_peer(owner, label="Quiet")  # never seen
    make_peer(owner, label="Locked", last_seen_at=now, granted_by_peer={"allow_launch": False})
    make_peer(owner, label="Gone", revoked_at=now)
    make_peer(member, label="Theirs", last_seen_at=now)

    page = browser.get("/").content.decode()
    select = page[page.index('<select name="location"') :].split("</select>")[0]

    options = re.findall(r'<option value="([^"]*)"[^>]*?( disabled)?>([^<]*)</option>', select)
    assert [(value, bool(disabled), text) for value, disabled, text in options] == [
        ("", False, "this instance"),
        ("Cloud", False, "Cloud"),
        ("laptop", False, "laptop (not responding recently)"),
        ("Locked", True, "Locked (launching not permitted)"),
        ("Quiet", False, "Quiet (not responding recently)"),
    ]


def test_with_no_linked_instance_the_location_is_only_this_instance(browser):
    page = browser.get("/").content.decode()
    select = page[page.index('<select name="location"') :].split("</select>")[0]

    assert select.count("<option") == 1 and "this instance" in select
    assert "No agents yet." in page


def test_a_form_post_with_a_location_is_refused_and_launches_nothing(browser, owner, cloud, tmp_path):
    response = browser.post(
        "/", {"type": "expert", "name": "far", "cwd": str(tmp_path), "location": "Cloud", "prompt": "hi"}
    )

    assert response.status_code == 400
    assert "POST /api/v1/agents" in response.content.decode()
    assert 'value="Cloud" data-instance' in response.content.decode()
    assert not Agent.objects.filter(owner=owner).exists()


# --- the shadow agent page ---------------------------------------------------------------


def test_a_running_shadows_page_is_the_remote_activity_pane_not_a_terminal(browser, cloud):
    agent = shadow(cloud, "builder")
    mirror(agent, "working", "compiling the parser", seconds_ago=60)

    page = browser.get(f"/agents/{agent.pk}/").content.decode()

    assert "Remote activity" in page and "Terminal" not in page and "data-pane-agent" not in page
    assert '<p class="mirror-state mirror-live" id="mirror-state">Mirroring live' in page
    assert "compiling the parser" in page and "Best-effort status" in page
    assert f"<code>{agent.peer_agent_id}</code>" in page and '<span class="badge peer-badge">Cloud</span>' in page
    assert f'data-api-action="/api/v1/agents/{agent.pk}/messages"' in page
    assert 'id="archive"' in page and 'id="stop"' not in page and 'id="start"' not in page
    assert "Runs" not in page


def test_a_stale_shadow_says_the_link_is_down_with_its_last_known_state(browser, cloud):
    agent = shadow(cloud, "builder", stale=True)
    mirror(agent, "system", "lost contact with Cloud", seconds_ago=5)

    page = browser.get(f"/agents/{agent.pk}/").content.decode()

    assert "mirror-stale" in page and "Link down — last known state" in page and "Mirroring live" not in page
    assert re.search(r'<li class="event-system lost-contact">.*lost contact with Cloud</li>', page)


def test_a_shadow_whose_peer_is_back_says_contact_was_restored_after_the_lost_contact(browser, cloud):
    from peers.services.shadows import shadows_apply_snapshot, shadows_mark_stale

    agent = shadow(cloud, "builder")
    listed = [{"id": agent.peer_agent_id, "name": "builder", "type": "claude", "status": "running"}]
    shadows_mark_stale(peer=cloud.peer)
    shadows_apply_snapshot(peer=cloud.peer, agents=listed, seen_at=timezone.now())

    page = browser.get(f"/agents/{agent.pk}/").content.decode()

    assert '<p class="mirror-state mirror-live" id="mirror-state">Mirroring live' in page
    timeline = page[page.index('id="remote-timeline"') :].split("</ol>")[0]
    assert re.findall(r'<li class="([\w -]+)">.*?</strong> ([^<]+)</li>', timeline) == [
        ("event-system contact-restored", "contact restored with Cloud"),
        ("event-system lost-contact", "lost contact with Cloud"),
    ]
    # The Agents list shows the newest event: contact restored, not lost.
    listing = browser.get("/").content.decode()
    assert "contact restored with Cloud" in listing and "lost contact with Cloud" not in listing


@pytest.mark.parametrize("status", ["stopped", "error", "archived"])
def test_a_shadow_that_is_not_running_says_so_and_offers_no_message_box(browser, cloud, status):
    agent = shadow(cloud, "builder", status=status)

    page = browser.get(f"/agents/{agent.pk}/").content.decode()

    assert "mirror-stopped" in page and ">Not running</p>" in page and "Mirroring live" not in page
    assert 'id="message-form"' not in page and "messages need it running" in page
    assert ('id="archive"' in page) is (status != "archived")


def test_blocked_and_waiting_user_are_loud_and_the_timeline_is_newest_first(browser, cloud):
    agent = shadow(cloud, "builder")
    mirror(agent, "working", "first", seconds_ago=300)
    mirror(agent, "blocked", "needs the staging password", seconds_ago=200)
    mirror(agent, "waiting_user", "which branch?", seconds_ago=100)
    mirror(agent, "done", "last", seconds_ago=10)

    fragment = browser.get(f"/agents/{agent.pk}/fragment").content.decode()

    timeline = fragment[fragment.index('id="remote-timeline"') :].split("</ol>")[0]
    assert re.findall(r'<li class="event-(\w+)', timeline) == ["done", "waiting_user", "blocked", "working"]
    assert '<li class="event-blocked">' in timeline and '<li class="event-waiting_user">' in timeline
    assert "lost-contact" not in timeline and "<html" not in fragment


def test_the_timeline_shows_the_last_200_and_links_to_older_pages(browser, cloud):
    agent = shadow(cloud, "builder")
    base = timezone.now() - timedelta(hours=1)
    AgentEvent.objects.bulk_create(
        AgentEvent(
            agent=agent,
            type="working",
            message=f"step {index}",
            mirrored=True,
            created_at=base + timedelta(seconds=index),
        )
        for index in range(250)
    )

    page = browser.get(f"/agents/{agent.pk}/").content.decode()

    assert "Showing the last 200" in page and "step 249" in page and "step 50<" in page and "step 49<" not in page
    older = re.search(r'href="(/agents/[^"]+\?before=[^"]+)" id="older-activity"', page)
    assert older is not None
    older_page = browser.get(older.group(1).replace("&amp;", "&")).content.decode()
    timeline = older_page[older_page.index('id="remote-timeline"') :].split("</ol>")[0]
    assert re.findall(r"step (\d+)<", timeline) == [str(index) for index in range(49, -1, -1)]
    assert "Showing the last 200" not in older_page and "back to the newest" in older_page
    # The live part of the older page keeps following that page.
    assert re.search(r'hx-get="/agents/[^"]+/fragment\?before=', older_page)


def test_a_bad_timeline_cursor_is_a_400_not_a_crash(browser, cloud):
    agent = shadow(cloud, "builder")

    assert browser.get(f"/agents/{agent.pk}/?before=not-a-cursor").status_code == 400
    assert browser.get(f"/agents/{agent.pk}/fragment?before=not-a-cursor").status_code == 400


def test_a_shadow_with_nothing_mirrored_yet_says_so(browser, cloud):
    agent = shadow(cloud, "builder")

    page = browser.get(f"/agents/{agent.pk}/").content.decode()

    assert "No activity mirrored yet" in page and "Showing the last 200" not in page
    assert "No messages yet." in page


def test_messages_to_a_shadow_show_with_their_delivery_state(browser, owner, cloud):
    agent = shadow(cloud, "builder")
    AgentMessage.objects.create(recipient_agent=agent, sender_user=owner, content="run the tests", peer=cloud.peer)
    AgentMessage.objects.create(
        recipient_agent=agent,
        sender_user=owner,
        content="too late",
        peer=cloud.peer,
        status="dead",
        error="agent 'agt_x' is not running",
    )

    fragment = browser.get(f"/agents/{agent.pk}/fragment").content.decode()

    assert re.search(r"run the tests.*message-queued\">queued", fragment, re.S)
    assert re.search(r"too late.*message-dead\">dead.*is not running", fragment, re.S)


def test_another_user_sees_none_of_the_shadows(cloud, member):
    agent = shadow(cloud, "builder")
    mirror(agent, "blocked", "secret plans", seconds_ago=1)
    client = Client()
    client.force_login(member)

    assert agent.pk not in client.get("/").content.decode()
    assert agent.pk not in client.get("/agents/fragment").content.decode()
    assert client.get(f"/agents/{agent.pk}/").status_code == 404
    assert client.get(f"/agents/{agent.pk}/fragment").status_code == 404
    assert "Cloud" not in client.get("/").content.decode()  # nor the peer as a location


def test_a_shadows_page_costs_the_same_with_5_or_600_events(browser, cloud):
    agent = shadow(cloud, "builder")

    def add(count: int, start: int) -> None:
        base = timezone.now() - timedelta(hours=1)
        AgentEvent.objects.bulk_create(
            AgentEvent(
                agent=agent,
                type="working",
                message=f"step {index}",
                mirrored=True,
                created_at=base + timedelta(seconds=index),
            )
            for index in range(start, start + count)
        )

    def measure() -> tuple[int, str]:
        browser.get(f"/agents/{agent.pk}/")
        with CaptureQueriesContext(connection) as captured:
            page = browser.get(f"/agents/{agent.pk}/").content.decode()
        return len(captured), page

    add(5, 0)
    small, page = measure()
    assert "step 4" in page
    add(595, 5)
    large, page = measure()
    assert "step 599" in page and "Showing the last 200" in page
    assert small == large
