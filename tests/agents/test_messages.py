"""Message services (docs/agents.md#messages-and-their-status): expert recipients get runs, CLI ones a queue."""

from __future__ import annotations

from typing import Any

import pytest

from agents.messages import (
    message_get,
    message_mark_delivered,
    message_mark_failed,
    message_send,
    messages_fail_pending,
    messages_pending,
)
from agents.models import Agent, AgentEvent, AgentMessage, Run
from core.errors import DispatchError, InvalidRequest, NotFound
from tests.agents.conftest import force_status


def test_a_message_to_an_expert_agent_queues_a_run_and_is_delivered(owner: Any, make_agent: Any) -> None:
    agent = make_agent(owner)
    message = message_send(recipient=agent, content="summarise the logs", sender_user=owner)
    assert message.status == AgentMessage.Status.DELIVERED and message.delivered_at is not None
    assert Run.objects.get(agent=agent).input["instruction"] == "summarise the logs"


def test_a_message_to_a_cli_agent_waits_queued_for_its_supervisor(owner: Any, make_agent: Any) -> None:
    agent = force_status(make_agent(owner, type="shell"), Agent.Status.RUNNING)
    first = message_send(recipient=agent, content="one", sender_user=owner)
    second = message_send(recipient=agent, content="two\nlines", sender_user=owner)
    assert first.status == AgentMessage.Status.QUEUED
    assert [m.pk for m in messages_pending(agent=agent)] == [first.pk, second.pk]
    assert not Run.objects.filter(agent=agent).exists()
    assert message_mark_delivered(message=first) is True
    assert message_mark_delivered(message=first) is False  # only once
    assert AgentEvent.objects.filter(agent=agent, message="message delivered").count() == 1
    assert messages_fail_pending(agent=agent, error="agent stopped") == 1
    second.refresh_from_db()
    assert second.status == AgentMessage.Status.FAILED and second.error == "agent stopped"
    assert message_mark_failed(message=second, error="again") is False


def test_a_stopped_cli_agent_or_a_stopped_expert_refuses_messages(owner: Any, make_agent: Any) -> None:
    cli_agent = force_status(make_agent(owner, type="shell"), Agent.Status.STOPPED)
    expert = force_status(make_agent(owner), Agent.Status.STOPPED)
    for agent in (cli_agent, expert):
        with pytest.raises(DispatchError) as refused:
            message_send(recipient=agent, content="hello", sender_user=owner)
        assert refused.value.code == "CONFLICT"
    assert not AgentMessage.objects.exists()


@pytest.mark.parametrize("content", ["", "   ", None, 42, "a\x00b", "\ud800", "x" * 200_001])
def test_bad_content_is_refused_and_nothing_is_stored(owner: Any, make_agent: Any, content: Any) -> None:
    agent = make_agent(owner)
    with pytest.raises(InvalidRequest):
        message_send(recipient=agent, content=content, sender_user=owner)
    assert not AgentMessage.objects.exists() and not Run.objects.exists()


def test_another_users_agent_is_not_found_and_an_archived_one_is_a_conflict(
    owner: Any, outsider: Any, make_agent: Any
) -> None:
    theirs = make_agent(outsider)
    with pytest.raises(NotFound):
        message_send(recipient=theirs, content="hi", sender_user=owner)
    with pytest.raises(NotFound):
        message_send(recipient=theirs, content="hi", sender_agent=make_agent(owner))
    archived = force_status(make_agent(owner), Agent.Status.ARCHIVED)
    with pytest.raises(DispatchError, match="is archived") as refused:
        message_send(recipient=archived, content="hi", sender_user=owner)
    assert refused.value.code == "CONFLICT"
    assert not AgentMessage.objects.exists()


def test_exactly_one_sender(owner: Any, make_agent: Any) -> None:
    agent = make_agent(owner)
    with pytest.raises(InvalidRequest, match="exactly one sender"):
        message_send(recipient=agent, content="hi")
    with pytest.raises(InvalidRequest, match="exactly one sender"):
        message_send(recipient=agent, content="hi", sender_user=owner, sender_agent=agent)


def test_message_get_is_scoped_and_tolerates_garbage_ids(owner: Any, outsider: Any, make_agent: Any) -> None:
    message = message_send(recipient=make_agent(owner), content="hi", sender_user=owner)
    assert message_get(user=owner, message_id=message.pk) == message
    assert message_get(user=owner, message_id=str(message.pk)) == message
    for bad in (message.pk + 1000, "abc", None, -1, 0, "99999999999999999999999", 2**63):
        with pytest.raises(NotFound):
            message_get(user=owner, message_id=bad)
    with pytest.raises(NotFound):
        message_get(user=outsider, message_id=message.pk)
