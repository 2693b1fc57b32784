"""An approval waiting on a linked instance notifies the owner of the agent's shadow here
(docs/notifications.md#events): the peer's events stream carries the agent's ``blocked``
event, the mirror records it on the shadow, and that becomes an approval notification
linking to the Approvals page, whose linked list answers it."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from agents import approvals, services
from agents.models import Agent
from attention.models import Notification
from peers.services.shadows import shadow_apply_frame
from peers.stream import peer_agent_data

pytestmark = pytest.mark.django_db


def test_an_approval_pending_on_the_peer_notifies_the_shadows_owner_once(
    owner: Any, outsider: Any, make_peer: Any, tmp_path: Any, django_capture_on_commit_callbacks: Any, settings: Any
) -> None:
    settings.PUBLIC_URL = "https://here.example"
    # On the peer: the link user's agent asks to run a command.
    there = services.agent_create(owner=owner, type="shell", name="deployer", cwd=str(tmp_path))
    Agent.objects.filter(pk=there.pk).update(status="running")
    approvals.approval_request(agent=there, tool_name="Bash", tool_input={"command": "make deploy"})
    frame = peer_agent_data(Agent.objects.get(pk=there.pk), allow_events=True)
    assert frame["latest_event"]["type"] == "blocked"

    # Here: the mirror applies the peer's frame to the shadow, twice (a reconnect replays it).
    link = make_peer(outsider, label="Cloud", url="http://cloud.test").peer
    with django_capture_on_commit_callbacks(execute=True):
        shadow_apply_frame(peer=link, data=frame, seen_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        shadow_apply_frame(peer=link, data=frame, seen_at=timezone.now())

    shadow = Agent.objects.get(peer=link, peer_agent_id=there.pk)
    notification = Notification.objects.get(user=outsider)
    assert notification.kind == Notification.Kind.APPROVAL
    assert notification.title == "deployer (Cloud) asks for approval on its instance"
    assert "make deploy" in notification.body
    assert notification.url == "https://here.example/approvals/"
    assert notification.agent_id == shadow.pk


def test_a_peer_that_does_not_share_events_notifies_nothing(
    owner: Any, outsider: Any, make_peer: Any, tmp_path: Any, django_capture_on_commit_callbacks: Any
) -> None:
    there = services.agent_create(owner=owner, type="shell", name="deployer", cwd=str(tmp_path))
    Agent.objects.filter(pk=there.pk).update(status="running")
    approvals.approval_request(agent=there, tool_name="Bash", tool_input={"command": "make deploy"})
    frame = peer_agent_data(Agent.objects.get(pk=there.pk), allow_events=False)
    link = make_peer(outsider, label="Cloud", url="http://cloud.test").peer
    with django_capture_on_commit_callbacks(execute=True):
        shadow_apply_frame(peer=link, data=frame, seen_at=timezone.now())
    assert not Notification.objects.filter(user=outsider).exists()
