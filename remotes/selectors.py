"""Reads of the remotes app, always scoped to the caller."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.db.models import QuerySet

from remotes.models import Remote, WsSession


def remotes_for(*, user: User) -> QuerySet[Remote]:
    """``user``'s connected remotes by name, with their serving ws session."""
    return Remote.objects.filter(user=user).select_related("ws_session").order_by("name")


def remote_list_for(*, user: User) -> list[dict[str, Any]]:
    """The ``remote-list`` entries: one ``{remotename, name, description, parameters}``
    per function of each of ``user``'s connected remotes, by remote then function order."""
    entries: list[dict[str, Any]] = []
    for remotename, tools in Remote.objects.filter(user=user).order_by("name").values_list("name", "tools"):
        for spec in tools:
            entries.append({"remotename": remotename, **spec})
    return entries


def connections_held_by(*, server_process_id: str) -> tuple[int, int]:
    """How many ``/ws`` sessions the process ``server_process_id`` holds, and how many
    remotes they serve: ``(ws sessions, remotes)``, counted from the rows (``/metrics``)."""
    return (
        WsSession.objects.filter(server_process_id=server_process_id).count(),
        Remote.objects.filter(server_process_id=server_process_id).count(),
    )
