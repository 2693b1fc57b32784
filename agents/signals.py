"""Django signals the agents app sends for whoever must hear about an agent's life.

Each is sent once the transaction that made the change has committed (never for a change
that rolled back), synchronously in the committing thread: a receiver must be quick and
must not raise (Django's ``send_robust`` is used, so a failing receiver is logged and the
others still run). The ``attention`` app (notifications) connects to them in its
``AppConfig.ready``; agents import nothing of it (docs/architecture.md).

- ``agent_event_recorded(sender=AgentEvent, event=AgentEvent)``: an event was appended to
  an agent's timeline (``agents.services.agent_event_record``), mirrored events included
  (``event.mirrored``).
- ``agent_status_changed(sender=Agent, agent=Agent, previous=str, status=str)``: an
  agent's ``status`` moved (``agents.services.agent_set_status``); ``previous`` and
  ``status`` are ``Agent.Status`` values.
- ``approval_requested(sender=Approval, approval=Approval)``: an agent's CLI asked a
  person (or a policy) for permission and a pending approval was recorded.
- ``approval_answered(sender=Approval, approval=Approval)``: a pending approval got its
  answer (a person, a policy, a supervising agent, or its timeout).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.dispatch import Signal

logger = logging.getLogger(__name__)

agent_event_recorded = Signal()
agent_status_changed = Signal()
approval_requested = Signal()
approval_answered = Signal()


def send_on_commit(signal: Signal, sender: Any, **named: Any) -> None:
    """Send ``signal`` with ``named`` once the current transaction commits (at once outside
    one); a receiver that raises is logged, never propagated."""

    def send() -> None:
        for receiver, result in signal.send_robust(sender, **named):
            if isinstance(result, Exception):
                logger.warning("agents signal receiver %r failed: %s", receiver, result)

    transaction.on_commit(send)
