from __future__ import annotations

from django.apps import AppConfig


class MachinesConfig(AppConfig):
    """Machines: the shims on users' computers and the operations routed to them (docs/shim-protocol.md)."""

    name = "machines"

    def ready(self) -> None:
        from core.services import processes_gone_hook_register
        from machines.services.connections import shim_connections_of_processes_closed

        # The reaper closes a dead process's machine connections as a clean disconnect does
        # (which also rings the owners' tool lists).
        processes_gone_hook_register(shim_connections_of_processes_closed)
        from machines.services.inflight import operations_of_processes_cancelled

        # ... and cancels the commands its operations in flight still run on the shims
        # (their caller is gone: nothing else would stop them before their timeout).
        processes_gone_hook_register(operations_of_processes_cancelled)
        from core.revocation import ended_connections_register
        from machines.hooks import machine_connections_ended

        # The revocation sweep closes shim connections whose credential ended.
        ended_connections_register(machine_connections_ended)
