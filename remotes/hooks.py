"""What the remotes app registers with the kernel: what to do when server processes are
deleted (``core.services.PROCESSES_GONE_HOOKS``) and how the revocation sweep finds ended
``/ws`` sessions (``core.revocation``)."""

from __future__ import annotations

from typing import Any

from django.db.models import Exists, Q, QuerySet

from core.revocation import token_ended
from core.tool_changes import tools_changed_on_commit
from remotes.models import Remote, WsSession


def remotes_of_processes_gone(process_ids: list[str]) -> None:
    """Ring the tool-list doorbell (docs/mcp.md#tool-list-changes) of every user with a
    remote held by these processes, whose rows go by cascade with them (reaped or
    unregistered). Runs in the deleting transaction; the ring goes after commit."""
    users = set(Remote.objects.filter(server_process_id__in=process_ids).values_list("user_id", flat=True))
    tools_changed_on_commit(users)


def ws_sessions_ended(process_id: str, now: Any, session_alive: Exists | None) -> QuerySet[Any]:
    """The channels of this process's ``/ws`` sessions whose credential ended
    (``core.revocation.ended_connections_register``): header/token logins whose
    ``ApiToken`` is revoked, expired or deleted, cookie logins whose Django session is gone
    or expired, an inactive user."""
    token_methods = [WsSession.AuthMethod.HEADER, WsSession.AuthMethod.TOKEN]
    ended: Any = Q(user__is_active=False) | (
        Q(auth_method__in=token_methods) & (Q(api_token__isnull=True) | token_ended("api_token__", now))
    )
    if session_alive is not None:
        ended |= Q(auth_method=WsSession.AuthMethod.COOKIE) & ~session_alive
    return WsSession.objects.filter(server_process_id=process_id).filter(ended).order_by().values_list("channel_name")


def cookie_session_keys(user_ids: list[int]) -> QuerySet[Any]:
    """The Django session keys the users' cookie ``/ws`` sessions stand on
    (``core.revocation.cookie_session_keys_register``: a password change ends them)."""
    return WsSession.objects.filter(user_id__in=user_ids, auth_method=WsSession.AuthMethod.COOKIE).values("session_key")
