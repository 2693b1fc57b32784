"""The Agents pages (ui.md): the list with a launch form, and one agent's page.

Live parts follow the one server-sent-event stream of the tab (``/api/v1/events``): a
small script (``static/js/live.js``) listens and asks htmx to re-fetch the affected
fragment; on a local CLI agent's page the same stream carries its pane (``?pane=<id>``).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from dispatch.agents import launching, selectors, services
from dispatch.agents import messages as agent_messages
from dispatch.agents.api import agent_archive_any, agent_start_any, agent_stop_any, agent_types_data
from dispatch.agents.prompting import agent_prompt_for
from dispatch.authentication import authenticated_user
from dispatch.errors import DispatchError
from dispatch.models import Agent
from dispatch.presence import HOSTNAME
from dispatch.views import htmx_login_required
from remotes.selectors import remotes_for

MESSAGES_SHOWN = 50


def _list_context(request: HttpRequest) -> dict[str, object]:
    user = authenticated_user(request)
    page = selectors.agents_for(user=user, before=request.GET.get("before") or None)
    return {"agents": page.items, "next": page.next}


@require_http_methods(["GET", "POST"])
def agents_page(request: HttpRequest) -> HttpResponse:
    """``/``: the user's agents (live) and the "Launch agent" form (every configured type;
    an unavailable one disabled as "(not installed)")."""
    user = authenticated_user(request)
    form: dict[str, Any] = {"type": "expert", "name": "", "prompt": "", "cwd": settings.DEFAULT_CWD}
    status = 200
    if request.method == "POST":
        form = {key: request.POST.get(key, "").strip() for key in ("type", "name", "prompt", "cwd")}
        form["full_access"] = request.POST.get("full_access") == "on"
        try:
            agent = launching.agent_launch_any(
                owner=user,
                type=form["type"],
                name=form["name"],
                prompt=form["prompt"],
                cwd=form["cwd"] or None,
                full_access=form["full_access"] and form["type"] != services.EXPERT,
            )
        except DispatchError as exc:
            messages.error(request, exc.message)
            status = 400
        else:
            return redirect("agent", agent_id=agent.pk)
    context = {**_list_context(request), "form": form, "types": agent_types_data()}
    return render(request, "agents/agents.html", context, status=status)


@htmx_login_required
@require_GET
def agents_fragment(request: HttpRequest) -> HttpResponse:
    """The agent list, re-fetched when the event stream reports a change."""
    return render(request, "agents/_agent_list.html", _list_context(request))


def has_local_pane(agent: Agent) -> bool:
    """Whether ``agent`` is a CLI agent whose tmux pane is on this host (its page shows it)."""
    return agent.type != services.EXPERT and not agent.peer_agent_id and agent.host == HOSTNAME


def _agent_context(request: HttpRequest, agent_id: str) -> dict[str, object]:
    agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
    is_cli = agent.type != services.EXPERT
    return {
        "agent": agent,
        "is_cli": is_cli,
        "local_pane": has_local_pane(agent),
        "events": selectors.events_page(agent=agent, limit=200).items,
        "runs": selectors.runs_page(agent=agent).items if not is_cli else [],
        "agent_messages": selectors.messages_page(agent=agent, limit=MESSAGES_SHOWN).items,
    }


@require_GET
def agent_page(request: HttpRequest, agent_id: str) -> HttpResponse:
    """``/agents/<id>/``: header, lifecycle buttons, the pane and message box (CLI agents) or
    the prompt box with remotes to enable (expert agents), runs, messages and the timeline."""
    try:
        context = _agent_context(request, agent_id)
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
    """The live part of the agent page: status, runs, messages and timeline."""
    try:
        context = _agent_context(request, agent_id)
    except DispatchError:
        return HttpResponse(status=404)
    return render(request, "agents/_agent_live.html", context)


@require_POST
def agent_prompt_form(request: HttpRequest, agent_id: str) -> HttpResponse:
    """Queue a run for an expert agent from its page, with the ticked remotes enabled
    (``options.remotes``)."""
    remotes = [name for name in request.POST.getlist("remotes") if name]
    try:
        agent_prompt_for(
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
    into its pane by the supervisor; its delivery state follows live)."""
    try:
        user = authenticated_user(request)
        agent = selectors.agent_get_for(user=user, agent_id=agent_id)
        agent_messages.message_send(recipient=agent, content=request.POST.get("content", ""), sender_user=user)
    except DispatchError as exc:
        messages.error(request, exc.message)
    return redirect("agent", agent_id=agent_id)


def _lifecycle_form(request: HttpRequest, agent_id: str, action: str) -> HttpResponse:
    try:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        if action == "stop":
            agent_stop_any(agent=agent)
        elif action == "start":
            agent_start_any(agent=agent)
        else:
            agent_archive_any(agent=agent)
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
