"""The Linked instances page ``/peers/`` (docs/peers.md#pairing): four cards.

1. *This instance* — name (editable by staff), instance id, fingerprint, public URL, repo roots;
2. *Accept a connection* (staff) — capability switches, "Act as", "Show pairing code";
3. *Connect to another instance* (staff) — address, code, "Call it…", switches, "Act as", "Link";
4. *Linked* — the user's peers: label (rename; a taken label shows the server's 409
   message), "calls itself X", badges both ways, URL, last seen, outbox counts with
   retry / discard, unlink.

Views translate forms into ``peers.services`` (and ``peers.pairing_exchange``'s exchanges) and
render; they hold no rules. Linking waits on the other instance, so it is an async view (never the shared sync thread).
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from core.errors import DispatchError
from core.views import htmx_login_required
from peers import linked_approvals, pairing_exchange
from peers.models import OutboxMessage, Peer
from peers.selectors import outbox_counts, outbox_rows_for, peers_for
from peers.services import links
from peers.services import pairing as pairing_services
from peers.services.identity import identity_get, instance_rename
from peers.services.outbox import outbox_discard, outbox_retry

SWITCHES = (
    ("allow_launch", "Launch agents here"),
    ("allow_message", "Message agents here"),
    ("allow_full_access", "Allow full access"),
    ("allow_events", "Share latest events"),
)


def _flags_from_form(request: HttpRequest) -> dict[str, bool]:
    """Checkbox switches: present = on. The forms always send ``switches=1`` so an
    unchecked box means off, not "default"."""
    return {name: request.POST.get(name) == "on" for name, _ in SWITCHES}


def _page_context(user: User, **extra: Any) -> dict[str, Any]:
    identity = identity_get()
    peers = list(peers_for(user=user))
    counts = outbox_counts(peer_ids=[peer.pk for peer in peers])
    now = timezone.now()
    rows = []
    for peer in peers:
        granted = peer.granted_by_peer or {}
        rows.append(
            {
                "peer": peer,
                "outbox": counts[peer.pk],
                "outbox_rows": list(outbox_rows_for(user=user, peer_id=peer.pk)[:20])
                if any(counts[peer.pk].values())
                else [],
                "not_responding": not peer.responding(now),
                "here": [(name, label, getattr(peer, name)) for name, label in SWITCHES],
                "there": [(label, granted.get(name)) for name, label in SWITCHES],
            }
        )
    unlinked = list(Peer.objects.filter(owner=user, unlinked_by_peer=True).order_by("-revoked_at")[:10])
    return {
        "identity": identity,
        "repo_roots": list(getattr(settings, "REPO_ROOTS", []) or []),
        "peer_rows": rows,
        "unlinked": unlinked,
        "switches": [(name, label, links.DEFAULT_CAPABILITIES[name]) for name, label in SWITCHES],
        "users": list(User.objects.filter(is_active=True).order_by("username").values_list("username", flat=True))
        if user.is_staff
        else [],
        **extra,
    }


def _render(request: HttpRequest, status: int = 200, **extra: Any) -> HttpResponse:
    user = request.user
    assert isinstance(user, User)
    return render(request, "peers/peers.html", _page_context(user, **extra), status=status)


@never_cache
@require_GET
def peers_page(request: HttpRequest) -> HttpResponse:
    """``GET /peers/``: the four cards (the pairing cards for staff only)."""
    return _render(request)


def _error(request: HttpRequest, exc: DispatchError) -> None:
    messages.error(request, exc.message)


@require_POST
def instance_name(request: HttpRequest) -> HttpResponse:
    """``POST /peers/name`` ``name=…``: rename this instance (staff)."""
    assert isinstance(request.user, User)
    try:
        instance_rename(user=request.user, name=request.POST.get("name", ""))
        messages.success(request, "Instance name saved.")
    except DispatchError as exc:
        _error(request, exc)
    return redirect("peers")


def _link_user(username: str) -> User | None:
    if not username:
        return None
    found = User.objects.filter(username=username, is_active=True).first()
    if found is None:
        raise DispatchError("NOT_FOUND", f"no active user '{username}'")
    return found


@never_cache  # the response shows a pairing code
@require_POST
def offer_create(request: HttpRequest) -> HttpResponse:
    """``POST /peers/offer``: make a pairing offer and show its code, address, fingerprint
    and a 10-minute countdown (staff; 409 for a sixth live offer)."""
    assert isinstance(request.user, User)
    try:
        issued = pairing_services.offer_create(
            user=request.user, link_user=_link_user(request.POST.get("as_user", "")), **_flags_from_form(request)
        )
    except DispatchError as exc:
        return _render(request, status=exc.http_status, offer_error=exc.message)
    return _render(request, offer=issued)


def _safe_next(request: HttpRequest) -> str | None:
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        return target
    return None


@never_cache
@require_POST
async def link_create(request: HttpRequest) -> HttpResponse:
    """``POST /peers/link``: link to another instance with its code (staff); shows both
    fingerprints. Async: it waits on the other instance. A ``next`` field (the admin's
    link form) redirects there with a message instead."""
    user = await request.auser()
    assert isinstance(user, User)
    post = request.POST
    label = post.get("label", "").strip() or None
    next_url = _safe_next(request)
    try:
        result = await pairing_exchange.peer_link(
            user=user,
            url=post.get("url", ""),
            code=post.get("code", ""),
            label=label,
            as_user=post.get("as_user", "") or None,
            **_flags_from_form(request),
        )
    except DispatchError as exc:
        if next_url:
            await database_sync_to_async(messages.error)(request, f"Link failed: {exc.message}")
            return redirect(next_url)
        return await database_sync_to_async(_render)(
            request, status=exc.http_status, link_error=exc.message, link_form=post
        )
    if next_url:
        await database_sync_to_async(messages.success)(
            request,
            f"Linked to {result.peer.label}. Our fingerprint {result.our_fingerprint}, "
            f"theirs {result.their_fingerprint}.",
        )
        return redirect(next_url)
    return await database_sync_to_async(_render)(request, linked=result)


@require_POST
def peer_rename(request: HttpRequest, peer_id: int) -> HttpResponse:
    """``POST /peers/<id>/rename`` ``label=…``; a taken label shows the server's 409 message."""
    assert isinstance(request.user, User)
    try:
        links.peer_rename(user=request.user, peer_id=peer_id, label=request.POST.get("label", ""))
        messages.success(request, "Label saved.")
    except DispatchError as exc:
        return _render(request, status=exc.http_status, rename_error=exc.message, rename_peer_id=peer_id)
    return redirect("peers")


