"""Reads of the machines app, always scoped to the caller."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.db.models import OuterRef, QuerySet, Subquery

from machines.models import AuditRecord, Machine, MachineConnection


def machines_for(*, user: User) -> QuerySet[Machine]:
    """``user``'s machines that are not revoked, by name."""
    return Machine.objects.filter(user=user, revoked_at__isnull=True).order_by("display_name", "hostname")


def audit_records_for(*, user: User, limit: int = 50) -> QuerySet[AuditRecord]:
    """``user``'s most recent audit records, newest first, each with ``machine_name``: the
    name of the machine it ran on (``Machine.name``; a revoked machine's too), ``None`` when
    no machine of theirs has that id (an operation refused before one was chosen)."""
    machine = Machine.objects.filter(user=OuterRef("user"), machine_id=OuterRef("machine_id"))
    name = Subquery(machine.annotate(shown_name=Machine.name_expression()).values("shown_name")[:1])
    return AuditRecord.objects.filter(user=user).annotate(machine_name=name).order_by("-ts")[:limit]


def shim_connections_held_by(*, server_process_id: str) -> int:
    """How many shim connections the process ``server_process_id`` holds, counted from the
    rows (``/metrics``)."""
    return MachineConnection.objects.filter(server_process_id=server_process_id).count()
