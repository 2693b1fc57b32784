"""The Agents pages: the list with a launch form, and one agent's page.

Live parts follow the one server-sent-event stream of the tab (``/api/v1/events``): a
small script (``static/js/live.js``) listens and asks htmx to re-fetch the affected
fragment; on a local CLI agent's page the same stream carries its pane (``?pane=<id>``).

Shadow agents (docs/peers.md#shadow-agents) are listed with the local ones, with their peer's
label as a badge; their page shows the **Remote activity** pane instead
of a terminal: the mirroring state, the mirrored timeline newest first (200 a page, older
pages through the ``before`` cursor of ``GET /api/v1/agents/<id>/events``) and a message
box whose messages go through the outbox.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator
from django.utils.timesince import timesince
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from agents import approval_pages, keys, launching, lifecycle, selectors, services
from agents.models import Agent, AgentEvent
from core.authentication import authenticated_user
from core.errors import DispatchError, InvalidRequest
from core.presence import HOSTNAME
from core.views import htmx_login_required
from peers.selectors import peers_by_label_for
from remotes.selectors import remotes_for

MESSAGES_SHOWN = 50
TIMELINE_SHOWN = 200  # the shadow page's "Showing the last 200"
NESTING_SHOWN = 6  # deeper sub-agents are indented no further
NOT_RUNNING = frozenset({Agent.Status.STOPPED, Agent.Status.ERROR, Agent.Status.ARCHIVED})


@dataclass(frozen=True)
class AgentRow:
    """One row of the agent list: the agent and how deep it is nested under its parents
    on this page (0 for a top-level agent, or a child whose parent is on another page)."""

    agent: Agent
    depth: int

    @property
    def indent(self) -> int:
        """The nesting shown, capped at ``NESTING_SHOWN`` levels."""
        return min(self.depth, NESTING_SHOWN)

    @property
    def html(self) -> SafeString:
        """The row's ``<tr>``, every value escaped.

        Written here, not in the template: the list shows 100 rows a page, and through the
        template engine each row's two dozen variables, tags and filters cost more than
        the rest of the page's work together (bench/README.md#agents-agentspy-b9)."""
        agent = self.agent
        classes = " ".join(
            name for name, on in (("shadow", agent.peer_agent_id), ("stale", agent.stale), ("nested", self.depth)) if on
        )
        name = f'<a href="{escape(reverse("agent", args=[agent.pk]))}">{escape(agent.name)}</a>'
        if self.depth:
            name = '<span class="nest" aria-hidden="true">↳</span> ' + name
        if agent.peer_agent_id:
            label = agent.peer.label if agent.peer else "unlinked peer"
            name += (
                f' <span class="badge peer-badge" title="a shadow of {escape(agent.peer_agent_id)}'
                f' on a linked instance">{escape(label)}</span>'
            )
        child = f' <small class="hint">child of {escape(agent.parent_id)}</small>' if agent.parent_id else ""
        stale = (
            ' <span class="badge stale-badge" title="the link to this agent\'s instance is down:'
            ' this is its last known state">stale</span>'
            if agent.stale
            else ""
        )
        latest = "—"
        if agent.latest_event_at:
            kind = agent.latest_event_type
            shown = "waiting for approval" if kind == "blocked" else kind
            message = Truncator(agent.latest_event_message).chars(80)
            latest = (
                f'<span class="event-{escape(kind)}">{escape(shown)}</span> {escape(message)}'
                f' <small class="hint">{escape(timesince(agent.latest_event_at))} ago</small>'
            )
        created = timezone.localtime(agent.created_at).strftime("%Y-%m-%d %H:%M")
        status = escape(agent.status)
        return mark_safe(  # noqa: S308 -- every value above went through escape()
            f'<tr data-agent="{escape(agent.pk)}" data-depth="{self.depth}" class="{classes}">\n'
            f'      <td style="--depth: {self.indent}"><span class="agent-name">{name}</span>{child}</td>\n'
            f'      <td data-label="Type">{escape(agent.type)}</td>\n'
            f'      <td data-label="Status"><span class="badge status-{status}">{status}</span>{stale}</td>\n'
            f'      <td data-label="Latest event">{latest}</td>\n'
            f'      <td data-label="Created">{created}</td>\n'
            "    </tr>"
        )


