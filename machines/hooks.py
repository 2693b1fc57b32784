"""What the machines app registers with the kernel: how the revocation sweep finds machine
connections whose credential ended (``core.revocation``)."""

from __future__ import annotations

from typing import Any

from django.db.models import Exists, Q, QuerySet

from core.revocation import token_ended
from machines.models import MachineConnection


def machine_connections_ended(process_id: str, now: Any, session_alive: Exists | None) -> QuerySet[Any]:
    """The channels of this process's shim connections whose credential ended
    (``core.revocation.ended_connections_register``): the machine token revoked, the API
    token revoked or expired, an inactive user."""
    return (
        MachineConnection.objects.filter(server_process_id=process_id)
        .filter(Q(user__is_active=False) | Q(machine_token__revoked_at__isnull=False) | token_ended("api_token__", now))
        .order_by()
        .values_list("channel_name")
    )
