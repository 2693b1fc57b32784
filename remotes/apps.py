from __future__ import annotations

from django.apps import AppConfig


class RemotesConfig(AppConfig):
    """Remotes: functions users serve over the ``/ws`` session protocol (docs/ws-protocol.md)."""

    name = "remotes"

    def ready(self) -> None:
        from core.services import processes_gone_hook_register
        from remotes.hooks import remotes_of_processes_gone

        # A reaped process's remotes leave their owners' tool lists (MCP list_changed).
        processes_gone_hook_register(remotes_of_processes_gone)
        from core.revocation import cookie_session_keys_register, ended_connections_register
        from remotes.hooks import cookie_session_keys, ws_sessions_ended

        # The revocation sweep closes /ws sessions whose credential ended.
        ended_connections_register(ws_sessions_ended)
        cookie_session_keys_register(cookie_session_keys)
