from __future__ import annotations

from django.apps import AppConfig


class MachinesConfig(AppConfig):
    """Machines (spec/machines.md); built in a later issue."""

    name = "machines"

    def ready(self) -> None:
        from core.services import PROCESSES_GONE_HOOKS
        from machines.services.connections import shim_connections_of_processes_closed

        # The reaper closes a dead process's machine connections as a clean disconnect does.
        if shim_connections_of_processes_closed not in PROCESSES_GONE_HOOKS:
            PROCESSES_GONE_HOOKS.append(shim_connections_of_processes_closed)
