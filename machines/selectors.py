"""Reads of the machines app, always scoped to the caller."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db.models import Count, Max, Min, OuterRef, Q, QuerySet, Subquery

from machines.models import AuditRecord, Machine, MachineConnection, OperationInFlight
from machines.services import router
from machines.services.arguments import check_session_id
from machines.services.copy import PARTIAL_SUFFIX
from machines.services.inflight import pipe_command_ids


def machines_for(*, user: User) -> QuerySet[Machine]:
    """``user``'s machines that are not revoked, by name."""
    return Machine.objects.filter(user=user, revoked_at__isnull=True).order_by("display_name", "hostname")


def audit_records_for(*, user: User, limit: int = 50, own_only: bool = False) -> QuerySet[AuditRecord]:
    """``user``'s most recent audit records, newest first, each with ``machine_name``: the
    name of the machine it ran on (``Machine.name``; a revoked machine's too), ``None`` when
    no machine of theirs has that id (an operation refused before one was chosen).
    ``own_only``: without the steps of copies and pipes (``AuditRecord.operation_id``)."""
    machine = Machine.objects.filter(user=OuterRef("user"), machine_id=OuterRef("machine_id"))
    name = Subquery(machine.annotate(shown_name=Machine.name_expression()).values("shown_name")[:1])
    records = AuditRecord.objects.filter(user=user)
    if own_only:
        records = records.filter(operation_id="")
    return records.annotate(machine_name=name).order_by("-ts")[:limit]


@dataclass(frozen=True)
class MachineShown:
    """A machine as a row names it: ``name`` is ``Machine.name`` (a revoked machine's too),
    ``None`` when no machine of the user has ``machine_id`` (or it is ``""``: refused before
    one was chosen)."""

    machine_id: str
    name: str | None


@dataclass(frozen=True)
class RecentOperation:
    """One row of the Machines page's "Recent operations" (docs/live-operations.md#the-machines-page):
    an operation of its own, or a whole copy or pipe.

    ``kind`` is ``"op"``, ``"copy"`` or ``"pipe"``; ``op`` the operation's name (``COPY``,
    ``PIPE`` for the two others); ``machines`` one machine, or a copy's or pipe's source then
    destination; ``outcome`` ``"ok"``, ``"cancelled"``, ``"exit N"`` (a command's non-zero
    status), ``"timed out"``, an error code, and for a copy also
    ``"running"``, ``"refused"`` (the copy refused after looking at the files: the source
    missing or a directory, the destination there without ``overwrite``) or
    ``"not verified"`` (sizes or SHA-256 differed); ``ts`` when its last record was written;
    ``duration_ms`` its span in milliseconds; ``steps`` how many audit records it stands for;
    ``request_id`` the id to find it by (a copy's or pipe's own id)."""

    key: str
    kind: str
    op: str
    ts: datetime
    machines: list[MachineShown]
    session_id: str
    details: dict[str, Any]
    outcome: str
    duration_ms: int | None
    caller: str
    request_id: str
    steps: int = 1

    @property
    def failed(self) -> bool:
        """Whether the page marks it as a failure (anything but ok, running, cancelled)."""
        return self.outcome not in ("ok", "running", "cancelled")


_CHUNK_OPS = ("FILE_READ", "FILE_WRITE")


def recent_operations_for(*, user: User, limit: int = 30) -> list[RecentOperation]:
    """``user``'s ``limit`` most recent operations, newest first, each copy and pipe as one
    row: their steps' audit records share the copy's or pipe's ``request_id`` in
    ``AuditRecord.operation_id`` (a copy's FILE_STAT/FILE_READ/FILE_WRITE/FILE_MOVE steps, a
    pipe's two commands). Four queries whatever the size of a copy: the records of their
    own, the groups among the recent records, the groups' aggregates with their few
    non-chunk steps, and the machines' names. A copy's outcome is read from its steps
    (see ``RecentOperation``); a pipe is cancelled when its destination was, else failed
    with the first error of an end that was not cancelled."""
    own = list(audit_records_for(user=user, limit=limit, own_only=True))
    recent = AuditRecord.objects.filter(user=user).exclude(operation_id="")
    if len(own) == limit:  # only groups that reach into the window the page shows
        recent = recent.filter(ts__gte=own[-1].ts)
    group_ids = list(
        recent.values("operation_id")
        .annotate(last=Max("ts"))
        .order_by("-last")
        .values_list("operation_id", flat=True)[:limit]
    )
    rows: list[RecentOperation] = [_own_row(record) for record in own]
    if group_ids:
        rows += _group_rows(user=user, operation_ids=group_ids)
    rows.sort(key=lambda row: row.ts, reverse=True)
    return rows[:limit]


def _own_row(record: AuditRecord) -> RecentOperation:
    return RecentOperation(
        key=f"record:{record.pk}",
        kind="op",
        op=record.op,
        ts=record.ts,
        machines=[MachineShown(record.machine_id, getattr(record, "machine_name", None))],
        session_id=record.session_id,
        details=record.details,
        outcome=record.outcome,
        duration_ms=record.result.get("duration_ms"),
        caller=record.caller,
        request_id=record.request_id,
    )


