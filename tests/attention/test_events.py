"""Which agent events become notifications, for whom, with what text and link; and when
pushes are held back (settings, quiet hours, a tab viewing the agent)."""

from __future__ import annotations

from datetime import datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.utils import timezone

from agents import approvals
from agents import services as agent_services
from agents.models import Agent, AgentEvent, Run
from attention import services
from attention.models import AgentViewing, Delivery, Notification

pytestmark = pytest.mark.django_db


@pytest.fixture
def with_apprise(owner: Any) -> None:
    services.notification_settings_update(user=owner, apprise_urls=["json://127.0.0.1:9/hook"])


def test_a_pending_approval_notifies_its_owner_with_the_tool_command_and_the_approval_link(
    owner: Any, cli_agent: Agent, with_apprise: None, django_capture_on_commit_callbacks: Any, settings: Any
) -> None:
    settings.PUBLIC_URL = "https://dispatch.example.org"
    with django_capture_on_commit_callbacks(execute=True):
        approval = approvals.approval_request(
            agent=cli_agent, tool_name="Bash", tool_input={"command": "git push --force"}
        )
    assert approval.status == "pending"
    notification = Notification.objects.get(user=owner)
    assert notification.kind == Notification.Kind.APPROVAL
    assert notification.title == "builder asks to use Bash"
    assert "git push --force" in notification.body
    assert notification.url == f"https://dispatch.example.org/approvals/{approval.pk}/"
    assert notification.agent_id == cli_agent.pk
    assert notification.approval_id == approval.pk
    assert notification.deliveries.get().channel == Delivery.Channel.APPRISE


def test_an_approval_a_policy_answered_at_once_notifies_no_one(
    owner: Any, cli_agent: Agent, with_apprise: None, django_capture_on_commit_callbacks: Any
) -> None:
    approvals.approval_rule_create(user=owner, tool="Read", pattern="", action="allow")
    with django_capture_on_commit_callbacks(execute=True):
        approval = approvals.approval_request(agent=cli_agent, tool_name="Read", tool_input={"file_path": "/etc/hosts"})
    assert approval.status == "allowed"
    assert not Notification.objects.exists()


