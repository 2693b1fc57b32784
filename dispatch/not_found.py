"""The 404 answer for paths OAuth and MCP clients probe (docs/mcp.md#connecting-a-client).

An MCP client such as ``mcp-remote`` looks for OAuth metadata under ``/.well-known/``
(RFC 8414, RFC 9728) and tries Dynamic Client Registration at ``/register`` (RFC 7591)
before it falls back to the bearer token it was given. Dispatch has none of these, and a
client must be able to read that: an HTML page there makes it fail with "Dynamic Client
Registration rejected ... <!doctype html>". So an unmatched path under ``/.well-known/``,
``/register`` or ``/register/…`` answers the API's JSON error shape
(``{"error": {"code": "NOT_FOUND", "message", "details": {}}}``) unless the request is a
browser asking for a page; every other unmatched path keeps ``core.views.not_found``.

This is Django's ``handler404``, so it only runs for paths no route matches (a route added
later under ``/.well-known/`` answers as it chooses) and before any view middleware: a
``POST /register`` is not refused by the CSRF check first.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from core import views
from core.errors import DispatchError
from core.http import error_response

CLIENT_PROBED_PREFIXES = ("/.well-known/", "/register/")
CLIENT_PROBED_PATHS = frozenset({"/.well-known", "/register"})


def client_probed(path: str) -> bool:
    """Whether ``path`` is one OAuth/MCP clients probe (``/.well-known/…``, ``/register``)."""
    return path in CLIENT_PROBED_PATHS or path.startswith(CLIENT_PROBED_PREFIXES)


def wants_page(request: HttpRequest) -> bool:
    """Whether ``request`` is a browser page request: its ``Accept`` names ``text/html``
    and not ``application/json``. No ``Accept``, ``*/*`` or a JSON one: not a page."""
    accept = request.headers.get("Accept", "").lower()
    return "text/html" in accept and "application/json" not in accept


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """404: JSON ``NOT_FOUND`` for a client probing a path in ``client_probed`` that is not
    a browser page request; otherwise ``core.views.not_found`` (the API's shape under
    ``/api/``, the 404 page elsewhere)."""
    if client_probed(request.path) and not wants_page(request):
        return error_response(DispatchError("NOT_FOUND", f"{request.path} does not exist on this server"))
    return views.not_found(request, exception)
