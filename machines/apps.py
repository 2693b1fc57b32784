from __future__ import annotations

from django.apps import AppConfig


class MachinesConfig(AppConfig):
    """Machines (spec/machines.md); built in a later issue."""

    name = "machines"
