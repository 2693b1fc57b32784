"""What each agent tool does (docs/agents.md#agent-tools), synchronous: ``agents.tools`` defines
the tools — names, schemas, descriptions — and runs these through ``database_sync_to_async``
(a CLI launch, ``launch``, on a thread of its own: it blocks on tmux).

A target of ``send`` is an agent id, a unique running agent's name or, for an agent on a
linked instance, ``<label or instance id>:<agent id>`` (``peers``: this module is part of
the tools, an edge, docs/architecture.md#the-layers).
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User

from agents import approval_selectors, approvals, selectors, services, trust
from agents.lifecycle import agent_launch_any, agent_message_send
from agents.messages import CLI_ACCEPTING, message_get
from agents.models import Agent
from agents.serializers import agent_data, event_data
from core.errors import DispatchError, InvalidRequest, NotFound
from core.tools import cap
from peers.models import Peer
from peers.remote_launch import peer_address_parse
from peers.selectors import outbox_delivery_for, peers_for
from peers.services.outgoing import peer_message_send

AGENT_HISTORY_BUDGET = 20_000  # characters of JSON in one get_agent_history answer
HISTORY_TEXT_MAX = 4_000  # characters of one run's instruction or output
EVENT_TEXT_MAX = 1_000  # characters of one event's message
CANDIDATES_SHOWN = 20
APPROVALS_LISTED = 50


def agents_list(user: User) -> list[dict[str, Any]]:
    """``user``'s non-archived agents, newest first (the first 100)."""
    return [
        {
            "id": agent.pk,
            "name": agent.name,
            "type": agent.type,
            "status": agent.status,
            "latest_event": (
                {
                    "type": agent.latest_event_type,
                    "message": cap(agent.latest_event_message, EVENT_TEXT_MAX),
                    "at": agent.latest_event_at.isoformat(),
                }
                if agent.latest_event_at is not None
                else None
            ),
            "parent": agent.parent_id,
            # Shadow agents: the linked instance's label and the agent's id there (the
            # address for dispatch_send_message is "<peer>:<peer_agent_id>").
            **(
                {"peer": agent.peer.label, "peer_agent_id": agent.peer_agent_id, "stale": agent.stale}
                if agent.peer
                else {}
            ),
        }
        for agent in selectors.agents_for(user=user).items
    ]


def agent_history(user: User, agent_id: str, limit: int) -> dict[str, Any]:
    """Runs and events of ``user``'s agent ``agent_id``, newest first, within the budget."""
    agent = selectors.agent_get_for(user=user, agent_id=agent_id)
    budget = AGENT_HISTORY_BUDGET
    runs: list[dict[str, Any]] = []
    cut = False
    for run in selectors.runs_page(agent=agent).items[:limit]:
        entry = {
            "id": run.pk,
            "status": run.status,
            "instruction": cap(str(run.input.get("instruction", "")), HISTORY_TEXT_MAX),
            "output": cap(run.output or run.error, HISTORY_TEXT_MAX),
            "created_at": run.created_at.isoformat(),
        }
        budget -= len(json.dumps(entry))
        if budget < 0:
            cut = True
            break
        runs.append(entry)
    events: list[dict[str, Any]] = []
    for event in selectors.events_page(agent=agent, limit=limit).items:
        item = {
            "type": event.type,
            "message": cap(event.message, EVENT_TEXT_MAX),
            "created_at": event.created_at.isoformat(),
        }
        budget -= len(json.dumps(item))
        if budget < 0:
            cut = True
            break
        events.append(item)
    return {
        "agent": {"id": agent.pk, "name": agent.name, "type": agent.type, "status": agent.status},
        "runs": runs,
        "events": events,
        "truncated": cut,
    }


def _resolve_target(user: User, target: str) -> Agent | tuple[Peer, str]:
    """The recipient named by ``target`` (``dispatch_send_message``, docs/agents.md#agent-tools).

    An id of one of ``user``'s agents (a shadow agent included); else
    ``<label or instance id>:<agent id>`` — recognised by shape: a label or instance id of
    one of ``user``'s live peers, a colon, ``agt_`` + 12 hex — as ``(peer, agent id
    there)``; else a unique name among ``user``'s running agents ("fix: sse race" is a
    name). Raises ``NotFound`` (unknown id or name; the message lists the
    running agents), ``InvalidRequest`` (an ambiguous name or location, listing the
    candidates; a peer address whose linked instance is unknown).
    """
    if selectors.AGENT_ID.match(target):
        agent = Agent.objects.filter(owner=user, pk=target).exclude(status=Agent.Status.ARCHIVED).first()
        if agent is None:
            raise NotFound(f"no agent '{target}'")
        return agent
    address = peer_address_parse(user=user, target=target)
    if address is not None:
        return address
    running = Agent.objects.filter(owner=user, status__in=CLI_ACCEPTING)
    named = list(running.filter(name=target.strip()).order_by("-created_at")[:CANDIDATES_SHOWN])
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        listed = ", ".join(agent.pk for agent in named)
        raise InvalidRequest(
            f"{len(named)} running agents are named '{cap(target, 100)}' ({listed}): send to one of them by id",
            {"candidates": [{"id": agent.pk, "name": agent.name, "type": agent.type} for agent in named]},
        )
    if selectors.PEER_ADDRESS.match(target.strip()):
        labels = ", ".join(peer.label for peer in peers_for(user=user)) or "none"
        raise InvalidRequest(
            f"'{cap(target, 100)}' names an agent on a linked instance you do not have; your linked instances: {labels}"
        )
    candidates = list(running.order_by("-created_at")[:CANDIDATES_SHOWN])
    listed = ", ".join(f"{agent.name} ({agent.pk})" for agent in candidates) or "none"
    raise NotFound(
        f"no running agent with the id or name '{cap(target, 100)}'; running agents: {listed}",
        {"candidates": [{"id": agent.pk, "name": agent.name, "type": agent.type} for agent in candidates]},
    )