@require_POST
def peer_capabilities(request: HttpRequest, peer_id: int) -> HttpResponse:
    """``POST /peers/<id>/capabilities``: what the peer may do here (the four switches)."""
    assert isinstance(request.user, User)
    try:
        links.peer_capabilities_set(user=request.user, peer_id=peer_id, **_flags_from_form(request))
        messages.success(request, "Permissions saved.")
    except DispatchError as exc:
        _error(request, exc)
    return redirect("peers")


@require_POST
def peer_unlink(request: HttpRequest, peer_id: int) -> HttpResponse:
    """``POST /peers/<id>/unlink``: revoke the link (docs/peers.md#unlinking) and tell the peer, best effort."""
    assert isinstance(request.user, User)
    try:
        peer = pairing_exchange.peer_unlink(user=request.user, peer_id=peer_id)
        messages.success(request, f"Unlinked {peer.label}.")
    except DispatchError as exc:
        _error(request, exc)
    return redirect("peers")


@require_POST
def outbox_action(request: HttpRequest, outbox_id: int, action: str) -> HttpResponse:
    """``POST /peers/outbox/<id>/retry|discard`` (operators retry or discard rows, docs/peers.md#the-outbox)."""
    assert isinstance(request.user, User)
    try:
        row: OutboxMessage = (outbox_retry if action == "retry" else outbox_discard)(
            user=request.user, outbox_id=outbox_id
        )
        messages.success(request, f"Message {row.pk}: {row.status}.")
    except DispatchError as exc:
        _error(request, exc)
    return redirect("peers")


@never_cache
@htmx_login_required
@require_GET
async def approvals_linked(request: HttpRequest) -> HttpResponse:
    """``/approvals/linked``: the part of the Approvals page that lists the user's pending
    approvals on every linked instance (``linked_approvals.linked_approvals_for``: all
    asked at once, a few seconds at most; a peer that is down is one line "instance X:
    unreachable"). Async: it waits on the other instances, never on the shared sync thread."""
    user = await request.auser()
    assert isinstance(user, User)
    parts = await linked_approvals.linked_approvals_for(user=user)
    context = {"parts": parts, "back": reverse("approvals")}
    return await database_sync_to_async(render)(request, "approvals/_linked.html", context)


@never_cache
@require_POST
async def approval_linked_answer(request: HttpRequest, peer_id: int, approval_id: str) -> HttpResponse:
    """``POST /approvals/linked/<peer id>/<approval id>/answer`` ``decision``, ``message``,
    ``next``: answer an approval on a linked instance through its peer API
    (``linked_approvals.linked_approval_answer``); the outcome — the peer's "already
    answered (… by bob)", "unreachable" — is a note on the page it came from."""
    user = await request.auser()
    assert isinstance(user, User)
    back = _safe_next(request) or reverse("approvals")
    try:
        answer = await linked_approvals.linked_approval_answer(
            user=user,
            peer_id=peer_id,
            approval_id=approval_id,
            decision=request.POST.get("decision", ""),
            message=request.POST.get("message", ""),
        )
    except DispatchError as exc:
        note = messages.warning if exc.code == "APPROVAL_ANSWERED" else messages.error
        await database_sync_to_async(note)(request, exc.message)
        return redirect(back)
    await database_sync_to_async(messages.success)(
        request, f"Answered on the linked instance: {answer.get('decision', '')} ({answer.get('answered_by', '')})."
    )
    return redirect(back)


urlpatterns: list[URLPattern] = [
    path("peers/", peers_page, name="peers"),
    path("approvals/linked", approvals_linked, name="approvals-linked"),
    path(
        "approvals/linked/<int:peer_id>/<str:approval_id>/answer",
        approval_linked_answer,
        name="approvals-linked-answer",
    ),
    path("peers/name", instance_name, name="peers-instance-name"),
    path("peers/offer", offer_create, name="peers-offer"),
    path("peers/link", link_create, name="peers-link"),
    path("peers/<int:peer_id>/rename", peer_rename, name="peers-rename"),
    path("peers/<int:peer_id>/capabilities", peer_capabilities, name="peers-capabilities"),
    path("peers/<int:peer_id>/unlink", peer_unlink, name="peers-unlink"),
    path("peers/outbox/<int:outbox_id>/retry", outbox_action, {"action": "retry"}, name="peers-outbox-retry"),
    path("peers/outbox/<int:outbox_id>/discard", outbox_action, {"action": "discard"}, name="peers-outbox-discard"),
]
