"""Shadow agents follow their peer's frames (docs/peers.md#shadow-agents)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from agents.models import Agent, AgentEvent
from peers.services.shadows import (
    shadow_apply_frame,
    shadow_upsert,
    shadows_apply_snapshot,
    shadows_mark_stale,
    shadows_reap_missing,
    shadows_stop_for_unlink,
)

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 9, 0, 0, 123456, tzinfo=UTC)


def frame(agent_id: str, status: str = "running", **extra: Any) -> dict[str, Any]:
    return {
        "id": agent_id,
        "name": extra.pop("name", f"agent {agent_id}"),
        "type": "shell",
        "status": status,
        "parent_id": None,
        "launched_by": None,
        "updated_at": "2026-11-30T09:00:00Z",
        **extra,
    }


def event(message: str, at: datetime = T0, type: str = "working") -> dict[str, Any]:
    return {"type": type, "message": message, "created_at": at.isoformat()}


def timeline(agent: Agent) -> list[tuple[str, str]]:
    return [(e.type, e.message) for e in AgentEvent.objects.filter(agent=agent).order_by("created_at", "id")]


def test_a_new_agent_gets_a_shadow_owned_by_the_link_user_with_the_peers_status(owner, make_peer):
    peer = make_peer(owner).peer
    shadow = shadow_apply_frame(peer=peer, data=frame("ag_b1", "creating", name="builder"), seen_at=timezone.now())
    assert (shadow.owner, shadow.peer, shadow.peer_agent_id) == (owner, peer, "ag_b1")
    assert (shadow.name, shadow.type, shadow.status) == ("builder", "shell", "creating")
    # Any known status, even one the local transition table forbids (creating → archived → running).
    for status in ("archived", "running", "error", "stopping"):
        again = shadow_apply_frame(peer=peer, data=frame("ag_b1", status), seen_at=timezone.now())
        assert again.pk == shadow.pk and again.status == status
    assert Agent.objects.filter(peer=peer).count() == 1


def test_unknown_status_and_bad_timestamps_are_rejected_and_change_nothing(owner, make_peer):
    peer = make_peer(owner).peer
    shadow_apply_frame(peer=peer, data=frame("ag_b1", "running"), seen_at=timezone.now())
    with pytest.raises(ValueError, match="unknown status"):
        shadow_apply_frame(peer=peer, data=frame("ag_b1", "dancing"), seen_at=timezone.now())
    with pytest.raises(ValueError, match="not a timestamp"):
        shadow_apply_frame(
            peer=peer,
            data=frame("ag_b1", "stopped", latest_event={"type": "done", "message": "x", "created_at": "yesterday"}),
            seen_at=timezone.now(),
        )
    with pytest.raises(ValueError, match="not a timestamp"):
        shadow_apply_frame(peer=peer, data=frame("ag_b1", "stopped", updated_at="soon"), seen_at=timezone.now())
    with pytest.raises(ValueError):
        shadow_apply_frame(peer=peer, data=frame("ag_new", "dancing"), seen_at=timezone.now())
    assert list(Agent.objects.filter(peer=peer).values_list("peer_agent_id", "status")) == [("ag_b1", "running")]
    assert AgentEvent.objects.filter(agent__peer=peer).count() == 0


def test_events_keep_their_original_time_and_replays_add_nothing(owner, make_peer):
    peer = make_peer(owner).peer
    for _ in range(3):  # the same snapshot replayed after reconnects
        shadows_apply_snapshot(
            peer=peer, agents=[frame("ag_b1", latest_event=event("compiling"))], seen_at=timezone.now()
        )
    shadow = Agent.objects.get(peer=peer)
    (mirrored,) = AgentEvent.objects.filter(agent=shadow)
    assert (mirrored.type, mirrored.message, mirrored.created_at, mirrored.mirrored) == (
        "working",
        "compiling",
        T0,
        True,
    )
    later = T0 + timedelta(seconds=5)
    shadow_upsert(
        peer=peer,
        peer_agent_id="ag_b1",
        name="x",
        type="shell",
        status="running",
        latest_event=event("needs you", later, "waiting_user"),
        seen_at=timezone.now(),
    )
    shadow.refresh_from_db()
    assert timeline(shadow) == [("working", "compiling"), ("waiting_user", "needs you")]
    assert (shadow.latest_event_type, shadow.latest_event_message, shadow.latest_event_at) == (
        "waiting_user",
        "needs you",
        later,
    )


def test_a_frame_without_latest_event_leaves_the_shadows_event_alone(owner, make_peer):
    peer = make_peer(owner).peer
    shadow_apply_frame(peer=peer, data=frame("ag_b1", latest_event=event("testing")), seen_at=timezone.now())
    shadow = shadow_apply_frame(peer=peer, data=frame("ag_b1", "stopped", name="renamed"), seen_at=timezone.now())
    assert (shadow.status, shadow.name) == ("stopped", "renamed")
    assert (shadow.latest_event_type, shadow.latest_event_message) == ("working", "testing")
    assert timeline(shadow) == [("working", "testing")]


def test_a_snapshot_reaps_the_shadows_it_no_longer_lists(owner, make_peer):
    peer = make_peer(owner, label="Cloud").peer
    other_peer = make_peer(owner, label="Lab").peer
    shadows_apply_snapshot(peer=peer, agents=[frame("ag_keep"), frame("ag_gone")], seen_at=timezone.now())
    shadow_apply_frame(peer=other_peer, data=frame("ag_gone"), seen_at=timezone.now())
    counts = shadows_apply_snapshot(peer=peer, agents=[frame("ag_keep")], seen_at=timezone.now())
    assert counts == {"applied": 1, "rejected": 0, "reaped": 1}
    gone = Agent.objects.get(peer=peer, peer_agent_id="ag_gone")
    assert gone.status == "stopped"
    assert timeline(gone) == [("system", "no longer reported by Cloud")]
    assert Agent.objects.get(peer=peer, peer_agent_id="ag_keep").status == "running"
    assert Agent.objects.get(peer=other_peer).status == "running"  # another peer's shadows are untouched
    # Reaping again adds no second event.
    shadows_reap_missing(peer=peer, listed_ids=["ag_keep"])
    assert timeline(gone) == [("system", "no longer reported by Cloud")]


def test_a_rejected_snapshot_item_is_skipped_and_not_reaped(owner, make_peer):
    peer = make_peer(owner).peer
    shadows_apply_snapshot(peer=peer, agents=[frame("ag_a"), frame("ag_b")], seen_at=timezone.now())
    counts = shadows_apply_snapshot(peer=peer, agents=[frame("ag_a"), frame("ag_b", "weird")], seen_at=timezone.now())
    assert counts == {"applied": 1, "rejected": 1, "reaped": 0}
    assert Agent.objects.get(peer=peer, peer_agent_id="ag_b").status == "running"


def test_a_drop_marks_shadows_stale_once_and_the_next_snapshot_clears_it(owner, make_peer):
    peer = make_peer(owner, label="Cloud").peer
    shadows_apply_snapshot(peer=peer, agents=[frame("ag_a"), frame("ag_b", "stopped")], seen_at=timezone.now())
    assert shadows_mark_stale(peer=peer) == 2
    assert shadows_mark_stale(peer=peer) == 0  # the reconnect failed again: still one event per drop
    for shadow in Agent.objects.filter(peer=peer):
        assert shadow.stale
        assert timeline(shadow) == [("system", "lost contact with Cloud")]
    shadows_apply_snapshot(peer=peer, agents=[frame("ag_a"), frame("ag_b", "stopped")], seen_at=timezone.now())
    assert not Agent.objects.filter(peer=peer, stale=True).exists()
    shadows_mark_stale(peer=peer)  # a second drop is a second event
    assert timeline(Agent.objects.get(peer=peer, peer_agent_id="ag_a")) == [
        ("system", "lost contact with Cloud"),
        ("system", "contact restored with Cloud"),
        ("system", "lost contact with Cloud"),
    ]


def test_contact_restored_is_noted_once_per_drop_and_only_after_a_lost_contact(owner, make_peer):
    peer = make_peer(owner, label="Cloud").peer
    agents = [frame("ag_a", latest_event=event("reading")), frame("ag_b", "stopped")]
    shadows_apply_snapshot(peer=peer, agents=agents, seen_at=timezone.now())
    shadows_apply_snapshot(peer=peer, agents=agents, seen_at=timezone.now())  # a reconnect that lost nothing
    for shadow in Agent.objects.filter(peer=peer):
        assert "contact restored with Cloud" not in [message for _, message in timeline(shadow)]
    shadows_mark_stale(peer=peer)
    shadows_mark_stale(peer=peer)  # reconnects that failed
    shadows_apply_snapshot(peer=peer, agents=agents, seen_at=timezone.now())
    shadows_apply_snapshot(peer=peer, agents=agents, seen_at=timezone.now())  # the next one adds nothing
    lead = Agent.objects.get(peer=peer, peer_agent_id="ag_a")
    assert timeline(lead) == [
        ("working", "reading"),  # the peer's event, at the peer's (earlier) time
        ("system", "lost contact with Cloud"),
        ("system", "contact restored with Cloud"),
    ]
    # The agents list shows the newest event: contact is back, not lost.
    assert (lead.stale, lead.latest_event_type, lead.latest_event_message) == (
        False,
        "system",
        "contact restored with Cloud",
    )
    assert timeline(Agent.objects.get(peer=peer, peer_agent_id="ag_b"))[-1] == ("system", "contact restored with Cloud")


def test_contact_restored_comes_before_what_the_snapshot_reports(owner, make_peer):
    peer = make_peer(owner, label="Cloud").peer
    shadows_apply_snapshot(peer=peer, agents=[frame("ag_a"), frame("ag_gone")], seen_at=timezone.now())
    shadows_mark_stale(peer=peer)
    shadows_apply_snapshot(peer=peer, agents=[frame("ag_a")], seen_at=timezone.now())
    assert timeline(Agent.objects.get(peer=peer, peer_agent_id="ag_gone")) == [
        ("system", "lost contact with Cloud"),
        ("system", "contact restored with Cloud"),
        ("system", "no longer reported by Cloud"),
    ]


def test_a_frame_reaching_a_stale_shadow_notes_contact_restored(owner, make_peer):
    peer = make_peer(owner, label="Cloud").peer
    shadow_apply_frame(peer=peer, data=frame("ag_a"), seen_at=timezone.now())
    shadows_mark_stale(peer=peer)
    shadow_apply_frame(peer=peer, data=frame("ag_a"), seen_at=timezone.now())
    shadow_apply_frame(peer=peer, data=frame("ag_a"), seen_at=timezone.now())
    shadow = Agent.objects.get(peer=peer)
    assert not shadow.stale
    assert timeline(shadow) == [("system", "lost contact with Cloud"), ("system", "contact restored with Cloud")]


def test_an_archived_shadow_gets_no_contact_notes(owner, make_peer):
    peer = make_peer(owner, label="Cloud").peer
    shadows_apply_snapshot(peer=peer, agents=[frame("ag_a", "archived")], seen_at=timezone.now())
    shadows_mark_stale(peer=peer)
    shadows_apply_snapshot(peer=peer, agents=[frame("ag_a", "archived")], seen_at=timezone.now())
    assert timeline(Agent.objects.get(peer=peer)) == []


def test_unlink_stops_the_running_shadows_with_an_explanation(owner, make_peer):
    peer = make_peer(owner, label="Cloud").peer
    shadows_apply_snapshot(
        peer=peer, agents=[frame("ag_a"), frame("ag_b", "creating"), frame("ag_c", "archived")], seen_at=timezone.now()
    )
    assert shadows_stop_for_unlink(peer=peer) == 2
    statuses = dict(Agent.objects.filter(peer=peer).values_list("peer_agent_id", "status"))
    assert statuses == {"ag_a": "stopped", "ag_b": "stopped", "ag_c": "archived"}
    (note,) = timeline(Agent.objects.get(peer=peer, peer_agent_id="ag_a"))
    assert note[0] == "system" and "Cloud" in note[1]


def test_a_child_shadow_links_to_its_parents_shadow(owner, make_peer):
    peer = make_peer(owner).peer
    shadows_apply_snapshot(
        peer=peer, agents=[frame("ag_parent"), frame("ag_child", parent_id="ag_parent")], seen_at=timezone.now()
    )
    child = Agent.objects.get(peer=peer, peer_agent_id="ag_child")
    assert child.parent == Agent.objects.get(peer=peer, peer_agent_id="ag_parent")
