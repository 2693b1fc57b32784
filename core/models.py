"""Core models: the instance identity, server processes (presence) and API tokens."""

from __future__ import annotations

import secrets
import socket

from django.conf import settings
from django.db import models
from django.utils import timezone


def new_instance_id() -> str:
    """``inst_`` + 12 lowercase hex (docs/README.md#words-used-throughout)."""
    return "inst_" + secrets.token_hex(6)


def default_instance_name() -> str:
    """The host name, the display name an instance starts with."""
    return socket.gethostname()[:100] or "dispatch"


class InstanceIdentity(models.Model):
    """The singleton row naming this instance (pk is always 1; created by migration 0001)."""

    instance_id = models.CharField(max_length=17, unique=True, default=new_instance_id)
    display_name = models.CharField(max_length=100, default=default_instance_name)
    created_at = models.DateTimeField(default=timezone.now)
    # The instance's Ed25519 key pair (docs/peers.md#authentication), created on first use
    # (peers.keys): the raw public key (base64url, no padding) and the raw private key
    # encrypted with MultiFernet over DISPATCH_ENCRYPTION_KEYS.
    public_key = models.CharField(max_length=64, blank=True)
    private_key_encrypted = models.TextField(blank=True)

    class Meta:
        db_table = "dispatch_instanceidentity"  # its name from the `dispatch` app (docs/architecture.md)
        verbose_name = "instance identity"
        verbose_name_plural = "instance identity"

    def __str__(self) -> str:
        return f"{self.display_name} ({self.instance_id})"


STOPPED_MARKER_SECONDS = 60.0
"""How long the row of a cleanly stopped process stays as its stopped marker (seconds)."""


class ServerProcess(models.Model):
    """One running ``serve`` or ``dispatch_worker`` process (docs/deployment.md#what-runs-where).

    Alive while ``heartbeat_at`` is younger than ``DISPATCH_PROCESS_TTL``. Live connection
    rows point here with ``on_delete=CASCADE``: reaping a dead process forgets them.

    A process that stops cleanly leaves a *stopped marker*: its row, holding nothing, with
    ``stopped_at`` set, for ``STOPPED_MARKER_SECONDS``. It tells a caller whose cached route
    still names the process that the process answered every call it forwarded before it
    went, so an unanswered call never ran and may go to the remote's new session
    (docs/deploy.md#rolling-restart). A reaped process leaves no marker: its calls' fate is unknown.
    """

    class Kind(models.TextChoices):
        SERVE = "serve"
        WORKER = "worker"
        TEST = "test"

    id = models.CharField(primary_key=True, max_length=40)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    started_at = models.DateTimeField(default=timezone.now)
    heartbeat_at = models.DateTimeField(default=timezone.now, db_index=True)
    # Set when the process stopped cleanly (``server_process_unregister``): the row stays a
    # while as a marker, holding nothing, its heartbeat at STOPPED_HEARTBEAT (never alive).
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "dispatch_serverprocess"  # its name from the `dispatch` app (docs/architecture.md)
        verbose_name = "server process"
        verbose_name_plural = "server processes"  # Django's default appends "s": "server processs"

    def __str__(self) -> str:
        return f"{self.id} ({self.kind} pid {self.pid} on {self.hostname})"


class ApiToken(models.Model):
    """A user API token (docs/ws-protocol.md#authentication).

    Only the SHA-256 hex ``digest`` and an 8-character display ``prefix`` are stored; the
    token itself is shown once at creation.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=8)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "dispatch_apitoken"  # its name from the `dispatch` app (docs/architecture.md)
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name or 'unnamed'})"

    @property
    def is_active(self) -> bool:
        """Neither revoked nor expired."""
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()


# --- agents (docs/agents.md) ----------------------------------------------------------------------
