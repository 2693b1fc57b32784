"""The agent lifecycle: one entry per action, for every edge (docs/agents.md).

``agent_launch_any``, ``agent_start_any``, ``agent_stop_any``, ``agent_archive_any``,
``agent_prompt_any`` and ``agent_message_send`` are what REST (``agents.api``), the pages
(``agents.views``), the admin, the agent tools (and through them MCP and the expert
agent) and the peer API (``peers.services``) call. Each decides by the kind of agent who
does the work:

- an **expert** agent has no process: rows only (``agents.services``);
- a **CLI** agent's tmux session is ``agents.cli``'s (its messages are pasted by the
  supervisor, ``agents.supervisor``);
- a **shadow** agent (``selectors.is_shadow``) lives on a linked instance: the action goes
  to its peer through ``agents.hooks.linked()``, registered by ``peers``.

This module sits above ``agents.services`` (the rows: statuses, events, runs), ``cli``,
``messages``, ``launching`` and ``prompting``, which is why the lifecycle is not in
``agents.services`` itself: ``cli`` and ``messages`` write through ``services``, so
``services`` calling them back would be an import circle. A launch "at a location" is the
edge's (``peers.remote_launch.launch_at_location``, async): it waits on a peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asgiref.sync import async_to_sync
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction

from agents import cli, messages, selectors, services
from agents.hooks import linked
from agents.launching import available_types, launchable_types
from agents.models import Agent, AgentMessage, Run
from agents.prompting import agent_prompt_for, prompt_options_check
from agents.tokens import agent_scope_launch
from core.errors import InvalidRequest

# --- launch ---------------------------------------------------------------------------------


def agent_launch_any(
    *,
    owner: User,
    type: str,
    name: str,
    prompt: str = "",
    cwd: str | None = None,
    launched_by: Agent | None = None,
    child: bool = False,
    full_access: bool = False,
    launched_by_peer: dict[str, Any] | None = None,
    trust_folder: bool = False,
) -> Agent:
    """Launch a local agent of ``type`` and return it (201 material; docs/agents.md#launch-start-stop-archive).

    ``cwd`` defaults to the launching agent's cwd, else ``DISPATCH_DEFAULT_CWD``.
    ``child`` makes ``launched_by`` the parent (``launched_by`` is recorded either way).
    An expert agent is created ``running`` and ``prompt`` (if any) queued as its first
    run; a CLI agent is started in tmux with ``prompt`` as its first message
    (``cli.agent_launch``). ``type`` is what the caller named: a launch without one
    resolves it first (``launching.launch_type_resolve``). Raises ``InvalidRequest`` for
    an unknown type or one whose program is not on PATH (details: the types that work
    here, ``launching.available_types``), a bad name or cwd;
    ``PERMISSION_DENIED`` for a full-access launch by an agent that is not full-access.
    ``launched_by_peer`` (``{instance_id, agent_id | null, name}``) marks an agent a peer
    launched (docs/peers.md#using-a-link): a ``shell`` agent then gets ``DISPATCH_LAUNCH_CONTEXT``.
    A Claude Code or codex type launches only in a trusted folder (``FOLDER_NOT_TRUSTED``
    otherwise); ``trust_folder`` trusts it first, for a person only
    (docs/agents.md#folder-trust; ``cli.agent_launch``); types that need no trust ignore it.
    """
    types = launchable_types()
    if type not in types:
        raise InvalidRequest(
            f"unknown agent type '{type}'; known types: {', '.join(types)}", {"available_types": available_types()}
        )
    if not types[type]:
        raise InvalidRequest(
            f"agent type '{type}' is unavailable here: its program is not on PATH",
            {"available_types": available_types()},
        )
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be a string")
    agent_scope_launch(launched_by, full_access=full_access)
    where = cwd if cwd else (launched_by.cwd if launched_by is not None else settings.DEFAULT_CWD)
    parent = launched_by if child else None
    if type != services.EXPERT:
        # Not in a transaction: the tmux session outlives the request either way.
        return cli.agent_launch(
            owner=owner,
            type=type,
            name=name,
            prompt=prompt,
            cwd=where,
            parent=parent,
            launched_by=launched_by,
            full_access=full_access,
            launched_by_peer=launched_by_peer,
            trust_folder=trust_folder,
        )
    with transaction.atomic():
        agent = services.agent_create(
            owner=owner,
            type=type,
            name=name,
            cwd=where,
            parent=parent,
            launched_by=launched_by,
            full_access=full_access,
            launched_by_peer=launched_by_peer,
        )
        if prompt.strip():
            services.run_enqueue(agent=agent, instruction=prompt)
    return agent


# --- stop, start, archive ---------------------------------------------------------------------


def _forward_shadow(agent: Agent, action: str) -> Agent:
    """Forward ``action`` (stop, start, archive) of the shadow ``agent`` to its peer
    (``linked().forward``; docs/peers.md#shadow-agents). Sync callers only (a request's thread, the
    admin): it waits for the peer (30 s at most) through ``async_to_sync``."""
    return async_to_sync(linked().forward)(agent=agent, action=action)


def agent_stop_any(*, agent: Agent) -> Agent:
    """Stop any agent (docs/agents.md#how-stop-works) and return it.

    CLI agent: ``cli.agent_stop`` (``stopping`` now; the supervisor finishes the stop).
    Expert agent: its queued and running runs are cancelled and it goes ``stopped`` (a
    stopped expert agent refuses prompts). Raises ``DispatchError("CONFLICT")`` when the
    transition table refuses the stop (e.g. already stopped). A shadow agent's stop is
    forwarded to its peer (``_forward_shadow``; the peer's refusals as ``DispatchError``).
    """
    if selectors.is_shadow(agent):
        return _forward_shadow(agent, "stop")
    if agent.type != services.EXPERT:
        return cli.agent_stop(agent=agent)
    with transaction.atomic():
        stopped = services.agent_set_status(agent=agent, status=Agent.Status.STOPPED, note="stopped by its user")
        for run_id in Run.objects.filter(agent=agent, status__in=[Run.Status.QUEUED, Run.Status.RUNNING]).values_list(
            "pk", flat=True
        ):
            services.run_cancel(user=agent.owner, run_id=run_id)
    return stopped


def agent_start_any(*, agent: Agent) -> Agent:
    """Start a ``stopped`` or ``error`` agent again and return it.

    CLI agent: ``cli.agent_start`` (same tmux session name). Expert agent: ``stopped`` →
    ``creating`` → ``running`` (it has no process). Raises ``DispatchError("CONFLICT")``
    from any other status. A shadow agent: ``UNSUPPORTED_OPERATION`` (the peer API has no
    start, docs/peers.md#shadow-agents; ``_forward_shadow``).
    """
    if selectors.is_shadow(agent):
        return _forward_shadow(agent, "start")
    if agent.type != services.EXPERT:
        return cli.agent_start(agent=agent)
    with transaction.atomic():
        services.agent_set_status(agent=agent, status=Agent.Status.CREATING, note="start requested")
        return services.agent_set_status(agent=agent, status=Agent.Status.RUNNING, note="started")


def agent_archive_any(*, agent: Agent) -> Agent:
    """Archive any agent (soft delete; idempotent) and return it.

    CLI agent: ``cli.agent_archive`` (stops its session first). Expert agent:
    ``services.agent_archive`` (cancels its runs). A shadow agent's archive is forwarded to
    its peer, and the shadow archived once the peer accepted (``_forward_shadow``).
    """
    if selectors.is_shadow(agent):
        return _forward_shadow(agent, "archive")
    if agent.type != services.EXPERT:
        return cli.agent_archive(agent=agent)
    return services.agent_archive(agent=agent, note="archived by its user")


# --- prompt and message -------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptAccepted:
    """What a prompt became: a run (expert agent) or a message (CLI agent), never both."""

    agent_id: str
    run_id: str | None = None
    message_id: int | None = None


def agent_prompt_any(
    *,
    user: User,
    agent_id: Any,
    instruction: Any,
    input: Any = None,
    options: Any = None,
    sender_agent: Agent | None = None,
) -> PromptAccepted:
    """Prompt any local agent of ``user`` as the edges receive it (docs/agents.md#prompts-and-runs).

    An expert agent gets a run (``prompting.agent_prompt_for``; ``run_id`` set). A CLI
    agent gets the instruction as a message (``messages.message_send``; ``message_id`` set)
    from ``sender_agent`` when an agent's token made the call, else from ``user``; its
    options are checked for shape and otherwise unused (CLI agents reach remotes through
    MCP), and ``input`` must be absent or null. Raises ``NotFound`` ("no agent 'x'",
    another user's agent), ``InvalidRequest`` (bad instruction/options/input) and
    ``CONFLICT`` (the agent is not running).
    """
    agent = selectors.agent_get_for(user=user, agent_id=agent_id)
    if agent.type == services.EXPERT:
        run = agent_prompt_for(user=user, agent_id=agent_id, instruction=instruction, input=input, options=options)
        return PromptAccepted(agent_id=run.agent_id, run_id=run.pk)
    if not isinstance(instruction, str) or not instruction.strip():
        raise InvalidRequest("instruction must be a non-empty string")
    prompt_options_check({} if options is None else options)
    if input is not None:
        raise InvalidRequest(f"agent '{agent.pk}' is a {agent.type} agent: its prompt is a message and takes no input")
    message = messages.message_send(
        recipient=agent,
        content=instruction,
        sender_user=None if sender_agent is not None else user,
        sender_agent=sender_agent,
    )
    return PromptAccepted(agent_id=agent.pk, message_id=message.pk)


def agent_message_send(
    *, user: User, recipient: Agent, content: str, sender_agent: Agent | None = None
) -> AgentMessage:
    """Send ``content`` to ``recipient``, one of ``user``'s agents, from ``sender_agent``
    (an agent calling with its token) or else from ``user`` (docs/agents.md#messages-and-their-status).

    Local agent: ``messages.message_send`` (an expert agent gets a run and the message is
    ``delivered``; a CLI agent's is ``queued`` for the supervisor). Shadow agent: through
    its live link's outbox (``linked().message_send``; ``queued`` until the peer answers,
    docs/peers.md#the-outbox). Raises ``InvalidRequest`` (bad content; a shadow whose link was
    removed, ``selectors.shadow_link_for_message``), ``NotFound`` and ``CONFLICT`` (the
    recipient is archived or not running) as ``message_send``.
    """
    if selectors.is_shadow(recipient):
        link = selectors.shadow_link_for_message(recipient)
        return linked().message_send(
            user=user, sender_agent=sender_agent, link=link, to_agent_id=recipient.peer_agent_id, content=content
        )
    return messages.message_send(
        recipient=recipient,
        content=content,
        sender_user=None if sender_agent is not None else user,
        sender_agent=sender_agent,
    )