def _group_rows(*, user: User, operation_ids: list[str]) -> list[RecentOperation]:
    """One row per copy or pipe of ``operation_ids`` (see ``recent_operations_for``)."""
    records = AuditRecord.objects.filter(user=user, operation_id__in=operation_ids)
    aggregates = {
        entry["operation_id"]: entry
        for entry in records.values("operation_id").annotate(
            first=Min("ts"),
            last=Max("ts"),
            steps=Count("id"),
            chunks=Count("id", filter=Q(op="FILE_READ")),
            reader=Max("machine_id", filter=Q(op="FILE_READ")),
            writer=Max("machine_id", filter=Q(op="FILE_WRITE")),
        )
    }
    # A copy's chunks are most of its records and say nothing the aggregates do not; a
    # failed one is kept (its error is the copy's).
    steps: dict[str, list[AuditRecord]] = {}
    for record in records.exclude(Q(op__in=_CHUNK_OPS) & Q(result__ok=True)).order_by("ts", "pk"):
        steps.setdefault(record.operation_id, []).append(record)
    running = set(
        str(request_id)
        for request_id in OperationInFlight.objects.filter(user=user, request_id__in=operation_ids).values_list(
            "request_id", flat=True
        )
    )
    machine_ids = {record.machine_id for found in steps.values() for record in found}
    machine_ids |= {str(a[key]) for a in aggregates.values() for key in ("reader", "writer") if a[key]}
    names = {
        machine.machine_id: machine.name for machine in Machine.objects.filter(user=user, machine_id__in=machine_ids)
    }
    rows = []
    for operation_id, aggregate in aggregates.items():
        found = steps.get(operation_id, [])
        if found and all(record.op == "EXECUTE_COMMAND" for record in found) and aggregate["chunks"] == 0:
            rows.append(_pipe_row(operation_id, aggregate, found, names))
        else:
            rows.append(_copy_row(operation_id, aggregate, found, names, running=operation_id in running))
    return rows


def _shown(machine_id: str, names: dict[str, str]) -> MachineShown:
    return MachineShown(machine_id, names.get(machine_id))


def _span_ms(aggregate: dict[str, Any], first_step: AuditRecord | None) -> int:
    """From the start of the first step to the last record, in milliseconds."""
    span = aggregate["last"] - aggregate["first"]
    before = (first_step.result.get("duration_ms") or 0) if first_step is not None else 0
    return round(span.total_seconds() * 1000) + int(before)


def _copy_row(
    operation_id: str,
    aggregate: dict[str, Any],
    steps: list[AuditRecord],
    names: dict[str, str],
    *,
    running: bool,
) -> RecentOperation:
    """A copy (``machines.services.copy``): FILE_STAT of the source, FILE_STAT of the
    destination (without ``overwrite``), FILE_READ/FILE_WRITE chunks into the partial file,
    FILE_STAT of both with hashes, FILE_MOVE into place; FILE_DELETE of the partial file
    when it stopped after writing."""
    source = steps[0] if steps else None
    source_machine = source.machine_id if source is not None else str(aggregate["reader"] or "")
    source_path = str(source.details.get("path", "")) if source is not None else ""
    moves = [r for r in steps if r.op == "FILE_MOVE"]
    deletes = [r for r in steps if r.op == "FILE_DELETE"]
    destination_machine = str(aggregate["writer"] or "")
    destination_path = ""
    if moves:
        destination_machine, destination_path = moves[0].machine_id, str(moves[0].details.get("dst", ""))
    elif deletes:
        destination_machine = deletes[0].machine_id
        destination_path = str(deletes[0].details.get("path", "")).removesuffix(PARTIAL_SUFFIX)
    else:
        looked_at = [r for r in steps[1:] if r.op == "FILE_STAT" and r.details.get("path") != source_path]
        if looked_at:
            destination_machine, destination_path = looked_at[0].machine_id, str(looked_at[0].details.get("path", ""))
    # A step failed without an error code was stopped by the copy itself (the read in flight
    # when it stopped); the partial file's removal failing is not what stopped the copy.
    failures = [r for r in steps if r.result.get("error_code") and r.op != "FILE_DELETE"]
    if failures:
        outcome = str(failures[0].result["error_code"])
    elif moves:
        outcome = "ok"
    elif running:
        outcome = "running"
    elif deletes:
        verified = any(r.op == "FILE_STAT" and str(r.details.get("path", "")).endswith(PARTIAL_SUFFIX) for r in steps)
        outcome = "not verified" if verified else "cancelled"
    else:
        outcome = "refused"
    machines = [_shown(source_machine, names)]
    if destination_machine:
        machines.append(_shown(destination_machine, names))
    details = {"from": source_path, "to": destination_path, "chunks": aggregate["chunks"]}
    anchor = source or (steps[-1] if steps else None)
    return RecentOperation(
        key=f"copy:{operation_id}",
        kind="copy",
        op="COPY",
        ts=aggregate["last"],
        machines=machines,
        session_id=anchor.session_id if anchor is not None else "",
        details=details,
        outcome=outcome,
        duration_ms=_span_ms(aggregate, source),
        caller=anchor.caller if anchor is not None else "",
        request_id=operation_id,
        steps=aggregate["steps"],
    )


