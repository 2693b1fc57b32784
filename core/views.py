"""Core pages: login (throttled), settings (API tokens), ``/healthz``, and the login check for htmx fragments."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar, cast
from urllib.parse import urlencode

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_not_required
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import NON_FIELD_ERRORS, RequestDataTooBig, ValidationError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render, resolve_url
from django.utils import timezone
from django.views import csrf, defaults
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods
from django_htmx.http import HttpResponseClientRedirect

from core import selectors, services
from core.authentication import authenticated_user
from core.errors import DispatchError, RateLimited
from core.health import health_check


class ThrottledAuthenticationForm(AuthenticationForm):
    """The login form, checking passwords through the shared throttle (docs/ws-protocol.md#authentication)."""

    def clean(self) -> dict[str, Any]:
        username = self.cleaned_data.get("username")
        password = self.cleaned_data.get("password")
        if username is not None and password:
            address = self.request.META.get("REMOTE_ADDR", "") if self.request else ""
            try:
                self.user_cache = services.password_authenticate(
                    username=username, password=password, client_address=address
                )
            except RateLimited as exc:
                raise ValidationError(exc.message, code="throttled") from None
            except services.AuthenticationFailed:
                raise self.get_invalid_login_error() from None
            self.confirm_login_allowed(self.user_cache)
        return self.cleaned_data


class LoginView(auth_views.LoginView):
    """``/login/``: 429 while the username or address is throttled."""

    form_class = ThrottledAuthenticationForm
    template_name = "dispatch/login.html"
    redirect_authenticated_user = True

    def form_invalid(self, form: AuthenticationForm) -> HttpResponse:
        response = super().form_invalid(form)
        if form.has_error(NON_FIELD_ERRORS, "throttled"):
            response.status_code = 429
        return response


login_view = login_not_required(LoginView.as_view())

ViewFunction = TypeVar("ViewFunction", bound=Callable[..., Any])


def _login_redirect(request: HttpRequest) -> HttpResponse:
    """Send an anonymous visitor to the login page, coming back to the page they were on.

    An htmx request gets ``HX-Redirect`` so the whole page goes to the login form (a plain
    302 would be followed by the XHR and the login page swapped into a fragment).
    """
    htmx = getattr(request, "htmx", None)
    if htmx:
        login_url = resolve_url(settings.LOGIN_URL)
        page = htmx.current_url_abs_path
        return HttpResponseClientRedirect(f"{login_url}?{urlencode({'next': page})}" if page else login_url)
    return redirect_to_login(request.get_full_path())


def htmx_login_required(view: ViewFunction) -> ViewFunction:
    """Like the site-wide ``LoginRequiredMiddleware``, but fit for htmx fragments (sync or async views).

    The view is marked ``login_not_required`` for the middleware and checks the user itself;
    an anonymous htmx request gets ``HX-Redirect`` to the login page, any other a 302.
    """
    if iscoroutinefunction(view):

        async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            user = await request.auser()
            if not user.is_authenticated:
                return _login_redirect(request)
            async_view = cast(Callable[..., Awaitable[HttpResponse]], view)
            return await async_view(request, *args, **kwargs)

        wrapper: Callable[..., Any] = markcoroutinefunction(functools.wraps(view)(async_wrapper))
    else:

        def sync_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return _login_redirect(request)
            response: HttpResponse = view(request, *args, **kwargs)
            return response

        wrapper = functools.wraps(view)(sync_wrapper)
    return cast(ViewFunction, login_not_required(wrapper))


def anonymous_browser_to_login(view: ViewFunction) -> ViewFunction:
    """For an API view that is also a page (Swagger UI at ``/api/docs/``, Redoc at
    ``/api/redoc/``): a visitor with neither a session nor an ``Authorization`` header is sent
    to the login page and back (302), as every other page does; a request carrying a token
    is left to the view (DRF answers 401 for a bad one). Sync views only."""

    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated and "HTTP_AUTHORIZATION" not in request.META:
            return _login_redirect(request)
        response: HttpResponse = view(request, *args, **kwargs)
        return response

    return cast(ViewFunction, login_not_required(functools.wraps(view)(wrapper)))


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, required=False)
    expires_in_days = forms.IntegerField(min_value=1, max_value=3650, required=False, label="Expires in (days)")


