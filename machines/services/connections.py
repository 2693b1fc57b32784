"""Live shim connections: authentication, attachment, takeover, presence (docs/shim-protocol.md#the-handshake,
docs/shim-protocol.md#presence-and-takeover)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import BooleanField, Exists, ExpressionWrapper, OuterRef, Q, TextField
from django.db.models.functions import Cast
from django.utils import timezone

from core import credential_cache, presence
from core.presence import current_process_id
from core.realtime import layer_send, send_on_commit
from core.revocation import credentials_ended_on_commit
from core.rows import delete_returning
from core.services import AuthenticationFailed, api_token_authenticate, server_process_ensure, token_digest
from core.tool_changes import tools_changed, tools_changed_on_commit
from machines.models import Machine, MachineConnection, MachineToken
from machines.protocol import DEFAULT_LIMITS, Hello, MachineRevokedMessage, MachineTakeoverMessage
from machines.services import router
from machines.services.audit import in_background, last_active_forget
from machines.services.transport import request_snapshots

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShimIdentity:
    """Who a shim connection acts for: the user, and the machine its token is bound to
    (``None`` for a user API token, accepted for development)."""

    user: User
    machine_id: str | None
    # The credential itself, recorded on the connection row (core.revocation).
    machine_token_id: int | None = None
    api_token_id: int | None = None


_CACHE_PREFIX = "shim:"  # shim identities share core.credential_cache with the bearer lookups


def shim_identity_cached(raw_token: str) -> ShimIdentity | None:
    """The identity ``raw_token`` was found to be less than
    ``core.credential_cache.BEARER_CACHE_SECONDS`` ago in this process, or ``None`` (no
    database access: safe on the event loop). Emptied with the bearer lookups whenever a
    credential ends (``core.revocation``), so a token revoked in this process is refused at
    once, and in another within that bound; a socket opened meanwhile is closed by the
    revocation sweep, which finds its connection row by credential."""
    if not raw_token or len(raw_token) > 200:
        return None
    hit = credential_cache.cached(_CACHE_PREFIX + token_digest(raw_token))
    return hit[1] if hit is not None and isinstance(hit[1], ShimIdentity) else None


def shim_authenticate(raw_token: str) -> ShimIdentity | None:
    """A machine token (or a user API token) → the identity; ``None`` when refused.

    A found identity is cached for ``core.credential_cache.BEARER_CACHE_SECONDS``
    (``shim_identity_cached``); a refusal never is (sync: database reads)."""
    if len(raw_token) > 200:
        return None
    cached = shim_identity_cached(raw_token)
    if cached is not None:
        return cached
    started = time.monotonic()
    identity = _shim_identity_lookup(raw_token)
    if identity is not None:
        credential_cache.remember(_CACHE_PREFIX + token_digest(raw_token), started, identity.user, identity)
    return identity


async def shim_identify(raw_token: str) -> ShimIdentity | None:
    """``shim_authenticate`` from async code: a cached identity without leaving the event
    loop, else one hop to the database thread."""
    cached = shim_identity_cached(raw_token)
    if cached is not None:
        return cached
    return await database_sync_to_async(shim_authenticate)(raw_token)


def _shim_identity_lookup(raw_token: str) -> ShimIdentity | None:
    digest = hashlib.sha256(raw_token.encode()).hexdigest()
    token = MachineToken.objects.select_related("user").filter(digest=digest).first()
    if token is not None and hmac.compare_digest(token.digest, digest):
        if token.revoked_at is not None or not token.user.is_active:
            return None
        now = timezone.now()
        if token.last_used_at is None or (now - token.last_used_at).total_seconds() >= 60:
            MachineToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return ShimIdentity(user=token.user, machine_id=token.machine_id, machine_token_id=token.pk)
    try:
        api_token = api_token_authenticate(raw_token)
    except AuthenticationFailed:
        return None
    return ShimIdentity(user=api_token.user, machine_id=None, api_token_id=api_token.pk)


@dataclass(frozen=True)
class Attachment:
    """A new connection as recorded: what the HELLO_ACK tells the shim."""

    user_id: int
    machine_pk: int
    connection_id: str
    granted_capabilities: list[str]
    limits: dict[str, int]
    sessions: list[str]
    replaced_channels: list[tuple[str, str]]  # (channel_name, connection_id) taken over
    snapshot_targets: list[str] | None = None  # connection ids to ask (None: not looked up yet)


@transaction.atomic
def shim_connected(
    *,
    identity: ShimIdentity,
    hello: Hello,
    channel_name: str,
    protocol_version: str,
    process_row_trusted: bool = False,
) -> Attachment:
    """Record a shim that completed its HELLO; take over older sockets of the same machine.

    Granted capabilities are the advertised ones that the owner allows for this machine
    (``Machine.allowed_capabilities``, set on the Machines page). Returns what the
    HELLO_ACK needs. ``process_row_trusted``: this process's ``ServerProcess`` row is
    taken as live without reading it (``core.presence.process_row_trusted``; a reaped row
    then fails the commit with ``IntegrityError``). The tool-list ring is the caller's
    (``announce_attachment``), so the database thread never waits on the layer.
    """
    user = identity.user
    described = _described(hello)
    allowed_by_default = Machine._meta.get_field("allowed_capabilities").get_default()
    machine, created = Machine.objects.select_for_update().get_or_create(
        user=user,
        machine_id=hello.machine_id,
        defaults={**described, "granted_capabilities": sorted(set(hello.capabilities) & set(allowed_by_default))},
    )
    granted: list[str] = sorted(set(hello.capabilities) & set(machine.allowed_capabilities))
    replaced: list[tuple[str, str]] = []
    if not created:  # a new machine has no connection to take over, nor a row to rewrite
        for name, value in {**described, "granted_capabilities": granted}.items():
            setattr(machine, name, value)
        machine.save(update_fields=[*described, "granted_capabilities"])
        replaced = _connections_delete(machine_pk=machine.pk)
    last_active_forget(user_id=user.pk, machine_id=machine.machine_id)
    router.route_cache_clear_on_commit()
    connection = MachineConnection.objects.create(
        machine=machine,
        user=user,
        connection_id=f"conn_{uuid.uuid4().hex[:16]}",
        channel_name=channel_name,
        server_process_id=current_process_id() if process_row_trusted else server_process_ensure(),
        sessions=list(dict.fromkeys(hello.sessions)),
        granted_capabilities=granted,
        limits=dict(DEFAULT_LIMITS),
        protocol_version=protocol_version,
        machine_token_id=identity.machine_token_id,
        api_token_id=identity.api_token_id,
    )
    return Attachment(
        user_id=user.pk,
        machine_pk=machine.pk,
        connection_id=connection.connection_id,
        granted_capabilities=granted,
        limits=dict(DEFAULT_LIMITS),
        sessions=connection.sessions,
        replaced_channels=replaced,
    )


def _described(hello: Hello) -> dict[str, Any]:
    """The fields of a ``Machine`` row that a ``HELLO`` sets (and a connect resets)."""
    return {
        "hostname": hello.hostname,
        "display_name": hello.display_name or "",
        "platform": hello.platform,
        "arch": hello.arch,
        "shim_version": hello.shim_version,
        "capabilities": sorted(set(hello.capabilities)),
        "allowed_roots": hello.allowed_roots,
        "hardware_devices": hello.hardware_devices,
        "connection_status": Machine.Connection.CONNECTED,
        "health": Machine.Health.OK,
        "status_reason": "connected",
        "revoked_at": None,
    }


def _connections_delete(*, machine_pk: int) -> list[tuple[str, str]]:
    """Delete a machine's connection rows; their ``(channel_name, connection_id)``."""
    return [
        (str(name), str(held))
        for name, held in delete_returning(MachineConnection, "machine_id", machine_pk, "channel_name", "connection_id")
    ]


