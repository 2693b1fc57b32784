"""The Machines page and the device activation page (docs/shim-protocol.md#getting-a-token).

The page's live-operation panels (docs/live-operations.md#the-machines-page: the "Run"
panel, operations in flight, a copy with its progress bar) are rendered here and driven by
``static/js/machines-run.js`` through the REST routes (``/api/v1/sessions/default/ops``
with ``stream: true``, ``…/ops/{request_id}/cancel``, ``GET …/ops``, ``…/copy``), with the
page's session cookie and CSRF token; they act in the machine session ``RUN_SESSION``.
"""

from __future__ import annotations

import hashlib
import json

from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from core import downloads
from core.authentication import authenticated_user
from core.errors import DispatchError
from core.views import htmx_login_required
from machines import selectors
from machines.models import Machine
from machines.services import connections, device, router
from machines.shim.protocol import supports_live_operations

EXAMPLE_ROOT = "~/src"  # in the commands shown: the folder agents may use, for the user to edit
RUN_SESSION = "default"  # the machine session the page's Run and Copy panels act in


def _run_targets(machines: list[Machine], default_machine_id: str | None) -> list[dict[str, object]]:
    """The machines attached to ``RUN_SESSION`` now, by name, as the Run and Copy panels
    offer them: ``machine_id``, ``name``, ``shell`` / ``files`` (granted on its
    connection), ``live`` (its shim speaks protocol 2.1: streamed output and cancel),
    ``protocol_version``, ``is_default`` and ``checked`` (the Run panel's initial choice:
    the default machine when it has a shell, else the first one that has). ``machines``
    come with their connections prefetched."""
    targets: list[dict[str, object]] = []
    for machine in machines:
        attached = [row for row in machine.connections.all() if row.attached_to(RUN_SESSION)]
        if not attached:
            continue
        granted = attached[0].granted_capabilities
        targets.append(
            {
                "machine_id": machine.machine_id,
                "name": machine.name,
                "shell": "shell" in granted,
                "files": "files" in granted,
                "live": supports_live_operations(attached[0].protocol_version),
                "protocol_version": attached[0].protocol_version,
                "is_default": machine.machine_id == default_machine_id,
                "checked": False,
            }
        )
    targets.sort(key=lambda target: (str(target["name"]).lower(), str(target["machine_id"])))
    shell = [target for target in targets if target["shell"]]
    chosen = next((target for target in shell if target["is_default"]), shell[0] if shell else None)
    if chosen is not None:
        chosen["checked"] = True
    return targets


def _context(request: HttpRequest, served_shim: downloads.ClientPackage | None) -> dict[str, object]:
    user = authenticated_user(request)
    machines = list(selectors.machines_for(user=user).prefetch_related("connections"))
    context: dict[str, object] = {
        "machines": machines,
        "default_machine_id": router.default_machine_id(user=user),
        # A copy or a pipe is one row, however many audit records its steps wrote.
        "recent_operations": selectors.recent_operations_for(user=user, limit=30),
        # The newest shim wheel /downloads/ serves, and the machines whose shim is older.
        "served_shim": served_shim,
        "outdated_machine_ids": {
            machine.machine_id for machine in machines if served_shim and machine.shim_older_than(served_shim.version)
        },
    }
    context["version"] = _version(context)
    return context


def _version(context: dict[str, object]) -> str:
    """16 hex characters that change whenever the list would render differently."""
    digest = hashlib.sha256()
    for machine in context["machines"]:  # type: ignore[attr-defined]
        fields = [machine.machine_id, machine.name, machine.connection_status, machine.health, machine.status_reason]
        fields += [machine.granted_capabilities, machine.allowed_capabilities, machine.allowed_roots]
        fields += [machine.last_active_at, [c.sessions for c in machine.connections.all()], machine.shim_version]
        digest.update(json.dumps(fields, default=str).encode())
    operations = context["recent_operations"]
    served = context["served_shim"]
    digest.update(f"{context['default_machine_id']}".encode())
    for row in operations:  # type: ignore[attr-defined]
        digest.update(f"|{row.key}:{row.outcome}:{row.steps}".encode())  # a running copy's row changes as it goes
    digest.update(f"|{served.filename if served else ''}".encode())  # type: ignore[attr-defined]
    return digest.hexdigest()[:16]


def _connect_commands(served_shim: downloads.ClientPackage | None) -> dict[str, str | None]:
    """The commands that connect a computer to this instance, with its public URL
    (``DISPATCH_PUBLIC_URL``): install the newest shim wheel served at ``/downloads/``
    (``None`` when there is none), log in (device flow), run, or install as a service
    (``service install`` takes ``run``'s options)."""
    server = settings.PUBLIC_URL
    install = None
    if served_shim is not None:
        install = f"pipx install {server}{reverse('download', args=[served_shim.filename])}"
    return {
        "install": install,
        "login": f"dispatch-shim login --server {server}",
        "run": f"dispatch-shim run --root {EXAMPLE_ROOT}",
        "service": f"dispatch-shim service install --root {EXAMPLE_ROOT}",
    }


@require_GET
def machines_page(request: HttpRequest) -> HttpResponse:
    """``/machines/``: machines with live status and shim version, the default selector,
    revoke, recent audit, the commands that connect another computer, and the live
    panels (Run, operations in flight, Copy) over the machines attached to
    ``RUN_SESSION``."""
    served_shim = downloads.newest_wheel(downloads.SHIM)
    context = _context(request, served_shim)
    context["connect"] = _connect_commands(served_shim)
    targets = _run_targets(context["machines"], context["default_machine_id"])  # type: ignore[arg-type]
    context["run"] = {"session_id": RUN_SESSION, "targets": targets}
    return render(request, "machines/machines.html", context)


@htmx_login_required
@require_GET
def machines_fragment(request: HttpRequest) -> HttpResponse:
    """The machine list and audit, polled by htmx so status changes show without reload.

    ``version`` (the version the page shows) equal to the current one → 204: htmx swaps
    nothing, so a form being edited in the list is left alone.
    """
    context = _context(request, downloads.newest_wheel(downloads.SHIM))
    if request.GET.get("version") == context["version"]:
        return HttpResponse(status=204)
    return render(request, "machines/_machine_list.html", context)


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
def machine_capabilities(request: HttpRequest, machine_id: str) -> HttpResponse:
    """Which capabilities the machine may be granted (checkboxes ``shell``, ``files``)."""
    try:
        machine = connections.machine_capabilities_set(
            user=authenticated_user(request), machine_id=machine_id, allowed=request.POST.getlist("capability")
        )
    except DispatchError as exc:
        messages.error(request, exc.message)
    else:
        allowed = ", ".join(machine.allowed_capabilities) or "nothing"
        messages.success(
            request, f"{machine.name} may use: {allowed} (a widened grant applies when its shim reconnects)."
        )
    return redirect("machines")


@require_POST
def machine_default(request: HttpRequest) -> HttpResponse:
    """The "Make default" button: ``machine_id`` (empty clears the default)."""
    machine_id = request.POST.get("machine_id") or None
    try:
        router.default_machine_set(user=authenticated_user(request), machine=machine_id)
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