@never_cache  # the response that shows a new token must not be kept by the browser or a proxy
@require_http_methods(["GET", "POST"])
def settings_page(request: HttpRequest) -> HttpResponse:
    """``/settings/``: create (the raw token is in that one response only), list and revoke API tokens."""
    issued = None
    form = TokenForm()
    if request.method == "POST":
        form = TokenForm(request.POST)
        if form.is_valid():
            days = form.cleaned_data["expires_in_days"]
            expires_at = timezone.now() + timedelta(days=days) if days else None
            try:
                issued = services.api_token_create(
                    user=authenticated_user(request), name=form.cleaned_data["name"] or "", expires_at=expires_at
                )
            except DispatchError as exc:
                form.add_error(None, exc.message)
            else:
                form = TokenForm()
    tokens = selectors.api_tokens_for(user=authenticated_user(request))
    # The command a new token serves a remote with names this instance by its public base
    # URL (DISPATCH_PUBLIC_URL), which `dispatch-remote serve --server` takes (README).
    context = {"form": form, "issued": issued, "tokens": tokens, "server_url": settings.PUBLIC_URL}
    return render(request, "dispatch/settings.html", context, status=400 if form.errors else 200)


@require_http_methods(["POST"])
def token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    """Revoke one of the user's tokens from the settings page."""
    try:
        token = services.api_token_revoke(user=authenticated_user(request), token_id=token_id)
    except DispatchError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Token {token.prefix}… revoked.")
    return redirect("settings")


@login_not_required
async def healthz(request: HttpRequest) -> JsonResponse:
    """``/healthz``: 200 when the database is reachable and writable and the channel layer
    carries a probe, else 503 naming what failed (``core.health.Health.as_dict``); within
    3 s whatever is frozen (docs/operating.md#health)."""
    health = await health_check()
    return JsonResponse(health.as_dict(), status=200 if health.healthy else 503)


def _api_error(code: str, message: str, status: int) -> JsonResponse:
    return JsonResponse({"error": {"code": code, "message": message, "details": {}}}, status=status)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    """400 (Django's ``SuspiciousOperation``s): the API's error shape under ``/api/``, the
    400 page elsewhere. A body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (which follows
    ``DISPATCH_MAX_REQUEST_BYTES``) is 413 ``REQUEST_TOO_LARGE``."""
    if isinstance(exception, RequestDataTooBig):
        if request.path.startswith("/api/"):
            return _api_error(
                "REQUEST_TOO_LARGE",
                f"the request body is over this server's limit of {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes "
                "(DISPATCH_MAX_REQUEST_BYTES)",
                413,
            )
        return HttpResponse("Request body too large", status=413, content_type="text/plain")
    if request.path.startswith("/api/"):
        return _api_error("INVALID_REQUEST", "bad request", 400)
    return defaults.bad_request(request, exception)


def permission_denied(request: HttpRequest, exception: Exception) -> HttpResponse:
    """403: the API's error shape under ``/api/``, the 403 page elsewhere."""
    if request.path.startswith("/api/"):
        return _api_error("PERMISSION_DENIED", str(exception) or "permission denied", 403)
    return defaults.permission_denied(request, exception)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """CSRF refusal (``CSRF_FAILURE_VIEW``): the API's error shape under ``/api/`` (a
    session-authenticated write without the CSRF token), Django's page elsewhere."""
    if request.path.startswith("/api/"):
        return _api_error("PERMISSION_DENIED", f"CSRF check failed: {reason}", 403)
    return csrf.csrf_failure(request, reason)


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """404: the API's error shape under ``/api/``, the 404 page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse(
            {"error": {"code": "NOT_FOUND", "message": f"no API route {request.path}", "details": {}}}, status=404
        )
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """500: the API's error shape under ``/api/``, the 500 page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse(
            {"error": {"code": "INTERNAL_ERROR", "message": "internal error; see the server log", "details": {}}},
            status=500,
        )
    return defaults.server_error(request)