def shim_attach(*, identity: ShimIdentity, hello: Hello, channel_name: str, protocol_version: str) -> Attachment:
    """``shim_connected``, then (after its commit, in the same database-thread hop) whom
    to ask for a snapshot (``Attachment.snapshot_targets``). This process's row is read
    at most once per ``core.presence.PROCESS_ROW_TRUST_SECONDS``; when it was reaped
    meanwhile the commit fails and the attachment is recorded again after re-creating
    the row. Raises what the database raises."""
    trusted = presence.process_row_trusted()
    arguments: dict[str, Any] = {
        "identity": identity,
        "hello": hello,
        "channel_name": channel_name,
        "protocol_version": protocol_version,
    }
    try:
        attachment = shim_connected(**arguments, process_row_trusted=trusted)
    except IntegrityError:
        if not trusted:
            raise
        presence.process_row_forget()
        attachment = shim_connected(**arguments)
        trusted = False
    if not trusted:
        # Only a HELLO that read the row renews the memo: renewed by every trusted one, it
        # would never be read again under steady load (and miss a stopped marker).
        presence.process_row_confirmed()
    return dataclasses.replace(attachment, snapshot_targets=_snapshot_targets(attachment))


async def announce_attachment(attachment: Attachment) -> None:
    """After a HELLO: ring the user's tool list, revoke taken-over sockets (4427), and on
    the N = 2 transition ask every attached shim of the shared sessions for its
    ``MACHINE_LIST_RESPONSE`` (docs/shim-protocol.md#machine-sessions)."""
    await tools_changed(attachment.user_id)
    for channel_name, connection_id in attachment.replaced_channels:
        try:
            await layer_send(channel_name, MachineTakeoverMessage(connection_id=connection_id))
        except ChannelFull:
            logger.warning("could not tell %s about its takeover: channel full", channel_name)
    targets = attachment.snapshot_targets
    if targets is None:
        targets = await database_sync_to_async(_snapshot_targets)(attachment)
    if targets:
        await request_snapshots(user_id=attachment.user_id, connection_ids=targets)