def nest_agents(agents: list[Agent]) -> list[AgentRow]:
    """``agents`` (one page, newest first) reordered so each sub-agent follows its parent,
    depth first (sub-agents nested under their parent, local and shadow).

    Agents whose parent is not on the page stay top-level in their place; siblings keep
    the page's order. Pure: no queries (the page's rows carry ``parent_id``).
    """
    on_page = {agent.pk for agent in agents}
    children: dict[str, list[Agent]] = {}
    roots: list[Agent] = []
    for agent in agents:
        if agent.parent_id and agent.parent_id in on_page and agent.parent_id != agent.pk:
            children.setdefault(agent.parent_id, []).append(agent)
        else:
            roots.append(agent)
    rows: list[AgentRow] = []
    placed: set[str] = set()

    def place(agent: Agent, depth: int) -> None:
        if agent.pk in placed:
            return
        placed.add(agent.pk)
        rows.append(AgentRow(agent=agent, depth=depth))
        for child in children.get(agent.pk, []):
            place(child, depth + 1)

    for root in roots:
        place(root, 0)
    for agent in agents:  # a parent cycle has no root: show its members top-level
        place(agent, 0)
    return rows


@dataclass(frozen=True)
class LaunchLocation:
    """One choice of the launch form's "location" select (docs/peers.md#labels):
    a live peer of the user, by label. ``refusal`` is why it cannot be chosen ("" if it can)."""

    label: str
    instance_id: str
    responding: bool
    refusal: str


def launch_locations(*, user: User, now: Any = None) -> list[LaunchLocation]:
    """The user's live peers as launch locations, by label (case-insensitive order).

    A peer is "not responding recently" unless ``Peer.responding()``; one it cannot launch
    on is disabled with ``Peer.launch_refusal()`` ("launching not permitted", "unlinked by
    the other side"). One query (``peers.selectors.peers_by_label_for``).
    """
    now = now or timezone.now()
    return [
        LaunchLocation(
            label=peer.label,
            instance_id=peer.instance_id,
            responding=peer.responding(now),
            refusal=peer.launch_refusal(),
        )
        for peer in peers_by_label_for(user=user)
    ]


def _list_context(request: HttpRequest) -> dict[str, object]:
    user = authenticated_user(request)
    page = selectors.agents_for(user=user, before=request.GET.get("before") or None)
    return {"agents": page.items, "rows": nest_agents(page.items), "next": page.next}


@require_http_methods(["GET", "POST"])
def agents_page(request: HttpRequest) -> HttpResponse:
    """``/``: the user's agents (live) and the "Launch agent" form: every type, one that does
    not work here disabled with why (``launching.agent_types_data``), the default type
    (``launching.default_launch_type``) chosen — none, and a "choose a type" prompt, when
    there is no default. A "trust this folder" checkbox names the working directory a
    claude/codex launch will trust (after a ``FOLDER_NOT_TRUSTED`` refusal, the exact
    folder refused; docs/agents.md#folder-trust)."""
    user = authenticated_user(request)
    form: dict[str, Any] = {
        "type": launching.default_launch_type() or "",
        "name": "",
        "prompt": "",
        "cwd": settings.DEFAULT_CWD,
        "location": "",
    }
    status = 200
    trust_path = ""
    if request.method == "POST":
        form = {key: request.POST.get(key, "").strip() for key in ("type", "name", "prompt", "cwd", "location")}
        form["full_access"] = request.POST.get("full_access") == "on"
        form["trust_folder"] = request.POST.get("trust_folder") == "on"
        try:
            if form["location"]:
                # A launch on a peer waits on that peer (up to 30 s): the form's script
                # sends it to POST /api/v1/agents instead of this synchronous view.
                raise InvalidRequest(
                    f"launching on '{form['location']}' is done by the page's script through POST /api/v1/agents;"
                    " enable JavaScript or use the API"
                )
            type = launching.launch_type_resolve(form["type"])
            agent = lifecycle.agent_launch_any(
                owner=user,
                type=type,
                name=form["name"],
                prompt=form["prompt"],
                cwd=form["cwd"] or None,
                full_access=form["full_access"] and type != services.EXPERT,
                trust_folder=form["trust_folder"],
            )
        except DispatchError as exc:
            messages.error(request, exc.message)
            status = 400
            if exc.code == "FOLDER_NOT_TRUSTED":  # the checkbox then names the exact folder
                trust_path = str(exc.details.get("path", ""))
        else:
            return redirect("agent", agent_id=agent.pk)
    types = launching.agent_types_data()
    context = {
        **_list_context(request),
        "form": form,
        "types": types,
        # Else "choose a type" stays selected: a browser would pick the first enabled option,
        # maybe a shell, for a prompt written for a model.
        "type_chosen": any(entry["available"] and entry["type"] == form["type"] for entry in types),
        "locations": launch_locations(user=user),
        "trust_path": trust_path,
    }
    return render(request, "agents/agents.html", context, status=status)


