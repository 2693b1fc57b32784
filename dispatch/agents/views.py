"""The Agents pages (ui.md): the list with a launch form, and one agent's page.

Live parts follow the one server-sent-event stream of the tab (``/api/v1/events``): a
small script listens and asks htmx to re-fetch the affected fragment.
"""

from __future__ import annotations

from pathlib import Path

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from dispatch.agents import cli, selectors, services
from dispatch.authentication import authenticated_user
from dispatch.errors import DispatchError
from dispatch.views import htmx_login_required

LAUNCHABLE = ("expert", "shell")  # the other CLI types follow


def _list_context(request: HttpRequest) -> dict[str, object]:
    user = authenticated_user(request)
    page = selectors.agents_for(user=user, before=request.GET.get("before") or None)
    return {"agents": page.items, "next": page.next}


@require_http_methods(["GET", "POST"])
def agents_page(request: HttpRequest) -> HttpResponse:
    """``/``: the user's agents (live) and the "Launch agent" form."""
    user = authenticated_user(request)
    form = {"type": "expert", "name": "", "prompt": "", "cwd": str(Path.home())}
    status = 200
    if request.method == "POST":
        form = {key: request.POST.get(key, "").strip() for key in ("type", "name", "prompt", "cwd")}
        try:
            if form["type"] not in LAUNCHABLE:
                raise DispatchError("INVALID_REQUEST", f"type '{form['type']}' cannot be launched yet")
            if form["type"] == "expert":
                agent = services.agent_create(owner=user, type="expert", name=form["name"], cwd=form["cwd"])
                if form["prompt"]:
                    services.run_enqueue(agent=agent, instruction=form["prompt"])
            else:
                agent = cli.agent_launch(
                    owner=user, type=form["type"], name=form["name"], prompt=form["prompt"], cwd=form["cwd"]
                )
        except DispatchError as exc:
            messages.error(request, exc.message)
            status = 400
        else:
            return redirect("agent", agent_id=agent.pk)
    context = {**_list_context(request), "form": form, "types": LAUNCHABLE}
    return render(request, "agents/agents.html", context, status=status)


@htmx_login_required
@require_GET
def agents_fragment(request: HttpRequest) -> HttpResponse:
    """The agent list, re-fetched when the event stream reports a change."""
    return render(request, "agents/_agent_list.html", _list_context(request))


def _agent_context(request: HttpRequest, agent_id: str) -> dict[str, object]:
    agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
    return {
        "agent": agent,
        "events": selectors.events_page(agent=agent, limit=200).items,
        "runs": selectors.runs_page(agent=agent).items,
    }


@require_GET
def agent_page(request: HttpRequest, agent_id: str) -> HttpResponse:
    """``/agents/<id>/``: header, prompt box (expert agents), runs and the timeline."""
    try:
        context = _agent_context(request, agent_id)
    except DispatchError as exc:
        return render(request, "agents/missing.html", {"message": exc.message}, status=404)
    return render(request, "agents/agent.html", context)


@htmx_login_required
@require_GET
def agent_fragment(request: HttpRequest, agent_id: str) -> HttpResponse:
    """The live part of the agent page: status, runs and timeline."""
    try:
        context = _agent_context(request, agent_id)
    except DispatchError:
        return HttpResponse(status=404)
    return render(request, "agents/_agent_live.html", context)


@require_POST
def agent_prompt_form(request: HttpRequest, agent_id: str) -> HttpResponse:
    """Queue a run for an expert agent from its page."""
    try:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        if agent.status != "running":
            raise DispatchError("CONFLICT", f"agent '{agent.name}' is not running")
        services.run_enqueue(agent=agent, instruction=request.POST.get("instruction", "").strip())
    except DispatchError as exc:
        messages.error(request, exc.message)
    return redirect("agent", agent_id=agent_id)


@require_POST
def agent_archive_form(request: HttpRequest, agent_id: str) -> HttpResponse:
    try:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        services.agent_archive(agent=agent)
    except DispatchError as exc:
        messages.error(request, exc.message)
        return redirect("agent", agent_id=agent_id)
    messages.success(request, f"Agent {agent.name} archived.")
    return redirect("agents")