def _snapshot_targets(attachment: Attachment) -> list[str]:
    """Whom to ask for a ``MACHINE_LIST_RESPONSE`` after this attachment (docs/shim-protocol.md#machine-sessions).

    Nobody while the new connection shares no session with another; else the newcomer,
    plus the connections sharing a session with it whose snapshot is not cached yet (the
    first machine, at the N = 1 → 2 transition). Machines already described are not
    asked again, so N shims cost N requests, not N²/2.
    """
    mine = set(attachment.sessions)
    sharing: list[tuple[str, bool]] = []
    # Whether each machine is described, not its snapshot: a HELLO reads every connection
    # of the user, and decoding each cached MACHINE_LIST_RESPONSE cost more than the query.
    # Each row's sessions come as their JSON text, decoded only when one of this
    # connection's ids (or "*") appears in it: session ids are of a charset JSON never
    # escapes (SESSION_ID_PATTERN), so the text holds '"<id>"' whenever the list holds the id.
    rows = (
        MachineConnection.objects.filter(user_id=attachment.user_id)
        .annotate(
            described=ExpressionWrapper(Q(machine__snapshot__isnull=False), output_field=BooleanField()),
            sessions_text=Cast("sessions", TextField()),
        )
        .values_list("connection_id", "sessions_text", "described")
    )
    quoted = [f'"{session_id}"' for session_id in (mine | {"*"})]
    for connection_id, sessions_text, described in rows:
        if connection_id == attachment.connection_id or "*" in mine:
            sharing.append((connection_id, bool(described)))
        elif any(literal in sessions_text for literal in quoted):
            sessions = set(json.loads(sessions_text))
            if "*" in sessions or mine & sessions:
                sharing.append((connection_id, bool(described)))
    if len(sharing) < 2:
        return []
    return [attachment.connection_id] + [
        connection_id
        for connection_id, described in sharing
        if connection_id != attachment.connection_id and not described
    ]


