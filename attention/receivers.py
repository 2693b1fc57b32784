"""What turns an agent's life into notifications: receivers of ``agents.signals``
(connected in ``AttentionConfig.ready``; docs/notifications.md#events).

- an approval waiting: ``approval_requested`` with a ``pending`` approval (one a policy
  answered at once notifies no one), or a shadow agent's mirrored ``blocked`` event of an
  approval request (it waits on the linked instance; linked to the Approvals page);
- an agent finished: a CLI agent's turn ended (an ``agent_event_recorded`` of type
  ``done``, its ``Stop`` hook), a built-in agent's run answered (the ``answer`` event of its
  run), or the agent went ``stopped``;
- an agent failed: it went ``error``, or a built-in agent's run failed (its ``run failed``
  event, a lost worker's ``run … failed`` event).

Each receiver only writes rows (``services.notify``): delivery happens in the background
worker, never on the hook's or the request's path. Signals are sent after commit and
robustly (a receiver that raises is logged by ``agents.signals``). A shadow agent
(mirrored from a linked instance) is its local owner's agent like any other: its mirrored
``done`` events notify too, unless the mirror replays old history (events older than
``MIRROR_FRESH``).
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.urls import reverse
from django.utils import timezone

from agents.approvals import APPROVAL_REQUESTED
from agents.models import Agent, AgentEvent
from attention import services
from attention.models import Notification

# A mirrored event older than this is history the mirror caught up on, not news.
MIRROR_FRESH = timedelta(minutes=10)
SUMMARY_CHARS = 160
_LOST_RUN = re.compile(r"^run \S+ failed: ")


def agent_url(agent_id: str) -> str:
    """The absolute URL of an agent's page (``DISPATCH_PUBLIC_URL`` + ``/agents/<id>/``)."""
    return settings.PUBLIC_URL + reverse("agent", args=[agent_id])


def approval_url(approval_id: str) -> str:
    """The absolute URL of one approval's page (``/approvals/<id>/``), where it is
    answered after a login."""
    return settings.PUBLIC_URL + reverse("approval", args=[approval_id])


def approvals_url() -> str:
    """The absolute URL of the Approvals page (``/approvals/``), which lists the approvals
    waiting on linked instances too."""
    return settings.PUBLIC_URL + reverse("approvals")


def _short(text: Any, limit: int = SUMMARY_CHARS) -> str:
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _agent_label(agent: Agent) -> str:
    return f"{agent.name} ({agent.peer.label})" if agent.peer_id and agent.peer else agent.name


def on_approval_requested(sender: Any, approval: Any, **named: Any) -> None:
    """A pending approval: "<agent> asks to use <tool>", the tool and its summary (the
    command, file or URL), linking to the approval's page."""
    if getattr(approval, "status", "") != "pending":
        return
    agent: Agent = approval.agent
    tool = approval.tool_name or "a tool"
    summary = _short(approval.tool_summary)
    services.notify(
        user=agent.owner,
        kind=Notification.Kind.APPROVAL,
        title=f"{_agent_label(agent)} asks to use {tool}",
        body=f"{tool}: {summary}" if summary else tool,
        url=approval_url(approval.pk),
        agent_id=agent.pk,
        approval_id=approval.pk,
        dedupe_key=f"approval:{approval.pk}",
    )


def _event_outcome(event: AgentEvent) -> tuple[str, str, str] | None:
    """``(kind, title suffix, body)`` for an event that finishes or fails a turn or run, or
    a shadow agent's mirrored approval request (its linked instance asks a person)."""
    metadata = event.metadata if isinstance(event.metadata, dict) else {}
    if event.mirrored and event.type == AgentEvent.Type.BLOCKED and event.message.startswith(APPROVAL_REQUESTED):
        asked = event.message.removeprefix(APPROVAL_REQUESTED)
        return Notification.Kind.APPROVAL, "asks for approval on its instance", _short(asked, 300)
    if event.type == AgentEvent.Type.DONE:
        said = metadata.get("last_assistant_message") or event.message
        return Notification.Kind.FINISHED, "finished its turn", _short(said, 300)
    if event.type != AgentEvent.Type.SYSTEM or event.run_id is None:
        return None
    if event.message == "answer" and "answer" in metadata:
        return Notification.Kind.FINISHED, "finished its run", _short(metadata.get("answer"), 300)
    if event.message.startswith("run failed:") or _LOST_RUN.match(event.message):
        return Notification.Kind.FAILED, "failed", _short(metadata.get("error") or event.message, 300)
    return None


def on_agent_event_recorded(sender: Any, event: AgentEvent, **named: Any) -> None:
    """A turn or run that finished or failed (see the module's list)."""
    outcome = _event_outcome(event)
    if outcome is None:
        return
    if event.mirrored and event.created_at < timezone.now() - MIRROR_FRESH:
        return
    kind, what, body = outcome
    agent = Agent.objects.select_related("owner", "peer").get(pk=event.agent_id)
    services.notify(
        user=agent.owner,
        kind=kind,
        title=f"{_agent_label(agent)} {what}",
        body=body,
        # A linked instance's approval is answered from the Approvals page's linked list.
        url=approvals_url() if kind == Notification.Kind.APPROVAL else agent_url(agent.pk),
        agent_id=agent.pk,
        dedupe_key=f"event:{event.pk}",
    )


def on_agent_status_changed(sender: Any, agent: Agent, previous: str, status: str, **named: Any) -> None:
    """An agent that went ``stopped`` (finished) or ``error`` (failed, with its last error)."""
    if status == Agent.Status.STOPPED:
        kind, title, body = Notification.Kind.FINISHED, f"{_agent_label(agent)} stopped", f"was {previous}"
    elif status == Agent.Status.ERROR:
        kind, title = Notification.Kind.FAILED, f"{_agent_label(agent)} failed"
        body = _short(agent.last_error, 300) or f"was {previous}"
    else:
        return
    services.notify(
        user=agent.owner,
        kind=kind,
        title=title,
        body=body,
        url=agent_url(agent.pk),
        agent_id=agent.pk,
        dedupe_key=f"status:{agent.pk}:{status}:{agent.updated_at.isoformat()}",
    )
