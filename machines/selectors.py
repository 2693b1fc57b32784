"""Reads of the machines app, always scoped to the caller."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.db.models import QuerySet

from machines.models import AuditRecord, Machine, MachineConnection


def machines_for(*, user: User) -> QuerySet[Machine]:
    """``user``'s machines that are not revoked, by name."""
    return Machine.objects.filter(user=user, revoked_at__isnull=True).order_by("display_name", "hostname")


def audit_records_for(*, user: User, limit: int = 50) -> QuerySet[AuditRecord]:
    """``user``'s most recent audit records, newest first."""
    return AuditRecord.objects.filter(user=user).order_by("-ts")[:limit]


def shim_connections_held_by(*, server_process_id: str) -> int:
    """How many shim connections the process ``server_process_id`` holds, counted from the
    rows (``/metrics``)."""
    return MachineConnection.objects.filter(server_process_id=server_process_id).count()