def shim_disconnected(*, connection_id: str, ring_tools: bool = True) -> int | None:
    """Forget a closed connection; the machine shows ``disconnected`` when none is left.

    Returns the connection's user id (``None``: it was gone already). ``ring_tools=False``
    leaves the tool-list ring to the caller (``announce_detachment``, async code), so the
    database thread does not wait on the layer. Two statements: the DELETE, and the
    machine's status UPDATE conditional on no connection being left."""
    deleted = delete_returning(MachineConnection, "connection_id", connection_id, "machine_id", "user_id")
    if not deleted:
        return None
    machine_pk, user_id = deleted[0]
    if ring_tools:
        tools_changed_on_commit([user_id])
    router.route_cache_clear_on_commit()
    Machine.objects.filter(pk=machine_pk).exclude(
        Exists(MachineConnection.objects.filter(machine=OuterRef("pk")))
    ).update(connection_status=Machine.Connection.DISCONNECTED, status_reason="the shim disconnected")
    return int(user_id)


async def announce_detachment(user_id: int) -> None:
    """After ``shim_disconnected(ring_tools=False)``: ring the user's tool list. Never raises."""
    await tools_changed(user_id)


def shim_connections_of_processes_closed(process_ids: list[str]) -> None:
    """Close every connection held by these server processes as ``shim_disconnected``
    closes one (their machines show ``disconnected`` when nothing else holds them).

    Registered in ``core.services.PROCESSES_GONE_HOOKS``: the reaper and a clean
    shutdown delete processes, whose connection rows would otherwise go by cascade and
    leave their machines ``connected`` for ever.
    """
    held = MachineConnection.objects.filter(server_process_id__in=process_ids)
    for connection_id in list(held.values_list("connection_id", flat=True)):
        shim_disconnected(connection_id=connection_id)


# PONGs are stamped in batches (``shim_seen_soon``): one UPDATE a second for every
# connection of the process that answered meanwhile, not one per PONG. At 5,000 shims and a
# 20 s period that is 1 write a second instead of 250 (bench B6).
SEEN_FLUSH_INTERVAL = 1.0  # seconds a PONG's stamp may wait
SEEN_BATCH = 500  # connection ids per UPDATE


def shim_seen(*, connection_ids: list[str], seen_at: datetime) -> int:
    """Stamp ``last_seen_at = seen_at`` on the given connections (those still attached);
    how many rows were stamped. One UPDATE per ``SEEN_BATCH`` ids."""
    stamped = 0
    for start in range(0, len(connection_ids), SEEN_BATCH):
        chunk = connection_ids[start : start + SEEN_BATCH]
        stamped += MachineConnection.objects.filter(connection_id__in=chunk).update(last_seen_at=seen_at)
    return stamped


class _SeenStamps:
    """The PONGs of this process's connections not yet written: connection id → when the
    first of them came. Only a write buffer: the rows stay the truth, and a stamp lost with
    the process (or to a database error, logged) is renewed by the next PONG."""

    def __init__(self) -> None:
        self.pending: dict[str, datetime] = {}
        self.flushing_on: asyncio.AbstractEventLoop | None = None  # the loop whose task flushes

    def note(self, connection_id: str) -> None:
        self.pending.setdefault(connection_id, timezone.now())
        loop = asyncio.get_running_loop()
        if self.flushing_on is not loop:
            self.flushing_on = loop
            in_background(self._flush_while_pending())

    async def _flush_while_pending(self) -> None:
        try:
            while self.pending:
                await asyncio.sleep(SEEN_FLUSH_INTERVAL)
                batch, self.pending = self.pending, {}
                try:
                    # The earliest PONG of the batch: never later than any of them was seen.
                    await database_sync_to_async(shim_seen)(connection_ids=list(batch), seen_at=min(batch.values()))
                except Exception as exc:
                    logger.warning("could not stamp %d shim connections as seen: %s", len(batch), exc)
        finally:
            self.flushing_on = None


