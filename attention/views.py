"""Notification pages and files: ``/settings/notifications/`` (the user's settings, the
test button, enabling notifications in this browser), ``/sw.js`` (the service worker, at
the root scope) and ``/manifest.webmanifest`` (so the pages can be installed; iOS pushes
only to an installed web app). docs/notifications.md.
"""

from __future__ import annotations

import json
from datetime import time
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.template.loader import render_to_string
from django.templatetags.static import static
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_safe

from attention import selectors, services
from attention.models import NotificationSettings
from attention.senders import apprise_url_masked
from core.authentication import authenticated_user
from core.errors import DispatchError


class NotificationSettingsForm(forms.Form):
    on_approval = forms.BooleanField(required=False, label="An approval is waiting")
    on_finished = forms.BooleanField(required=False, label="An agent finished")
    on_failed = forms.BooleanField(required=False, label="An agent failed")
    quiet_start = forms.TimeField(required=False, label="Quiet from", input_formats=["%H:%M"])
    quiet_end = forms.TimeField(required=False, label="until", input_formats=["%H:%M"])
    quiet_timezone = forms.CharField(max_length=64, label="Time zone", initial="UTC")
    approvals_break_quiet_hours = forms.BooleanField(required=False, label="Approvals break through quiet hours")
    apprise_urls = forms.CharField(
        required=False,
        label="Apprise URLs (one a line)",
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false"}),
    )

    @classmethod
    def of(cls, choices: NotificationSettings) -> NotificationSettingsForm:
        masked = [apprise_url_masked(url) for url in selectors.apprise_urls_of(choices)]
        return cls(
            initial={
                "on_approval": choices.on_approval,
                "on_finished": choices.on_finished,
                "on_failed": choices.on_failed,
                "quiet_start": _clock(choices.quiet_start),
                "quiet_end": _clock(choices.quiet_end),
                "quiet_timezone": choices.quiet_timezone,
                "approvals_break_quiet_hours": choices.approvals_break_quiet_hours,
                "apprise_urls": "\n".join(masked),
            }
        )


def _clock(value: time | None) -> str:
    return value.strftime("%H:%M") if value is not None else ""


@require_http_methods(["GET", "POST"])
def notification_settings_page(request: HttpRequest) -> HttpResponse:
    """``/settings/notifications/``: change the settings (a refused Apprise URL is shown
    with apprise's reason and nothing is saved), see this browser's state."""
    user = authenticated_user(request)
    choices = selectors.notification_settings_for(user=user)
    form = NotificationSettingsForm.of(choices)
    if request.method == "POST":
        form = NotificationSettingsForm(request.POST)
        if form.is_valid():
            data = form.cleaned_data
            urls = [line.strip() for line in data["apprise_urls"].splitlines() if line.strip()]
            try:
                services.notification_settings_update(
                    user=user,
                    on_approval=data["on_approval"],
                    on_finished=data["on_finished"],
                    on_failed=data["on_failed"],
                    quiet_hours=services.QuietHours(data["quiet_start"], data["quiet_end"], data["quiet_timezone"]),
                    approvals_break_quiet_hours=data["approvals_break_quiet_hours"],
                    apprise_urls=urls,
                )
            except DispatchError as exc:
                form.add_error(None, exc.message)
            else:
                messages.success(request, "Notification settings saved.")
                return HttpResponseRedirect(reverse("notification-settings"))
    context: dict[str, Any] = {
        "form": form,
        "subscriptions": selectors.push_subscriptions_for(user=user),
        "recent": selectors.notifications_for(user=user, limit=10),
    }
    return render(request, "attention/settings.html", context, status=400 if form.errors else 200)


@require_http_methods(["POST"])
def notification_test(request: HttpRequest) -> HttpResponse:
    """The settings page's "Send a test notification" button."""
    notification = services.notify_test(user=authenticated_user(request))
    if notification.status == notification.Status.SUPPRESSED:
        messages.warning(request, "Nothing to send to: add an Apprise URL or enable push on a device first.")
    else:
        messages.success(request, "Test notification queued: it arrives within a few seconds.")
    return HttpResponseRedirect(reverse("notification-settings"))


_SW_SOURCE = render_to_string("attention/sw.js")


@login_not_required  # a service worker script holds no user data; browsers fetch it on their own
@require_safe
def service_worker(request: HttpRequest) -> HttpResponse:
    """``GET /sw.js``: the service worker, ``text/javascript`` with
    ``Service-Worker-Allowed: /`` and no caching (a browser checks it for updates)."""
    response = HttpResponse(_SW_SOURCE, content_type="text/javascript; charset=utf-8")
    response["Service-Worker-Allowed"] = "/"
    response["Cache-Control"] = "no-cache"
    return response


@login_not_required  # browsers fetch a manifest without credentials
@require_safe
def web_manifest(request: HttpRequest) -> HttpResponse:
    """``GET /manifest.webmanifest``: the web app manifest (W3C Web Application Manifest),
    ``application/manifest+json``; ``display: standalone`` makes an installed Dispatch a
    web app, which iOS (16.4+) requires for Web Push."""
    # The PNGs are static/favicon.svg rendered full-bleed at 192 and 512 px (Chromium):
    # home screens (Android, iOS) want bitmaps and mask them to their own shape.
    manifest = {
        "name": "Dispatch",
        "short_name": "Dispatch",
        "start_url": "/",
        "scope": "/",
        "display": "standalone",
        "background_color": "#111827",
        "theme_color": "#111827",
        "icons": [
            {"src": static("favicon.svg"), "sizes": "any", "type": "image/svg+xml", "purpose": "any"},
            {
                "src": static("icons/dispatch-192.png"),
                "sizes": "192x192",
                "type": "image/png",
                "purpose": "any maskable",
            },
            {
                "src": static("icons/dispatch-512.png"),
                "sizes": "512x512",
                "type": "image/png",
                "purpose": "any maskable",
            },
        ],
    }
    response = HttpResponse(json.dumps(manifest, indent=2), content_type="application/manifest+json")
    response["Cache-Control"] = "public, max-age=3600"
    return response