def _pipe_row(
    operation_id: str, aggregate: dict[str, Any], steps: list[AuditRecord], names: dict[str, str]
) -> RecentOperation:
    """A pipe (``machines.services.pipe``): its source and destination commands, told apart
    by the ids they were sent under (``pipe_command_ids``). Its outcome: the first end's
    error, else ``cancelled`` when the destination was, else the first end that ran and
    exited non-zero or timed out (``exit N``, ``timed out``), else ``ok``."""
    source_id, destination_id = pipe_command_ids(operation_id)
    ends = {record.request_id: record for record in steps}
    ordered = [ends[i] for i in (source_id, destination_id) if i in ends]
    source, destination = ends.get(source_id), ends.get(destination_id)
    ran = [r for r in ordered if r.outcome == "timed out" or r.outcome.startswith("exit ")]
    failures = [r for r in ordered if r.outcome not in ("ok", "cancelled") and r not in ran]
    if failures:
        outcome = failures[0].outcome
    elif destination is not None and destination.outcome == "cancelled":
        # Cancelling a pipe stops both ends; the source alone is stopped when the destination ends first.
        outcome = "cancelled"
    else:
        outcome = ran[0].outcome if ran else "ok"
    details: dict[str, Any] = {}
    for label, record in (("source", source), ("destination", destination)):
        if record is not None:
            shown = record.details.get("argv") or record.details.get("command") or ""
            details[label] = " ".join(map(str, shown)) if isinstance(shown, list) else str(shown)
            details[f"{label}_exit"] = record.result.get("exit_code")
    first = ordered[0] if ordered else None
    return RecentOperation(
        key=f"pipe:{operation_id}",
        kind="pipe",
        op="PIPE",
        ts=aggregate["last"],
        machines=[_shown(record.machine_id, names) for record in ordered],
        session_id=first.session_id if first is not None else "",
        details=details,
        outcome=outcome,
        duration_ms=max((int(r.result.get("duration_ms") or 0) for r in ordered), default=None),
        caller=first.caller if first is not None else "",
        request_id=operation_id,
        steps=aggregate["steps"],
    )


def shim_connections_held_by(*, server_process_id: str) -> int:
    """How many shim connections the process ``server_process_id`` holds, counted from the
    rows (``/metrics``)."""
    return MachineConnection.objects.filter(server_process_id=server_process_id).count()


def attached_machines(*, user: User, session_id: str) -> list[dict[str, Any]]:
    """Per machine of ``user`` attached to ``session_id``, by name: its snapshot (the cached
    ``MACHINE_LIST_RESPONSE`` payload, else what its ``HELLO`` said) plus
    ``display_name`` (its name), ``last_active_at`` (an aware ``datetime`` of its last
    routed operation, or ``None``), ``status`` and ``is_default``. Each edge renders
    ``last_active_at`` in its own words (REST: ISO 8601; the tool: ``last_active_ts``).
    Raises ``InvalidRequest`` for a malformed ``session_id``."""
    check_session_id(session_id)
    default_id = router.default_machine_id(user=user)
    attached = {c.machine_id for c in router.attached_candidates(user=user, session_id=session_id)}
    snapshots = []
    for machine in Machine.objects.filter(user=user, machine_id__in=attached).order_by("display_name", "hostname"):
        snapshot = machine.snapshot or {
            "machine_id": machine.machine_id,
            "hostname": machine.hostname,
            "display_name": machine.display_name,
            "platform": machine.platform,
            "arch": machine.arch,
            "capabilities": machine.granted_capabilities,
            "hardware_devices": machine.hardware_devices,
        }
        snapshots.append(
            {
                **snapshot,
                # The row's id, whatever the shim's snapshot held (an odd shim must not
                # break the session's list).
                "machine_id": machine.machine_id,
                "display_name": machine.name,
                "last_active_at": machine.last_active_at,
                "status": machine_status(machine),
                "is_default": machine.machine_id == default_id,
            }
        )
    return snapshots


def list_machines(*, user: User, session_id: str) -> list[dict[str, Any]]:
    """The ``list_machines`` tool's answer (docs/mcp.md#tools): ``attached_machines`` with, in
    place of ``last_active_at``, the tool's ``last_active_ts`` (epoch seconds, or ``None``)."""
    listed = []
    for entry in attached_machines(user=user, session_id=session_id):
        listed.append(
            {
                ("last_active_ts" if key == "last_active_at" else key): (
                    value.timestamp() if key == "last_active_at" and value is not None else value
                )
                for key, value in entry.items()
            }
        )
    return listed


def machine_status(machine: Machine) -> dict[str, str]:
    """The two-axis status shown to users (docs/shim-protocol.md#machine-status): connection, health and a reason."""
    return {"connection": machine.connection_status, "health": machine.health, "reason": machine.status_reason}