@htmx_login_required
@require_GET
def agents_fragment(request: HttpRequest) -> HttpResponse:
    """The agent list, re-fetched when the event stream reports a change."""
    return render(request, "agents/_agent_list.html", _list_context(request))


def has_local_pane(agent: Agent) -> bool:
    """Whether ``agent`` is a CLI agent whose tmux pane is on this host (its page shows it)."""
    return agent.type != services.EXPERT and not selectors.is_shadow(agent) and agent.host == HOSTNAME


@dataclass(frozen=True)
class MirrorState:
    """What the Remote activity pane says about a shadow agent's mirror:
    ``key`` is ``live``, ``stale`` or ``stopped`` (its CSS class), ``text`` the words shown."""

    key: str
    text: str


def mirror_state(agent: Agent) -> MirrorState:
    """The words of the shadow page's state line: "Link down — last known
    state" while the peer's stream is down (``stale``), else "Not running" for a stopped,
    failed or archived shadow, else "Mirroring live"."""
    if agent.stale:
        return MirrorState("stale", "Link down — last known state")
    if agent.status in NOT_RUNNING:
        return MirrorState("stopped", "Not running")
    return MirrorState("live", "Mirroring live")


def is_lost_contact(event: AgentEvent) -> bool:
    """Whether ``event`` is Dispatch's note that a peer's stream dropped (docs/peers.md#shadow-agents:
    a ``system`` event "lost contact with <peer>"), styled as such on the timeline."""
    return event.type == AgentEvent.Type.SYSTEM and event.message.lower().startswith("lost contact with")


def is_contact_restored(event: AgentEvent) -> bool:
    """Whether ``event`` is Dispatch's note that a peer's stream is back after a drop (the
    ``system`` event "contact restored with <peer>" that follows "lost contact"), styled
    as such on the timeline."""
    return event.type == AgentEvent.Type.SYSTEM and event.message.lower().startswith("contact restored with")


def _approvals_context(*, user: User, agent: Agent, is_shadow: bool) -> dict[str, object]:
    """The agent page's approval box and past decisions (docs/agents.md#approvals-on-the-pages);
    a shadow's approvals live on its instance (the Approvals page lists them)."""
    if is_shadow:
        return {"pending_approvals": [], "approval_decisions": []}
    pending, answered = approval_pages.agent_approval_cards(user=user, agent=agent)
    return {
        "pending_approvals": pending,
        "approval_decisions": answered,
        "approval_back": reverse("agent", kwargs={"agent_id": agent.pk}),
    }


def _agent_context(request: HttpRequest, agent_id: str) -> dict[str, object]:
    user = authenticated_user(request)
    agent = selectors.agent_get_for(user=user, agent_id=agent_id)
    is_shadow = selectors.is_shadow(agent)
    is_cli = agent.type != services.EXPERT and not is_shadow
    before = request.GET.get("before") or None
    events = selectors.events_page(agent=agent, limit=TIMELINE_SHOWN, before=before)
    return {
        "agent": agent,
        "is_cli": is_cli,
        "is_shadow": is_shadow,
        "peer_label": (agent.peer.label if agent.peer is not None else "") if is_shadow else "",
        "mirror": mirror_state(agent) if is_shadow else None,
        "local_pane": has_local_pane(agent),
        "events": events.items,
        "lost_contact": {event.pk for event in events.items if is_lost_contact(event)},
        "contact_restored": {event.pk for event in events.items if is_contact_restored(event)},
        "events_next": events.next,
        "before": before or "",
        "runs": selectors.runs_page(agent=agent).items if agent.type == services.EXPERT and not is_shadow else [],
        "agent_messages": selectors.messages_page(agent=agent, limit=MESSAGES_SHOWN).items,
        "keys_allowed": list(keys.KEYS_ALLOWED),
        **_approvals_context(user=user, agent=agent, is_shadow=is_shadow),
    }


@require_GET
def agent_page(request: HttpRequest, agent_id: str) -> HttpResponse:
    """``/agents/<id>/``: header, lifecycle buttons, the pane and message box (CLI agents),
    the prompt box with remotes to enable (expert agents) or the Remote activity pane with
    a message box (shadow agents), runs, messages and the timeline.

    ``?before=<cursor>`` shows an older page of the timeline (the ``next`` cursor of
    ``GET /api/v1/agents/<id>/events``); a bad cursor is 400. Another user's agent is 404.
    """
    try:
        context = _agent_context(request, agent_id)
    except InvalidRequest as exc:
        return render(request, "agents/missing.html", {"message": exc.message, "bad_request": True}, status=400)
    except DispatchError as exc:
        return render(request, "agents/missing.html", {"message": exc.message}, status=404)
    agent = context["agent"]
    assert isinstance(agent, Agent)
    if agent.type == services.EXPERT:
        context["remotes"] = list(remotes_for(user=authenticated_user(request)).values_list("name", flat=True))
    return render(request, "agents/agent.html", context)


