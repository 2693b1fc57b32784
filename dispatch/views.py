"""Core pages: login (throttled), settings (API tokens), and ``/healthz``."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django import forms
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_not_required
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from dispatch import selectors, services
from dispatch.errors import DispatchError, RateLimited
from dispatch.presence import current_process_id


class ThrottledAuthenticationForm(AuthenticationForm):
    """The login form, checking passwords through the shared throttle (§1.1)."""

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


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, required=False)
    expires_in_days = forms.IntegerField(min_value=1, max_value=3650, required=False, label="Expires in (days)")


@require_http_methods(["GET", "POST"])
def settings_page(request: HttpRequest) -> HttpResponse:
    """``/settings/``: create (shown once), list and revoke API tokens."""
    issued = None
    form = TokenForm()
    if request.method == "POST":
        form = TokenForm(request.POST)
        if form.is_valid():
            days = form.cleaned_data["expires_in_days"]
            expires_at = timezone.now() + timedelta(days=days) if days else None
            issued = services.api_token_create(
                user=request.user, name=form.cleaned_data["name"] or "", expires_at=expires_at
            )
            form = TokenForm()
    tokens = selectors.api_tokens_for(user=request.user)
    return render(request, "dispatch/settings.html", {"form": form, "issued": issued, "tokens": tokens})


@require_http_methods(["POST"])
def token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    """Revoke one of the user's tokens from the settings page."""
    try:
        token = services.api_token_revoke(user=request.user, token_id=token_id)
    except DispatchError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Token {token.prefix}… revoked.")
    return redirect("settings")


def _database_ok() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except Exception:
        return False
    finally:
        connection.close()


async def _channel_layer_ok() -> bool:
    layer = get_channel_layer()
    if layer is None:
        return False
    try:
        channel = await layer.new_channel()
        probe = uuid.uuid4().hex
        await layer.send(channel, {"type": "health.probe", "probe": probe})
        message = await asyncio.wait_for(layer.receive(channel), timeout=3)
        return bool(message.get("probe") == probe)
    except Exception:
        return False


@login_not_required
async def healthz(request: HttpRequest) -> JsonResponse:
    """``/healthz``: 200 with this process's id and database/channel-layer status, else 503."""
    database_ok = await sync_to_async(_database_ok, thread_sensitive=False)()
    layer_ok = await _channel_layer_ok()
    healthy = database_ok and layer_ok
    return JsonResponse(
        {
            "status": "ok" if healthy else "degraded",
            "process_id": current_process_id(),
            "database": "ok" if database_ok else "error",
            "channel_layer": "ok" if layer_ok else "error",
        },
        status=200 if healthy else 503,
    )
