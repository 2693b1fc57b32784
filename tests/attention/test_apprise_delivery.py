"""Apprise: a notification reaches a ``json://`` URL served by a local HTTP receiver with
the exact payload apprise posts; a failing target is retried with backoff, then given up."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from agents import services as agent_services
from agents.models import Agent, AgentEvent
from attention import services
from attention.models import Delivery, Notification
from attention.worker import deliver_due_once
from tests.attention.conftest import Receiver

pytestmark = pytest.mark.django_db


def _turn_finished(agent: Agent, capture: Any, said: str = "All tests pass.") -> None:
    # The Stop hook's event, as agents.cli_hooks records it; the signal fires on commit.
    with capture(execute=True):
        agent_services.agent_event_record(
            agent=agent,
            type=AgentEvent.Type.DONE,
            message="turn finished",
            metadata={"hook": "Stop", "last_assistant_message": said},
        )


def test_a_finished_turn_reaches_a_json_url_with_apprises_exact_payload(
    owner: Any, cli_agent: Agent, receiver: Receiver, django_capture_on_commit_callbacks: Any, settings: Any
) -> None:
    settings.PUBLIC_URL = "https://dispatch.example.org"
    services.notification_settings_update(user=owner, apprise_urls=[f"json://127.0.0.1:{receiver.port}/hook"])

    _turn_finished(cli_agent, django_capture_on_commit_callbacks)
    notification = Notification.objects.get(user=owner)
    assert notification.status == Notification.Status.PENDING
    assert receiver.requests == []  # nothing is sent on the hook's path: the worker sends

    assert deliver_due_once() == 1
    request = receiver.wait()
    assert request.method == "POST"
    assert request.path == "/hook"
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.body) == {
        "version": "1.0",
        "title": "builder finished its turn",
        "message": f"All tests pass.\n\nhttps://dispatch.example.org/agents/{cli_agent.pk}/",
        "attachments": [],
        "type": "info",
    }
    notification.refresh_from_db()
    assert notification.status == Notification.Status.SENT
    assert notification.deliveries.get().status == Delivery.Status.SENT


def test_a_failing_target_is_retried_with_backoff_then_given_up_with_its_last_error(
    owner: Any, cli_agent: Agent, receiver: Receiver, django_capture_on_commit_callbacks: Any, settings: Any
) -> None:
    settings.NOTIFY_MAX_ATTEMPTS = 2
    settings.NOTIFY_RETRY_BASE = 30.0
    receiver.status = 500
    services.notification_settings_update(user=owner, apprise_urls=[f"json://127.0.0.1:{receiver.port}/hook"])
    _turn_finished(cli_agent, django_capture_on_commit_callbacks)

    before = timezone.now()
    assert deliver_due_once() == 1
    delivery = Delivery.objects.get()
    assert delivery.status == Delivery.Status.PENDING
    assert delivery.attempts == 1
    assert "500" in delivery.last_error
    assert delivery.next_attempt_at >= before + timedelta(seconds=30)
    assert deliver_due_once() == 0  # not due yet

    Delivery.objects.update(next_attempt_at=timezone.now())
    assert deliver_due_once() == 1
    delivery.refresh_from_db()
    assert delivery.status == Delivery.Status.FAILED
    assert delivery.attempts == 2
    assert len(receiver.requests) == 2
    assert Notification.objects.get().status == Notification.Status.FAILED
    Delivery.objects.update(next_attempt_at=timezone.now())
    assert deliver_due_once() == 0  # given up: never sent again


def test_the_test_button_sends_to_every_apprise_url_even_in_quiet_hours(
    owner: Any, receiver: Receiver, settings: Any
) -> None:
    from datetime import time

    services.notification_settings_update(
        user=owner,
        apprise_urls=[f"json://127.0.0.1:{receiver.port}/one", f"json://127.0.0.1:{receiver.port}/two"],
        quiet_hours=services.QuietHours(time(0, 0), time(23, 59), "UTC"),
    )
    services.notify_test(user=owner)
    assert deliver_due_once() == 2
    assert sorted(request.path for request in receiver.requests) == ["/one", "/two"]
    assert json.loads(receiver.requests[0].body)["title"] == "Dispatch test notification"