@htmx_login_required
@require_GET
def agent_fragment(request: HttpRequest, agent_id: str) -> HttpResponse:
    """The live part of the agent page: status, runs, messages and timeline (or a shadow's
    Remote activity); ``?before=<cursor>`` as on the page (400 when bad)."""
    try:
        context = _agent_context(request, agent_id)
    except InvalidRequest:
        return HttpResponse(status=400)
    except DispatchError:
        return HttpResponse(status=404)
    return render(request, "agents/_agent_live.html", context)


@require_POST
def agent_prompt_form(request: HttpRequest, agent_id: str) -> HttpResponse:
    """Prompt an agent from its page (``lifecycle.agent_prompt_any``): an expert agent's
    prompt is a run with the ticked remotes enabled (``options.remotes``)."""
    remotes = [name for name in request.POST.getlist("remotes") if name]
    try:
        lifecycle.agent_prompt_any(
            user=authenticated_user(request),
            agent_id=agent_id,
            instruction=request.POST.get("instruction", "").strip(),
            options={"remotes": remotes} if remotes else None,
        )
    except DispatchError as exc:
        messages.error(request, exc.message)
    return redirect("agent", agent_id=agent_id)


@require_POST
def agent_message_form(request: HttpRequest, agent_id: str) -> HttpResponse:
    """Send a message to one of the user's agents from its page (a CLI agent gets it pasted
    into its pane by the supervisor; a shadow agent's goes through the outbox — the page's
    script posts to ``POST /api/v1/agents/<id>/messages`` instead; its delivery state
    follows live). Uses ``lifecycle.agent_message_send`` like the API."""
    try:
        user = authenticated_user(request)
        agent = selectors.agent_get_for(user=user, agent_id=agent_id)
        lifecycle.agent_message_send(user=user, recipient=agent, content=request.POST.get("content", ""))
    except DispatchError as exc:
        messages.error(request, exc.message)
    return redirect("agent", agent_id=agent_id)


@require_POST
def agent_keys_form(request: HttpRequest, agent_id: str) -> HttpResponse:
    """Press one key (``keys`` in the form, e.g. ``Down``) in a CLI agent's pane from its
    page (``keys.agent_keys_send``; docs/agents.md#keys); back to the page, with the
    refusal shown when there is one. Another user's agent is 404."""
    try:
        user = authenticated_user(request)
        agent = selectors.agent_get_for(user=user, agent_id=agent_id)
    except DispatchError as exc:
        return render(request, "agents/missing.html", {"message": exc.message}, status=404)
    try:
        keys.agent_keys_send(user=user, agent=agent, keys=request.POST.getlist("keys"))
    except DispatchError as exc:
        messages.error(request, exc.message)
    return redirect(f"{reverse('agent', kwargs={'agent_id': agent_id})}#keys")


def _lifecycle_form(request: HttpRequest, agent_id: str, action: str) -> HttpResponse:
    try:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        if action == "stop":
            lifecycle.agent_stop_any(agent=agent)
        elif action == "start":
            lifecycle.agent_start_any(agent=agent)
        else:
            lifecycle.agent_archive_any(agent=agent)
    except DispatchError as exc:
        messages.error(request, exc.message)
        return redirect("agent", agent_id=agent_id)
    if action == "archive":
        messages.success(request, f"Agent {agent.name} archived.")
        return redirect("agents")
    return redirect("agent", agent_id=agent_id)


@require_POST
def agent_stop_form(request: HttpRequest, agent_id: str) -> HttpResponse:
    """Stop the agent (a CLI agent goes ``stopping``; the supervisor finishes)."""
    return _lifecycle_form(request, agent_id, "stop")


@require_POST
def agent_start_form(request: HttpRequest, agent_id: str) -> HttpResponse:
    """Start a stopped or failed agent again."""
    return _lifecycle_form(request, agent_id, "start")


@require_POST
def agent_archive_form(request: HttpRequest, agent_id: str) -> HttpResponse:
    """Archive the agent (stopping it first) and go back to the list."""
    return _lifecycle_form(request, agent_id, "archive")
