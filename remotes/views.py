"""The Remotes page (ui.md): connected remotes, their functions, and a call form."""

from __future__ import annotations

import json

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.template.response import TemplateResponse
from django.views.decorators.http import require_GET, require_POST

from dispatch.errors import DispatchError
from remotes.calls import call_from_body, parse_args_json
from remotes.selectors import remotes_for


@require_GET
def remotes_page(request: HttpRequest) -> HttpResponse:
    """``/remotes/``: the page; its list refreshes itself from ``remotes_fragment``."""
    remotes = list(remotes_for(user=request.user))
    return render(request, "remotes/remotes.html", {"remotes": remotes, "selected": ""})


@require_GET
def remotes_fragment(request: HttpRequest) -> HttpResponse:
    """The list of connected remotes (and the call form's choices), polled by htmx."""
    remotes = list(remotes_for(user=request.user))
    selected = request.GET.get("target", "")
    return TemplateResponse(request, "remotes/_remote_list.html", {"remotes": remotes, "selected": selected})


@require_POST
async def remote_call_form(request: HttpRequest) -> HttpResponse:
    """Run the call form: ``target`` is ``remotename/function`` split at the last ``/``."""
    user = await request.auser()
    target = request.POST.get("target", "")
    remotename, _, function = target.rpartition("/")
    context: dict[str, object] = {"target": target}
    try:
        args = parse_args_json(request.POST.get("args", ""))
        result = await call_from_body(user=user, body={"remotename": remotename, "function": function, "args": args})
    except DispatchError as exc:
        context["error"] = exc.message
    else:
        context["result"] = json.dumps(result, indent=2, ensure_ascii=False)
    return await sync_to_async(render)(request, "remotes/_call_result.html", context)
