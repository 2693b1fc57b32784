"""The Machines page and the device activation page (ui.md; machines.md §1)."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from dispatch.authentication import authenticated_user
from dispatch.errors import DispatchError
from dispatch.views import htmx_login_required
from machines import selectors
from machines.services import connections, device, router


def _context(request: HttpRequest) -> dict[str, object]:
    user = authenticated_user(request)
    return {
        "machines": list(selectors.machines_for(user=user).prefetch_related("connections")),
        "default_machine_id": router.default_machine_id(user=user),
        "audit_records": list(selectors.audit_records_for(user=user, limit=30)),
    }


@require_GET
def machines_page(request: HttpRequest) -> HttpResponse:
    """``/machines/``: machines with live status, the default selector, revoke, recent audit."""
    return render(request, "machines/machines.html", _context(request))


@htmx_login_required
@require_GET
def machines_fragment(request: HttpRequest) -> HttpResponse:
    """The machine list and audit, polled by htmx so status changes show without reload."""
    return render(request, "machines/_machine_list.html", _context(request))


@require_POST
def machine_revoke(request: HttpRequest, machine_id: str) -> HttpResponse:
    try:
        machine = connections.machine_revoke(user=authenticated_user(request), machine_id=machine_id)
    except DispatchError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Machine {machine.name} revoked; its shim was disconnected.")
    return redirect("machines")


@require_POST
def machine_default(request: HttpRequest) -> HttpResponse:
    machine_id = request.POST.get("machine_id") or None
    try:
        router.default_machine_set(user=authenticated_user(request), machine_id=machine_id)
    except DispatchError as exc:
        messages.error(request, exc.message)
    return redirect("machines")


@require_http_methods(["GET", "POST"])
def activate_page(request: HttpRequest) -> HttpResponse:
    """``/machines/activate``: enter a code, see the requesting machine, approve or deny."""
    user = authenticated_user(request)
    code = (request.POST.get("user_code") or request.GET.get("user_code") or "").strip()
    context: dict[str, object] = {"user_code": code}
    status = 200
    if request.method == "POST":
        decision = request.POST.get("decision")
        try:
            if decision in ("approve", "deny"):
                authorization = device.device_authorization_decide(
                    user=user, user_code=code, approve=decision == "approve"
                )
                context["decided"] = authorization
            else:
                context["authorization"] = device.device_authorization_find(user=user, user_code=code)
        except DispatchError as exc:
            context["error"] = exc.message
            status = exc.http_status
    return render(request, "machines/activate.html", context, status=status)
