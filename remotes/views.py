"""The Remotes page: connected remotes, their functions, and a call form.

The list refreshes itself: htmx polls ``remotes_fragment`` every 2 s, sending the version
of the list it shows and the call form's current choice. An unchanged list answers 204
(htmx leaves the page alone, so open schema boxes and the open ``<select>`` stay as they
are); a changed one is re-rendered with the form's choices updated out of band, the
user's choice kept selected.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from core import downloads
from core.authentication import authenticated_user
from core.errors import DispatchError
from core.views import htmx_login_required
from remotes.calls import call_from_body, parse_args_json
from remotes.models import Remote
from remotes.selectors import remotes_for

DEFAULT_ARGS = "{}"
EXAMPLE_FILE = "weather.py"  # the page's example remote, saved by the user (README "Serve and call a remote")


def serve_commands() -> dict[str, str | None]:
    """What the Remotes and Settings pages tell a newcomer to run on their own computer,
    naming this instance by its public base URL (``DISPATCH_PUBLIC_URL``, which ``serve
    --server`` takes; README "Serve and call a remote"): ``install``, ``pip install`` of the
    newest ``dispatch-remote`` wheel ``/downloads/`` serves (``None`` when there is none:
    ``make dist`` has not run); ``serve``, serving ``EXAMPLE_FILE``'s ``remote`` with the
    token in ``DISPATCH_TOKEN``; ``server``, the base URL itself. Reads the dist folder."""
    server = settings.PUBLIC_URL
    wheel = downloads.newest_wheel(downloads.REMOTE)
    return {
        "server": server,
        "install": f"pip install {server}{reverse('download', args=[wheel.filename])}" if wheel else None,
        "serve": f"dispatch-remote serve {EXAMPLE_FILE}:remote --server {server} --token $DISPATCH_TOKEN",
    }


@dataclass(frozen=True)
class Parameter:
    """One top-level property of a function's parameter schema, for display."""

    name: str
    type: str
    required: bool
    description: str


@dataclass(frozen=True)
class FunctionView:
    """One function of a connected remote as the page shows it."""

    name: str
    description: str
    parameters: list[Parameter]
    schema: str  # the full JSON Schema, pretty-printed JSON
    target: str  # the call form's value: ``remotename/function``


@dataclass(frozen=True)
class RemoteView:
    """A connected remote with its functions and the ws session serving it."""

    remote: Remote
    functions: list[FunctionView]


def _schema_type(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "any"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(str(k) for k in kind)
    if kind == "array" and isinstance(schema.get("items"), dict):
        return f"array of {_schema_type(schema['items'])}"
    if kind:
        return str(kind)
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    return "any"


def _function_view(remote: Remote, spec: dict[str, Any]) -> FunctionView:
    parameters = spec.get("parameters") or {}
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    return FunctionView(
        name=spec["name"],
        description=spec.get("description") or "",
        parameters=[
            Parameter(
                name=name,
                type=_schema_type(prop),
                required=name in required,
                description=str(prop.get("description", "")) if isinstance(prop, dict) else "",
            )
            for name, prop in properties.items()
        ],
        schema=json.dumps(parameters, indent=2, ensure_ascii=False),
        target=f"{remote.name}/{spec['name']}",
    )


def _remote_views(remotes: list[Remote]) -> list[RemoteView]:
    return [RemoteView(remote=r, functions=[_function_view(r, spec) for spec in r.tools]) for r in remotes]


def remote_list_version(remotes: list[Remote]) -> str:
    """16 hex characters that change whenever the list would render differently.

    A reconnect makes a new row (new pk and session), so it changes the version too.
    """
    digest = hashlib.sha256()
    for remote in remotes:
        entry = [remote.pk, remote.name, remote.ws_session_id, remote.tools]
        digest.update(json.dumps(entry, sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def _page_context(request: HttpRequest, remotes: list[Remote], *, selected: str) -> dict[str, Any]:
    return {
        "remotes": _remote_views(remotes),
        "version": remote_list_version(remotes),
        "selected": selected,
        # Only the empty list shows the commands: no need to read the dist folder otherwise.
        "connect": None if remotes else serve_commands(),
    }


def _user_remotes(user: User) -> list[Remote]:
    return list(remotes_for(user=user))


@require_GET
def remotes_page(request: HttpRequest) -> HttpResponse:
    """``/remotes/``: the page; ``?target=remote/function`` preselects a function in the call form."""
    context = _page_context(request, _user_remotes(authenticated_user(request)), selected=request.GET.get("target", ""))
    context["args"] = DEFAULT_ARGS
    return render(request, "remotes/remotes.html", context)


@require_GET
@htmx_login_required
def remotes_fragment(request: HttpRequest) -> HttpResponse:
    """The list of connected remotes (with the call form's choices out of band), polled by htmx.

    Query: ``version`` (the version the page shows; equal → 204, nothing to swap) and
    ``target`` (the call form's current choice, kept selected in the new choices).
    """
    remotes = _user_remotes(authenticated_user(request))
    context = _page_context(request, remotes, selected=request.GET.get("target", ""))
    if request.GET.get("version") == context["version"]:
        return HttpResponse(status=204)
    return render(request, "remotes/_remote_list.html", context)


@require_POST
@htmx_login_required
async def remote_call_form(request: HttpRequest) -> HttpResponse:
    """Run the call form: ``target`` is ``remotename/function`` split at the last ``/``; ``args`` a JSON object.

    From htmx the answer is the result fragment (200 with an error box on failure, so htmx
    swaps it in); without JavaScript the whole page with the result.
    """
    user = await request.auser()
    if not isinstance(user, User):  # htmx_login_required let no anonymous request through
        raise PermissionError("remote_call_form reached without a logged-in user")
    target = request.POST.get("target", "")
    args_text = request.POST.get("args", "")
    remotename, _, function = target.rpartition("/")
    context: dict[str, Any] = {"target": target, "remotename": remotename, "function": function}
    try:
        if not target:
            raise DispatchError("INVALID_REQUEST", "choose a function to call")
        args = parse_args_json(args_text)
        result = await call_from_body(user=user, body={"remotename": remotename, "function": function, "args": args})
    except DispatchError as exc:
        context["error"] = exc.message
    else:
        context["result"] = json.dumps(result, indent=2, ensure_ascii=False)
    if request.htmx:  # type: ignore[attr-defined]
        return await sync_to_async(render)(request, "remotes/_call_result.html", context)
    remotes = await sync_to_async(_user_remotes)(user)
    context |= await sync_to_async(_page_context)(request, remotes, selected=target)
    context["args"] = args_text or DEFAULT_ARGS
    status = 200 if "result" in context else 400
    return await sync_to_async(render)(request, "remotes/remotes.html", context, status=status)
