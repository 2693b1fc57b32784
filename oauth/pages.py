"""The OAuth parts of ``/settings/`` (docs/mcp.md#oauth-connected-applications): the views
that disconnect an application and save the admin's switches (docs/mcp.md#oauth-admin); what
the section shows is ``oauth.selectors.settings_context``, rendered by the
``{% connected_applications %}`` tag."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST
from oauth2_provider.models import get_application_model

from core.authentication import authenticated_user
from oauth.services import connection_revoke, policy_update

MAX_ID = 2**63 - 1  # the largest primary key a database holds; past it the lookup itself fails


@require_POST
def connection_revoke_view(request: HttpRequest, application_id: int, user_id: int | None = None) -> HttpResponse:
    """``POST /settings/oauth/<application_id>/revoke/``: disconnect one of your applications;
    ``…/users/<user_id>/<application_id>/revoke/``: an admin disconnects another user's (403
    for anyone else)."""
    actor = authenticated_user(request)
    target = actor
    if application_id > MAX_ID or (user_id is not None and user_id > MAX_ID):
        messages.error(request, "No such application.")
        return redirect("settings")
    if user_id is not None and user_id != actor.pk:
        if not actor.is_staff:
            raise PermissionDenied("only admins revoke other users' applications")
        found = User.objects.filter(pk=user_id).first()
        if found is None:
            messages.error(request, "No such user.")
            return redirect("settings")
        target = found
    revoked = connection_revoke(user=target, application_id=application_id)
    if revoked:
        # Named only to whoever was connected to it: a user who was not learns nothing.
        application = get_application_model().objects.filter(pk=application_id).first()
        name = (application.name if application else "") or "the application"
        whose = "" if target == actor else f" for {target.get_username()}"
        messages.success(request, f"Disconnected {name}{whose}: its access is revoked.")
    else:
        messages.error(request, "No such application.")
    return redirect("settings")


@require_POST
def policy_view(request: HttpRequest) -> HttpResponse:
    """``POST /settings/oauth/policy/``: save the switches (checkboxes ``dcr_enabled``,
    ``cimd_enabled``, ``cimd_private_addresses``; absent means off). Staff only: 403 otherwise."""
    policy_update(
        actor=authenticated_user(request),
        dcr_enabled="dcr_enabled" in request.POST,
        cimd_enabled="cimd_enabled" in request.POST,
        cimd_private_addresses="cimd_private_addresses" in request.POST,
    )
    messages.success(request, "OAuth policy saved.")
    return redirect("settings")