def send(user: User, caller: Agent | None, target: str, content: str) -> dict[str, Any]:
    resolved = _resolve_target(user, target)
    if isinstance(resolved, tuple) or selectors.is_shadow(resolved):
        # An agent on a peer: through the outbox (docs/peers.md#the-outbox); queued until the peer answers.
        if isinstance(resolved, tuple):
            peer, remote_id = resolved
            message = peer_message_send(
                user=user, sender_agent=caller, peer=peer, to_agent_id=remote_id, content=content
            )
            label = peer.label
        else:
            label, remote_id = selectors.shadow_link_for_message(resolved).label, resolved.peer_agent_id
            message = agent_message_send(user=user, recipient=resolved, content=content, sender_agent=caller)
        return {
            "message_id": message.pk,
            "status": message.status,
            "recipient": message.recipient_agent_id,
            "peer": label,
            "remote_agent_id": remote_id,
        }
    recipient = resolved
    if caller is not None and recipient.pk == caller.pk:
        raise InvalidRequest("an agent cannot send a message to itself")
    message = agent_message_send(user=user, recipient=recipient, content=content, sender_agent=caller)
    return {"message_id": message.pk, "status": message.status, "recipient": recipient.pk}


def status(user: User, message_id: Any) -> dict[str, Any]:
    message = message_get(user=user, message_id=message_id)
    answer = {
        "message_id": message.pk,
        "status": message.status,
        "error": message.error or None,
        "delivered_at": message.delivered_at.isoformat() if message.delivered_at else None,
    }
    delivery = outbox_delivery_for(message=message)  # sent to an agent on a peer
    if delivery is not None:
        answer.update(delivery)
    return answer


def record(agent: Agent, type: str, message: str) -> dict[str, Any]:
    current = Agent.objects.select_related("owner").get(pk=agent.pk)
    event = services.agent_event_record(agent=current, type=type, message=message)
    if event is None:  # only mirrored events are ever deduplicated
        raise DispatchError("CONFLICT", "the event was not recorded")
    return event_data(event)


def launch(user: User, caller: Agent | None, arguments: dict[str, Any], type: str) -> dict[str, Any]:
    child = bool(arguments.get("child", True))
    launcher = Agent.objects.get(pk=caller.pk) if caller is not None else None
    try:
        agent = agent_launch_any(
            owner=user,
            type=type,
            name=arguments["name"],
            prompt=arguments.get("prompt", ""),
            cwd=arguments.get("cwd") or None,
            launched_by=launcher,
            child=child and launcher is not None,
            full_access=bool(arguments.get("full_access", False)),
        )
    except trust.FolderNotTrusted as refused:
        # The tool has no trust_folder: a model must not trust a folder, so the refusal
        # says who can (docs/agents.md#folder-trust).
        spec = settings.AGENT_TYPES.get(type)
        family = spec.hooks if spec is not None and spec.hooks else type
        raise trust.refusal(family=family, path=refused.details["path"], type=type, person=False) from None
    return agent_data(agent)


def _approval_brief(approval: Any) -> dict[str, Any]:
    """An approval as a model reads it: what is asked, by which agent, and its answer."""
    return {
        "approval_id": approval.pk,
        "agent_id": approval.agent_id,
        "agent_name": approval.agent.name,
        "tool_name": approval.tool_name,
        "tool_summary": cap(approval.tool_summary, EVENT_TEXT_MAX),
        "status": approval.status,
        "decision": approval.decision or None,
        "answered_by": approval.answered_by or None,
        "message": approval.message or None,
        "asked_at": approval.asked_at.isoformat(),
        "expires_at": approval.expires_at.isoformat(),
    }


def approvals_list(user: User, caller: Agent | None, status: str, agent_id: str | None) -> dict[str, Any]:
    agent = selectors.agent_get_for(user=user, agent_id=agent_id) if agent_id else None
    approvals.approvals_expire_due()
    rows = approval_selectors.approvals_for(
        user=user, status=None if status == "all" else status, agent=agent, exclude_agent=caller
    )
    return {"approvals": [_approval_brief(approval) for approval in rows[:APPROVALS_LISTED]]}


def approval_answer(user: User, caller: Agent | None, arguments: dict[str, Any]) -> dict[str, Any]:
    answered = approvals.approval_answer(
        approval_id=arguments["approval_id"],
        decision=arguments["decision"],
        message=arguments.get("message", ""),
        user=user if caller is None else None,
        by_agent=Agent.objects.get(pk=caller.pk) if caller is not None else None,
    )
    return _approval_brief(answered)
