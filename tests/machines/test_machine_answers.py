"""The machine answers of the DRF routes (``GET /api/v1/machines``, ``DELETE …/{machine_id}``,
``GET /api/v1/sessions/{session_id}/machines``) are pydantic models
(``machines.list_schemas.MachineData``, ``SessionMachineData``) that write the bytes the DRF
serializers they replaced wrote: the serializers are kept here as the oracle."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer

from machines.list_schemas import MachineData, SessionMachineData, SessionMachines
from machines.models import Machine
from machines.selectors import machine_status

pytestmark = pytest.mark.django_db


class OldMachineSerializer(serializers.Serializer):
    machine_id = serializers.CharField()
    display_name = serializers.CharField(source="name")
    hostname = serializers.CharField()
    platform = serializers.CharField()
    arch = serializers.CharField()
    capabilities = serializers.JSONField()
    granted_capabilities = serializers.JSONField()
    allowed_roots = serializers.JSONField()
    status = serializers.SerializerMethodField()
    is_default = serializers.SerializerMethodField()
    last_active_at = serializers.DateTimeField()
    created_at = serializers.DateTimeField()

    def get_status(self, machine: Any) -> dict[str, str]:
        return {"connection": machine.connection_status, "health": machine.health, "reason": machine.status_reason}

    def get_is_default(self, machine: Any) -> bool:
        return bool(machine.machine_id == self.context.get("default_machine_id"))


class OldSessionMachineSerializer(serializers.Serializer):
    machine_id = serializers.CharField()
    display_name = serializers.CharField()
    hostname = serializers.CharField(required=False)
    platform = serializers.CharField(required=False)
    arch = serializers.CharField(required=False)
    capabilities = serializers.JSONField(required=False)
    hardware_devices = serializers.JSONField(required=False)
    status = serializers.JSONField()
    is_default = serializers.BooleanField()
    last_active_at = serializers.DateTimeField(allow_null=True)


def rendered(data: Any) -> bytes:
    return JSONRenderer().render(data)


def test_a_machine_is_written_as_the_serializer_wrote_it(owner: Any) -> None:
    active = datetime(2026, 3, 4, 5, 6, 7, 891234, tzinfo=timezone(timedelta(hours=2)))
    machines = [
        Machine.objects.create(
            user=owner,
            machine_id="m1",
            hostname="box",
            display_name="Laptop",
            platform="linux",
            arch="x86_64",
            capabilities=["files", "shell"],
            granted_capabilities=["files"],
            allowed_roots=["/home/alice"],
            connection_status=Machine.Connection.CONNECTED,
            status_reason="",
            last_active_at=active,
            created_at=datetime(2026, 1, 1, tzinfo=UTC),
        ),
        Machine.objects.create(user=owner, machine_id="m2"),  # fresh from a device login: blanks, no activity
    ]
    for machine in machines:
        machine.refresh_from_db()
        for default in ("m1", None):
            old = OldMachineSerializer(machine, context={"default_machine_id": default}).data
            new = MachineData.from_row(machine, default_machine_id=default).model_dump(mode="json")
            assert rendered(new) == rendered(old)
    assert MachineData.from_row(machines[0]).model_dump(mode="json")["last_active_at"] == "2026-03-04T03:06:07.891234Z"


def test_a_session_machine_is_written_as_the_serializer_wrote_it(owner: Any) -> None:
    machine = Machine.objects.create(user=owner, machine_id="m1", hostname="box")
    status = machine_status(machine)
    entries: list[dict[str, Any]] = [
        {
            "machine_id": "m1",
            "hostname": "box",
            "display_name": "box",
            "platform": "darwin",
            "arch": "arm64",
            "capabilities": ["files"],
            "hardware_devices": [{"kind": "gpu", "name": "M2"}],
            "something_new": 1,  # a newer shim's field: not listed
            "last_active_at": datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC),
            "status": status,
            "is_default": True,
        },
        # An odd shim's snapshot: fields left out, null, or not text.
        {"machine_id": "m2", "display_name": "m2", "hostname": None, "arch": 64, "capabilities": "files"}
        | {"last_active_at": None, "status": status, "is_default": False},
    ]
    old = {"machines": OldSessionMachineSerializer(entries, many=True).data}
    new = SessionMachines(machines=[SessionMachineData.from_entry(entry) for entry in entries])
    assert rendered(new.model_dump(mode="json", exclude_unset=True)) == rendered(old)
