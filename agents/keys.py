"""The keys fallback: the owner presses a few keys in a CLI agent's pane (docs/agents.md#keys).

A dialog no hook reports (a CLI's own menu, a question it asks before its hooks run)
leaves a person with nothing to answer it from but ``tmux attach``. From the agent page
(or ``POST /api/v1/agents/{id}/keys``) the agent's owner can instead press one of a fixed
set of keys — ``KEYS_ALLOWED`` — which reach the pane as tmux key *names*
(``send-keys Down Enter``): never literal text, never a shell string. The pane must be
alive at the instant tmux writes (``TmuxRunner.send_keys`` guards the write with one
``if-shell -F``; a write into a dead ``remain-on-exit`` pane crashes tmux 3.3a).

Every press is on the agent's timeline: a ``system`` event "keys sent by alice: Down
Enter" with ``metadata = {"keys": [...], "by": "alice"}``, recorded as a side note
(``latest=False``: it does not hide what the agent last reported).

Shadow agents are refused: their pane is on the linked instance, and the peer API has no
route to press keys there (a person opens the agent's page on that instance).
"""

from __future__ import annotations

import logging
from typing import Any

from django.contrib.auth.models import User

from agents import cli, services
from agents.models import Agent, AgentEvent
from agents.selectors import is_shadow
from agents.tmux import TmuxError, TmuxPaneDead, TmuxRunner, TmuxSessionNotFound
from core.errors import DispatchError, InvalidRequest

logger = logging.getLogger(__name__)

# The keys a person may press, as the page and the API name them → the tmux key name sent.
KEYS_ALLOWED: dict[str, str] = {
    "Up": "Up",
    "Down": "Down",
    "Enter": "Enter",
    "Esc": "Escape",
    "Tab": "Tab",
    "y": "y",
    "n": "n",
    "C-c": "C-c",
}
# Presses in one request: enough for "Down Down Down Enter", too few to type a command.
KEYS_MAX = 8
# Statuses in which a pane may be waiting on a dialog.
_PRESSABLE = frozenset({Agent.Status.CREATING, Agent.Status.RUNNING})


def keys_validate(keys: Any) -> list[str]:
    """``keys`` as a list of names from ``KEYS_ALLOWED`` (1 to ``KEYS_MAX`` of them).

    Raises ``InvalidRequest`` (400) naming the allowed keys for anything else: not a list,
    empty, too long, or one entry that is not exactly an allowed name (``"ls\\n"``,
    ``"Escape"``, ``"C-d"``, a number).
    """
    allowed = ", ".join(KEYS_ALLOWED)
    if not isinstance(keys, list) or not keys or len(keys) > KEYS_MAX:
        raise InvalidRequest(
            f"keys must be a list of 1 to {KEYS_MAX} key names among: {allowed}",
            {"allowed": list(KEYS_ALLOWED)},
        )
    for key in keys:
        if not isinstance(key, str) or key not in KEYS_ALLOWED:
            shown = key[:20] if isinstance(key, str) else type(key).__name__
            raise InvalidRequest(
                f"key {shown!r} is not allowed; allowed keys: {allowed}",
                {"allowed": list(KEYS_ALLOWED), "key": shown},
            )
    return list(keys)


def agent_keys_send(*, user: User, agent: Agent, keys: Any, runner: TmuxRunner | None = None) -> AgentEvent:
    """Press ``keys`` (names of ``KEYS_ALLOWED``) in ``agent``'s pane for its owner ``user``
    and record it on the timeline; returns the ``system`` event recorded.

    ``agent`` must be ``user``'s (the caller looks it up with ``agent_get_for``; this
    checks again). Raises ``InvalidRequest`` (400) for a bad key list, an expert agent
    or a shadow agent;
    ``DispatchError("PERMISSION_DENIED")`` (403) when ``user`` is not the owner;
    ``DispatchError("CONFLICT")`` (409) when the agent is not running, runs on another
    host (its pane is only reachable there), or its pane is gone or dead (nothing sent).
    Blocks on one tmux command: call it from a sync view, never on the event loop.
    """
    names = keys_validate(keys)
    if agent.owner_id != user.pk:
        raise DispatchError("PERMISSION_DENIED", "only the agent's owner can press keys in its pane")
    if is_shadow(agent):
        raise InvalidRequest(
            f"agent '{agent.pk}' runs on a linked instance: its pane is there, so press keys from its page on "
            "that instance"
        )
    if agent.type == services.EXPERT:
        raise InvalidRequest(f"agent '{agent.pk}' is an expert agent: it has no pane to press keys in")
    current = Agent.objects.get(pk=agent.pk)
    if current.status not in _PRESSABLE:
        raise DispatchError(
            "CONFLICT", f"agent '{agent.pk}' is {current.status}: keys need it running", {"status": current.status}
        )
    if not cli.is_local(current):
        raise DispatchError(
            "CONFLICT",
            f"agent '{agent.pk}' runs on host '{current.host}': its pane is only reachable there",
            {"host": current.host},
        )
    try:
        cli.tmux_runner(runner).send_keys(cli.session_name(current), [KEYS_ALLOWED[name] for name in names])
    except (TmuxSessionNotFound, TmuxPaneDead):
        raise DispatchError(
            "CONFLICT", f"agent '{agent.pk}' has no live pane (its program has exited): nothing was sent"
        ) from None
    except TmuxError as error:
        logger.warning("could not press keys in agent %s's pane: %s", agent.pk, error)
        raise DispatchError("CONFLICT", f"tmux could not press the keys: {error}") from None
    who = user.get_username()
    event = services.agent_event_record(
        agent=current,
        type=AgentEvent.Type.SYSTEM,
        message=f"keys sent by {who}: {' '.join(names)}",
        metadata={"keys": names, "by": who},
        latest=False,
    )
    assert event is not None  # a local event is never deduplicated
    return event
