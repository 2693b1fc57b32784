"""Django's own middleware, with its hooks run on the event loop when they do no I/O.

Under ASGI, Django runs each hook of a ``MiddlewareMixin`` middleware (``process_request``,
``process_view``, ``process_response``) through ``sync_to_async(thread_sensitive=True)``: a
hop to the one thread every database call of the process shares, and back. Eight of
Django's middleware made 14 such hops per request, about 1.0–1.4 ms of server CPU out of
5.4–5.9 for a ``GET /healthz`` (docs/architecture.md#how-the-code-is-written: never block
the shared sync thread, nor queue on it for nothing).

Most of those hooks only read headers and set attributes. The classes here are Django's,
unchanged, except that in async mode a hook runs inline unless it may reach the database
(or the session, which is the database here), in which case it takes the hop as before:

- the session is saved (``SessionMiddleware``: it was modified, or ``SESSION_SAVE_EVERY_REQUEST``);
- messages are stored (``MessageMiddleware``: they were read or added; they live in the session);
- a login is required (``LoginRequiredMiddleware``: the user must be loaded); a view marked
  ``login_not_required`` is let through without loading anyone;
- a CSRF check reads a form body (an unsafe method on a view that is not exempt), or the
  token lives in the session (``CSRF_USE_SESSIONS``).

A hook that reached the database inline would raise ``SynchronousOnlyOperation``: such a
mistake fails loudly, it does not block the loop. Under WSGI (Django's test ``Client``) every
hook runs as Django runs it.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.http import HttpRequest, HttpResponseBase
from django.middleware import clickjacking, common, csrf, security

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


async def _in_thread(hook: Any, *args: Any) -> Any:
    return await sync_to_async(hook, thread_sensitive=True)(*args)


class _HooksOnTheLoop:
    """Mixed in before a ``MiddlewareMixin`` subclass: its ``__acall__`` and, in async
    mode, its ``process_view`` run each hook inline, unless the ``*_in_thread`` predicate
    of that hook says it may do I/O."""

    async_mode: bool
    get_response: Any

    def __init__(self, get_response: Any) -> None:
        super().__init__(get_response)  # type: ignore[call-arg]
        view_hook = getattr(self, "process_view", None)
        if self.async_mode and view_hook is not None:
            self._sync_process_view = view_hook
            # An instance attribute Django's handler finds instead of the class's method;
            # being a coroutine function, it is awaited as is, not wrapped in a hop.
            setattr(self, "process_view", self._process_view_on_loop)  # noqa: B010 (not a declared attribute)

    def request_in_thread(self, request: HttpRequest) -> bool:
        return False

    def response_in_thread(self, request: HttpRequest, response: HttpResponseBase) -> bool:
        return False

    def view_in_thread(self, request: HttpRequest, view_func: Any) -> bool:
        return False

    async def _process_view_on_loop(
        self, request: HttpRequest, view_func: Any, view_args: Any, view_kwargs: Any
    ) -> HttpResponseBase | None:
        if self.view_in_thread(request, view_func):
            return await _in_thread(self._sync_process_view, request, view_func, view_args, view_kwargs)
        return self._sync_process_view(request, view_func, view_args, view_kwargs)

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        response = None
        process_request = getattr(self, "process_request", None)
        if process_request is not None:
            if self.request_in_thread(request):
                response = await _in_thread(process_request, request)
            else:
                response = process_request(request)
        response = response or await self.get_response(request)
        process_response = getattr(self, "process_response", None)
        if process_response is not None:
            if self.response_in_thread(request, response):
                response = await _in_thread(process_response, request, response)
            else:
                response = process_response(request, response)
        return response


class SecurityMiddleware(_HooksOnTheLoop, security.SecurityMiddleware):
    """``django.middleware.security.SecurityMiddleware``; headers only: always inline."""


class CommonMiddleware(_HooksOnTheLoop, common.CommonMiddleware):
    """``django.middleware.common.CommonMiddleware``; URL resolving and headers: always inline."""


class XFrameOptionsMiddleware(_HooksOnTheLoop, clickjacking.XFrameOptionsMiddleware):
    """``django.middleware.clickjacking.XFrameOptionsMiddleware``; a header: always inline."""


class AuthenticationMiddleware(_HooksOnTheLoop, auth.AuthenticationMiddleware):
    """``django.contrib.auth.middleware.AuthenticationMiddleware``: it sets a lazy
    ``request.user`` (loaded where it is first used): inline."""


class SessionMiddleware(_HooksOnTheLoop, sessions.SessionMiddleware):
    """``django.contrib.sessions.middleware.SessionMiddleware``: the store is made lazily
    (inline); the response hook takes the hop when it will save the session."""

    def response_in_thread(self, request: HttpRequest, response: HttpResponseBase) -> bool:
        session = getattr(request, "session", None)
        return session is not None and bool(session.modified or settings.SESSION_SAVE_EVERY_REQUEST)


class MessageMiddleware(_HooksOnTheLoop, messages.MessageMiddleware):
    """``django.contrib.messages.middleware.MessageMiddleware``: the storage is made lazily
    (inline); the response hook takes the hop when messages were read or added (they are
    stored in the session)."""

    def response_in_thread(self, request: HttpRequest, response: HttpResponseBase) -> bool:
        storage = getattr(request, "_messages", None)
        return storage is not None and bool(storage.used or storage.added_new)


class CsrfViewMiddleware(_HooksOnTheLoop, csrf.CsrfViewMiddleware):
    """``django.middleware.csrf.CsrfViewMiddleware``: the token cookie is read and set
    inline; the check of an unsafe request to a view that is not exempt (it may parse a
    form body) takes the hop, as does everything when the token lives in the session."""

    def request_in_thread(self, request: HttpRequest) -> bool:
        return bool(settings.CSRF_USE_SESSIONS)

    def response_in_thread(self, request: HttpRequest, response: HttpResponseBase) -> bool:
        return bool(settings.CSRF_USE_SESSIONS)

    def view_in_thread(self, request: HttpRequest, view_func: Any) -> bool:
        if settings.CSRF_USE_SESSIONS:
            return True
        exempt = getattr(view_func, "csrf_exempt", False) or getattr(request, "_dont_enforce_csrf_checks", False)
        return request.method not in SAFE_METHODS and not exempt


class LoginRequiredMiddleware(_HooksOnTheLoop, auth.LoginRequiredMiddleware):
    """``django.contrib.auth.middleware.LoginRequiredMiddleware``: a view marked
    ``login_not_required`` is let through inline (whoever asks; Django's answer too, without
    loading the user); any other takes the hop to load the user."""

    def view_in_thread(self, request: HttpRequest, view_func: Any) -> bool:
        return bool(getattr(view_func, "login_required", True))

    async def _process_view_on_loop(
        self, request: HttpRequest, view_func: Any, view_args: Any, view_kwargs: Any
    ) -> HttpResponseBase | None:
        if not self.view_in_thread(request, view_func):
            return None
        return await _in_thread(self._sync_process_view, request, view_func, view_args, view_kwargs)
