"""Linked instances (docs/peers.md): peers, pairing offers, receipts, the outbox, leases.

A ``Peer`` row holds both directions of one link (docs/peers.md#pairing): the hash of the token
this instance issued to the peer (``inbound_digest``: the peer presents it here, with
the capabilities we granted in ``allow_*``), and the token the peer issued to us,
encrypted at rest (``outbound_token_encrypted``: we present it there; what the peer
granted us, as it reported, is ``granted_by_peer``). Re-pairing rotates both in place.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.db.models.functions import Lower
from django.utils import timezone

# A peer last seen longer ago than this is "not responding recently" (on /peers/ and in the
# launch tool's description, docs/peers.md#using-a-link).
NOT_RESPONDING_AFTER = timedelta(minutes=5)


class Peer(models.Model):
    """Another Dispatch instance linked to this one, acting for one local user (``owner``)."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="peers")
    instance_id = models.CharField(max_length=17)  # the peer's inst_ id
    label = models.CharField(max_length=64)  # what this instance calls it (docs/peers.md#labels)
    reported_name = models.CharField(max_length=100, blank=True)  # what it calls itself
    url = models.CharField(max_length=2048)
    public_key = models.CharField(max_length=64)  # raw Ed25519 public key, base64url without padding
    fingerprint = models.CharField(max_length=39)  # SHA-256 of the raw key, 8 groups of 4 hex
    # Inbound: the token this instance issued to the peer, and what it may do here (docs/peers.md#permissions).
    inbound_digest = models.CharField(max_length=64, unique=True)
    inbound_prefix = models.CharField(max_length=8)
    allow_launch = models.BooleanField(default=True)
    allow_message = models.BooleanField(default=True)
    allow_full_access = models.BooleanField(default=False)
    allow_events = models.BooleanField(default=True)
    # Outbound: the token the peer issued to us (Fernet over DISPATCH_ENCRYPTION_KEYS).
    outbound_token_encrypted = models.TextField()
    granted_by_peer = models.JSONField(default=dict, blank=True)  # the peer's flags for us, as reported
    protocol_version = models.PositiveIntegerField(default=2)
    # What the peer announced it can do (``peers.keys.PEER_FEATURES`` names): from the
    # pairing claim or its answer, then from the ``Dispatch-Peer-Features`` header of every
    # peer request it sends and every answer it gives (``links.peer_features_record``).
    features = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_reason = models.CharField(max_length=200, blank=True)
    unlinked_by_peer = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                Lower("label"), condition=models.Q(revoked_at__isnull=True), name="peer_live_label_unique"
            ),
            models.UniqueConstraint(
                fields=["instance_id"], condition=models.Q(revoked_at__isnull=True), name="peer_live_instance_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.label} ({self.instance_id})"

    @property
    def is_live(self) -> bool:
        """Not revoked (by us or, as far as we know, by the peer)."""
        return self.revoked_at is None

    def responding(self, now: datetime | None = None) -> bool:
        """Whether the peer was seen (``last_seen_at``: its stream connected) within
        ``NOT_RESPONDING_AFTER`` of ``now`` (default: now); never seen is not responding."""
        now = now or timezone.now()
        return self.last_seen_at is not None and now - self.last_seen_at <= NOT_RESPONDING_AFTER

    def announces(self, feature: str) -> bool:
        """Whether the peer announced ``feature`` (e.g. ``messages.batch``) when last heard from."""
        return isinstance(self.features, list) and feature in self.features

    def launch_refusal(self) -> str:
        """Why launching on this peer cannot be chosen, ``""`` when it can: "unlinked by the
        other side" (it revoked the link), else "launching not permitted" (it
        reported ``allow_launch: false`` in ``granted_by_peer``)."""
        if self.unlinked_by_peer:
            return "unlinked by the other side"
        if isinstance(self.granted_by_peer, dict) and self.granted_by_peer.get("allow_launch") is False:
            return "launching not permitted"
        return ""


class PairingOffer(models.Model):
    """A pairing code this instance showed (docs/peers.md#pairing): hashed, 10 minutes, single use."""

    code_digest = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="pairing_offers_made"
    )
    link_user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="pairing_offers")
    allow_launch = models.BooleanField(default=True)
    allow_message = models.BooleanField(default=True)
    allow_full_access = models.BooleanField(default=False)
    allow_events = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    burned_at = models.DateTimeField(null=True, blank=True)
    peer = models.ForeignKey(Peer, null=True, blank=True, on_delete=models.SET_NULL, related_name="offers")

    def __str__(self) -> str:
        return f"pairing offer {self.pk} for {self.link_user_id}"


class PeerReceipt(models.Model):
    """What this instance answered to a peer's state-changing request, by ``Idempotency-Key``
    (docs/peers.md#authentication): a repeated key gets the first answer; another body under it is 422."""

    peer = models.ForeignKey(Peer, on_delete=models.CASCADE, related_name="receipts")
    idempotency_key = models.CharField(max_length=100)
    route = models.CharField(max_length=40)  # launch, messages, stop, archive
    body_digest = models.CharField(max_length=64)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)  # null while in progress
    response_body = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["peer", "idempotency_key"], name="peerreceipt_peer_key_unique")]

    def __str__(self) -> str:
        return f"receipt {self.idempotency_key} from {self.peer_id}"


def new_idempotency_key() -> str:
    """A fresh ``Idempotency-Key``: a UUID4 string."""
    return str(uuid.uuid4())


class OutboxMessage(models.Model):
    """A message on its way to a peer (docs/peers.md#the-outbox): written with its ``AgentMessage`` in one
    transaction, drained in order per peer, retried with backoff, dead-lettered by age or
    at once on a permanent failure."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        DELIVERED = "delivered"
        DEAD = "dead"
        DISCARDED = "discarded"

    peer = models.ForeignKey(Peer, on_delete=models.CASCADE, related_name="outbox")
    message = models.OneToOneField("agents.AgentMessage", on_delete=models.CASCADE, related_name="outbox")
    idempotency_key = models.CharField(max_length=100, default=new_idempotency_key, unique=True)
    to_agent_id = models.CharField(max_length=64)  # the agent's id on the peer
    payload = models.JSONField()  # the POST /api/v1/peers/messages body
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    dead_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["peer", "status", "created_at", "id"], name="outbox_peer_status_created")]

    def __str__(self) -> str:
        return f"outbox {self.pk} to {self.peer_id} ({self.status})"


class PeerLease(models.Model):
    """A short lease on per-peer background work (``kind``: ``subscribe`` — the mirroring
    stream; ``drain`` — the outbox), so one process at a time does it."""

    peer = models.ForeignKey(Peer, on_delete=models.CASCADE, related_name="leases")
    kind = models.CharField(max_length=10)
    holder = models.CharField(max_length=40)
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["peer", "kind"], name="peerlease_peer_kind_unique")]

    def __str__(self) -> str:
        return f"{self.kind} lease of {self.peer_id} held by {self.holder}"
