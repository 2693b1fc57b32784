"""Admin for linked instances; every change goes through a service.

Peers: list, filters, search; hashes and prefixes read-only (the encrypted outbound token
is never shown); label and capability edits through ``links.peer_admin_update``;
actions "revoke peer" (``pairing_exchange.peer_revoke_admin``) and "rotate credentials". The Peer
list links to a pairing page (``admin/peers/peer/pairing/``) that makes an offer and shows
its code, and links with a code (the form posts to the async ``/peers/link`` view, which
comes back here).
Pairing offers, receipts and leases are read-only; outbox rows have retry and discard.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth.models import User
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from core.errors import DispatchError
from peers import pairing_exchange
from peers.models import OutboxMessage, PairingOffer, Peer, PeerLease, PeerReceipt
from peers.services import links
from peers.services.outbox import outbox_discard, outbox_retry
from peers.services.pairing import offer_create


class LiveFilter(admin.SimpleListFilter):
    title = "link"
    parameter_name = "live"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "live"), ("no", "revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(revoked_at__isnull=True)
        if self.value() == "no":
            return queryset.filter(revoked_at__isnull=False)
        return queryset


class PeerForm(forms.ModelForm):
    class Meta:
        model = Peer
        fields = ["label", *links.CAPABILITIES]

    def clean_label(self) -> str:
        try:
            return links.label_validate(self.cleaned_data.get("label"))
        except DispatchError as exc:
            raise forms.ValidationError(exc.message) from None


@admin.register(Peer)
class PeerAdmin(admin.ModelAdmin):
    form = PeerForm
    change_list_template = "peers/admin_peer_change_list.html"
    list_display = [
        "label",
        "reported_name",
        "instance_id",
        "owner",
        "url",
        "is_live",
        "unlinked_by_peer",
        "allow_launch",
        "allow_message",
        "allow_full_access",
        "allow_events",
        "last_seen_at",
        "created_at",
    ]
    list_filter = [LiveFilter, "unlinked_by_peer", "allow_launch", "allow_message", "allow_full_access", "owner"]
    search_fields = ["label", "reported_name", "instance_id", "url", "fingerprint", "inbound_prefix"]
    readonly_fields = [
        "owner",
        "instance_id",
        "reported_name",
        "url",
        "fingerprint",
        "public_key",
        "inbound_digest",
        "inbound_prefix",
        "granted_by_peer",
        "protocol_version",
        "created_at",
        "updated_at",
        "last_seen_at",
        "revoked_at",
        "revoked_reason",
        "unlinked_by_peer",
    ]
    actions = ["revoke", "rotate_credentials"]

    @admin.display(boolean=True, description="live")
    def is_live(self, obj: Peer) -> bool:
        return obj.is_live

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # peers are made by pairing (the pairing page)

    def save_model(self, request: HttpRequest, obj: Peer, form: Any, change: bool) -> None:
        flags = {name: form.cleaned_data[name] for name in links.CAPABILITIES}
        try:
            links.peer_admin_update(peer=obj, label=form.cleaned_data["label"], **flags)
        except DispatchError as exc:
            obj.refresh_from_db()
            self.message_user(request, exc.message, messages.ERROR)

    @admin.action(description="Revoke peer (unlink and tell it)")
    def revoke(self, request: HttpRequest, queryset: QuerySet[Peer]) -> None:
        actor = request.user
        assert isinstance(actor, User)
        revoked = [
            pairing_exchange.peer_revoke_admin(peer=peer, actor=actor)
            for peer in queryset.filter(revoked_at__isnull=True)
        ]
        self.message_user(request, f"Revoked {len(revoked)} peer(s).")

    @admin.action(description="Rotate credentials (re-encrypt under the newest key)")
    def rotate_credentials(self, request: HttpRequest, queryset: QuerySet[Peer]) -> None:
        rotated = 0
        for peer in queryset:
            try:
                links.peer_credentials_rotate(peer=peer)
                rotated += 1
            except Exception as exc:  # SecretUnreadable: name the peer, keep going
                self.message_user(request, f"{peer.label}: {exc}", messages.ERROR)
        self.message_user(request, f"Re-encrypted the credentials of {rotated} peer(s).")

    def get_urls(self) -> list[URLPattern]:
        pairing_url = path("pairing/", self.admin_site.admin_view(self.pairing_view), name="peers_peer_pairing")
        return [pairing_url, *super().get_urls()]

    def pairing_view(self, request: HttpRequest) -> HttpResponse:
        """Make a pairing offer (shows its code) and link with a code, like the page's cards.
        (``admin_view`` adds ``never_cache``: the page shows a code.)"""
        user = request.user
        assert isinstance(user, User)
        issued = None
        if request.method == "POST":
            as_user = User.objects.filter(username=request.POST.get("as_user", ""), is_active=True).first()
            flags = {name: request.POST.get(name) == "on" for name in links.CAPABILITIES}
            try:
                issued = offer_create(user=user, link_user=as_user, **flags)
            except DispatchError as exc:
                self.message_user(request, exc.message, messages.ERROR)
        context = {
            **self.admin_site.each_context(request),
            "title": "Pairing",
            "opts": self.model._meta,
            "offer": issued,
            "switches": [(name, links.DEFAULT_CAPABILITIES[name]) for name in links.CAPABILITIES],
            "users": list(User.objects.filter(is_active=True).order_by("username").values_list("username", flat=True)),
            "link_url": reverse("peers-link"),
            "back_url": reverse("admin:peers_peer_changelist"),
        }
        return TemplateResponse(request, "peers/admin_pairing.html", context)


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(PairingOffer)
class PairingOfferAdmin(ReadOnlyAdmin):
    list_display = ["pk", "link_user", "created_by", "created_at", "expires_at", "used_at", "burned_at", "peer"]
    list_filter = ["used_at", "burned_at"]
    search_fields = ["link_user__username", "created_by__username"]


@admin.register(PeerReceipt)
class PeerReceiptAdmin(ReadOnlyAdmin):
    list_display = ["idempotency_key", "peer", "route", "response_status", "created_at"]
    list_filter = ["route", "response_status"]
    search_fields = ["idempotency_key", "peer__label"]


@admin.register(PeerLease)
class PeerLeaseAdmin(ReadOnlyAdmin):
    list_display = ["peer", "kind", "holder", "expires_at"]
    list_filter = ["kind"]


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    list_display = ["pk", "peer", "to_agent_id", "status", "attempts", "next_attempt_at", "created_at", "last_error"]
    list_filter = ["status", "peer"]
    search_fields = ["idempotency_key", "to_agent_id", "peer__label", "last_error"]
    actions = ["retry", "discard"]

    def _apply(self, request: HttpRequest, queryset: QuerySet[OutboxMessage], action: str) -> None:
        user = request.user
        assert isinstance(user, User)
        service = outbox_retry if action == "retry" else outbox_discard
        done = 0
        for row in queryset:
            try:
                service(user=user, outbox_id=row.pk)
                done += 1
            except DispatchError as exc:
                self.message_user(request, exc.message, messages.WARNING)
        self.message_user(request, f"{action.capitalize()}: {done} row(s).")

    @admin.action(description="Retry (queue again)")
    def retry(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        self._apply(request, queryset, "retry")

    @admin.action(description="Discard (never send)")
    def discard(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        self._apply(request, queryset, "discard")
