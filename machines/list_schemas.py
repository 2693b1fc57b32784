"""The machines as the REST routes list them (``GET /api/v1/machines``, a session's
machines): the answers' models (docs/shim-protocol.md#machine-status)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, JsonValue

from core.validation import UtcDateTime

if TYPE_CHECKING:
    from machines import models


class MachineStatus(BaseModel):
    """A machine's two-axis status: ``connection`` (``connected`` | ``disconnected`` | …),
    ``health`` and the ``reason`` shown beside them (``machines.selectors.machine_status``)."""

    connection: str
    health: str
    reason: str


class MachineData(BaseModel):
    """One of the caller's machines (``GET /api/v1/machines``, ``DELETE …/{machine_id}``):
    ``display_name`` is its name (the display name it was given, else its host name);
    ``capabilities`` what its shim advertised, ``granted_capabilities`` what it may use;
    ``last_active_at`` its last routed operation (ISO 8601 in UTC, ``…Z``; ``null`` before
    any), ``created_at`` its first login."""

    machine_id: str
    display_name: str
    hostname: str
    platform: str
    arch: str
    capabilities: list[str]
    granted_capabilities: list[str]
    allowed_roots: list[str]
    status: MachineStatus
    is_default: bool
    last_active_at: UtcDateTime | None
    created_at: UtcDateTime

    @classmethod
    def from_row(cls, machine: models.Machine, *, default_machine_id: str | None = None) -> MachineData:
        """The answer for a ``machines.models.Machine`` row; ``is_default`` when its id is
        ``default_machine_id`` (``machines.services.router.default_machine_id``)."""
        return cls(
            machine_id=machine.machine_id,
            display_name=machine.name,
            hostname=machine.hostname,
            platform=machine.platform,
            arch=machine.arch,
            capabilities=machine.capabilities,
            granted_capabilities=machine.granted_capabilities,
            allowed_roots=machine.allowed_roots,
            status=MachineStatus(
                connection=machine.connection_status, health=machine.health, reason=machine.status_reason
            ),
            is_default=machine.machine_id == default_machine_id,
            last_active_at=machine.last_active_at,
            created_at=machine.created_at,
        )


class MachineList(BaseModel):
    """``GET /api/v1/machines``: ``{"machines": [machine, …]}``."""

    machines: list[MachineData]


def _text(value: Any) -> Any:
    # A snapshot is what a shim sent in MACHINE_LIST_RESPONSE, stored as it came: its text
    # fields are written as text whatever they hold (a shim's 5 as "5"), so one odd shim
    # cannot break the session's list.
    return value if value is None or isinstance(value, str) else str(value)


class SessionMachineData(BaseModel):
    """One machine attached to a session, as ``GET /api/v1/sessions/{session_id}/machines``
    answers it (``machines.selectors.attached_machines``): what its shim reports
    (``MACHINE_LIST_RESPONSE``: ``hostname``, ``platform``, ``arch``, ``capabilities``,
    ``hardware_devices``, each left out when the shim did not say it) plus its name
    (``display_name``), ``status``, whether it is the default and ``last_active_at`` (ISO
    8601 in UTC, like every REST machine route; the ``list_machines`` tool says
    ``last_active_ts``, epoch seconds). Dump with ``exclude_unset=True``."""

    machine_id: str
    display_name: str
    hostname: str | None = None
    platform: str | None = None
    arch: str | None = None
    capabilities: JsonValue = Field(default=None, description="as the shim reported them (a list of names)")
    hardware_devices: JsonValue = Field(default=None, description="as the shim reported them")
    status: MachineStatus
    is_default: bool
    last_active_at: UtcDateTime | None

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> SessionMachineData:
        """The answer for one entry of ``attached_machines`` (its other keys left out)."""
        given = {name: entry[name] for name in cls.model_fields if name in entry}
        for name in ("machine_id", "display_name", "hostname", "platform", "arch"):
            if name in given:
                given[name] = _text(given[name])
        return cls(**given)


class SessionMachines(BaseModel):
    """``GET /api/v1/sessions/{session_id}/machines``: ``{"machines": [machine, …]}``, by name."""

    machines: list[SessionMachineData]