_seen_stamps = _SeenStamps()


def shim_seen_soon(connection_id: str) -> None:
    """After a PONG: stamp the connection's ``last_seen_at`` (docs/shim-protocol.md#machine-status) within
    ``SEEN_FLUSH_INTERVAL`` seconds, batched with the other connections of this process.
    Async code only (it starts the flush task on the running loop); never waits."""
    _seen_stamps.note(connection_id)


def machine_snapshot_store(*, connection_id: str | None, snapshot: dict[str, Any]) -> None:
    """Cache a ``MACHINE_LIST_RESPONSE`` payload on the machine (its snapshot for ``list_machines``)."""
    machine_pk = (
        MachineConnection.objects.filter(connection_id=connection_id).values_list("machine_id", flat=True).first()
    )
    if machine_pk is not None:
        Machine.objects.filter(pk=machine_pk).update(snapshot=snapshot)


@transaction.atomic
def machine_capabilities_set(*, user: User, machine_id: str, allowed: list[str]) -> Machine:
    """Set which capabilities ``user``'s machine may be granted (subset of ``shell``, ``files``).

    Narrowing applies at once (live connections lose the capability, so the router stops
    sending such operations); widening applies when the shim next connects, since a shim
    learns its grant in HELLO_ACK. Raises ``InvalidRequest`` for an unknown capability and
    ``NotFound`` for another user's or an unknown machine.
    """
    from core.errors import InvalidRequest, NotFound
    from machines.protocol import CAPABILITIES

    unknown = sorted(set(allowed) - CAPABILITIES)
    if unknown:
        raise InvalidRequest(f"unknown capability '{unknown[0]}'; expected shell and/or files")
    machine = Machine.objects.select_for_update().filter(user=user, machine_id=machine_id).first()
    if machine is None:
        raise NotFound(f"no machine '{machine_id}'")
    machine.allowed_capabilities = sorted(set(allowed))
    machine.granted_capabilities = sorted(set(machine.granted_capabilities) & set(allowed))
    machine.save(update_fields=["allowed_capabilities", "granted_capabilities"])
    for connection in MachineConnection.objects.select_for_update().filter(machine=machine):
        connection.granted_capabilities = sorted(set(connection.granted_capabilities) & set(allowed))
        connection.save(update_fields=["granted_capabilities"])
    router.route_cache_clear_on_commit()
    return machine


@transaction.atomic
def machine_revoke(*, user: User, machine_id: str) -> Machine:
    """Revoke a machine: its tokens stop working and its live sockets close with 4401."""
    from core.errors import NotFound

    machine = Machine.objects.select_for_update().filter(user=user, machine_id=machine_id).first()
    if machine is None:
        raise NotFound(f"no machine '{machine_id}'")
    now = timezone.now()
    MachineToken.objects.filter(user=user, machine_id=machine_id, revoked_at__isnull=True).update(revoked_at=now)
    credentials_ended_on_commit()  # cached shim identities of those tokens go, here and elsewhere
    machine.revoked_at = now
    machine.connection_status = Machine.Connection.DISCONNECTED
    machine.status_reason = "revoked"
    machine.save(update_fields=["revoked_at", "connection_status", "status_reason"])
    channels = list(MachineConnection.objects.filter(machine=machine).values_list("channel_name", flat=True))
    MachineConnection.objects.filter(machine=machine).delete()
    tools_changed_on_commit([user.pk])
    router.route_cache_clear_on_commit()
    for channel_name in channels:
        send_on_commit(channel_name, MachineRevokedMessage())
    return machine