def test_a_failed_agent_and_a_failed_run_notify_as_failures(
    owner: Any, cli_agent: Agent, with_apprise: None, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        agent_services.agent_set_status(agent=cli_agent, status=Agent.Status.ERROR, note="claude exited: bad flag")
    failed = Notification.objects.get()
    assert (failed.kind, failed.title, failed.body) == ("failed", "builder failed", "claude exited: bad flag")

    expert = Agent.objects.create(owner=owner, name="helper", type="expert", status=Agent.Status.RUNNING, cwd="/tmp")
    run = Run.objects.create(agent=expert, status=Run.Status.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        agent_services.agent_event_record(
            agent=expert, run=run, type="system", message="run failed: model call failed", metadata={"error": "boom"}
        )
        agent_services.agent_event_record(
            agent=expert, run=run, type="system", message="answer", metadata={"answer": "42", "step": 3}
        )
        agent_services.agent_event_record(agent=expert, run=run, type="system", message="model call 1")
    kinds = list(Notification.objects.filter(agent_id=expert.pk).order_by("created_at").values_list("kind", "body"))
    assert kinds == [("failed", "boom"), ("finished", "42")]


def test_events_the_user_turned_off_make_nothing(
    owner: Any, cli_agent: Agent, with_apprise: None, django_capture_on_commit_callbacks: Any
) -> None:
    services.notification_settings_update(user=owner, on_finished=False)
    with django_capture_on_commit_callbacks(execute=True):
        agent_services.agent_event_record(agent=cli_agent, type=AgentEvent.Type.DONE, message="turn finished")
    assert not Notification.objects.exists()


def test_old_mirrored_history_of_a_shadow_agent_is_not_news(
    owner: Any, cli_agent: Agent, with_apprise: None, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        agent_services.agent_event_record(
            agent=cli_agent,
            type=AgentEvent.Type.DONE,
            message="turn finished",
            created_at=timezone.now() - timedelta(hours=2),
            mirrored=True,
        )
        agent_services.agent_event_record(
            agent=cli_agent, type=AgentEvent.Type.DONE, message="turn finished", mirrored=True
        )
    assert Notification.objects.count() == 1


def test_a_shadow_agents_mirrored_approval_request_notifies_its_owner_with_the_approvals_page(
    owner: Any, cli_agent: Agent, with_apprise: None, django_capture_on_commit_callbacks: Any, settings: Any
) -> None:
    settings.PUBLIC_URL = "https://dispatch.example.org"
    message = f"{approvals.APPROVAL_REQUESTED}Bash: git push --force"
    with django_capture_on_commit_callbacks(execute=True):
        agent_services.agent_event_record(agent=cli_agent, type=AgentEvent.Type.BLOCKED, message=message, mirrored=True)
        # The same event again (a replayed frame) and history the mirror catches up on: no news.
        agent_services.agent_event_record(
            agent=cli_agent,
            type=AgentEvent.Type.BLOCKED,
            message=message,
            created_at=timezone.now() - timedelta(hours=2),
            mirrored=True,
        )
        # A blocked event of this instance's own agent is its approval's (notified by the approval).
        agent_services.agent_event_record(agent=cli_agent, type=AgentEvent.Type.BLOCKED, message=message)
    notification = Notification.objects.get(user=owner)
    assert notification.kind == Notification.Kind.APPROVAL
    assert notification.title == "builder asks for approval on its instance"
    assert notification.body == "Bash: git push --force"
    assert notification.url == "https://dispatch.example.org/approvals/"
    assert notification.agent_id == cli_agent.pk and notification.approval_id == ""


def test_quiet_hours_hold_pushes_back_and_approvals_wake_only_when_allowed(owner: Any, cli_agent: Agent) -> None:
    rome = ZoneInfo("Europe/Rome")
    services.notification_settings_update(
        user=owner,
        apprise_urls=["json://127.0.0.1:9/hook"],
        quiet_hours=services.QuietHours(time(22, 0), time(7, 0), "Europe/Rome"),
    )
    night = datetime(2026, 12, 5, 23, 30, tzinfo=rome)
    morning = datetime(2026, 12, 5, 7, 0, tzinfo=rome)

    def notify(kind: str, at: datetime, key: str) -> Notification:
        made = services.notify(
            user=owner, kind=kind, title="t", body="b", url="http://x/", dedupe_key=key, agent_id=cli_agent.pk, at=at
        )
        assert made is not None
        return made

    assert notify("finished", night, "a").suppressed_reason == "quiet hours"
    assert notify("approval", night, "b").suppressed_reason == "quiet hours"
    assert notify("finished", morning, "c").status == Notification.Status.PENDING
    services.notification_settings_update(user=owner, approvals_break_quiet_hours=True)
    woke = notify("approval", night, "d")
    assert woke.status == Notification.Status.PENDING and woke.deliveries.count() == 1
    assert notify("failed", night, "e").suppressed_reason == "quiet hours"


def test_a_tab_viewing_the_agent_holds_its_pushes_back_until_the_heartbeat_expires(
    owner: Any, cli_agent: Agent, with_apprise: None, settings: Any
) -> None:
    settings.NOTIFY_VIEWING_TTL = 30
    services.viewing_beat(user=owner, client_id="tab-0001", agent_id=cli_agent.pk)
    other = Agent.objects.create(owner=owner, name="other", type="claude", status=Agent.Status.RUNNING, cwd="/tmp")

    def notify(agent: Agent, key: str, at: datetime | None = None) -> Notification | None:
        return services.notify(
            user=owner, kind="finished", title="t", body="", url="http://x/", dedupe_key=key, agent_id=agent.pk, at=at
        )

    held = notify(cli_agent, "one")
    assert held is not None and held.suppressed_reason == "viewing" and not held.deliveries.exists()
    other_agent = notify(other, "two")
    assert other_agent is not None and other_agent.status == Notification.Status.PENDING
    later = notify(cli_agent, "three", at=timezone.now() + timedelta(seconds=31))
    assert later is not None and later.status == Notification.Status.PENDING

    services.viewing_beat(user=owner, client_id="tab-0001", agent_id=None)  # the tab was hidden
    assert not AgentViewing.objects.exists()
    shown = notify(cli_agent, "four")
    assert shown is not None and shown.status == Notification.Status.PENDING


def test_one_event_is_one_notification(owner: Any, cli_agent: Agent, with_apprise: None) -> None:
    first = services.notify(user=owner, kind="finished", title="t", body="", url="http://x/", dedupe_key="event:1")
    again = services.notify(user=owner, kind="finished", title="t", body="", url="http://x/", dedupe_key="event:1")
    assert first is not None and again is None
    assert Notification.objects.count() == 1 and Delivery.objects.count() == 1


def test_no_target_means_suppressed_with_no_targets(owner: Any, cli_agent: Agent) -> None:
    made = services.notify(user=owner, kind="finished", title="t", body="", url="http://x/", dedupe_key="k")
    assert made is not None and made.suppressed_reason == "no targets"


def test_two_workers_never_claim_one_delivery(owner: Any, with_apprise: None) -> None:
    services.notify(user=owner, kind="finished", title="t", body="", url="http://x/", dedupe_key="k")
    first = services.deliveries_claim()
    second = services.deliveries_claim()
    assert len(first) == 1 and second == []
    # A worker that died mid-send: its claim lapses and another takes the delivery.
    assert len(services.deliveries_claim(now=timezone.now() + services.CLAIM_LEASE + timedelta(seconds=1))) == 1


def test_old_finished_notifications_are_pruned_but_not_ones_still_being_sent(owner: Any, with_apprise: None) -> None:
    old = timezone.now() - timedelta(days=31)
    done = services.notify(user=owner, kind="finished", title="t", body="", url="http://x/", dedupe_key="a", at=old)
    open_one = services.notify(user=owner, kind="failed", title="t", body="", url="http://x/", dedupe_key="b", at=old)
    fresh = services.notify(user=owner, kind="failed", title="t", body="", url="http://x/", dedupe_key="c")
    assert done is not None and open_one is not None and fresh is not None
    Delivery.objects.filter(notification=done).update(status=Delivery.Status.SENT)
    AgentViewing.objects.create(user=owner, client_id="tab-old-0001", agent_id="agt_x", expires_at=old)
    assert services.notifications_prune() == 1
    assert set(Notification.objects.values_list("pk", flat=True)) == {open_one.pk, fresh.pk}
    assert not AgentViewing.objects.exists()
