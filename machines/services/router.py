"""``machines.router``: which machine serves an operation in a session
(docs/shim-protocol.md#routing).

Precedence: (1) an explicit ``target_machine`` — exact ``machine_id``, then exact host
name or display name (case-insensitive), then a unique prefix of either; (2) the
capability the operation needs, preferring for an absolute path the machines whose
allowed roots contain it and among those the one that last touched that path in this
session; (3) the user's default machine; (4) round-robin, with the counter shared by
every server process.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import F

from core.errors import CHANNEL_LAYER_UNAVAILABLE, DispatchError, TemporarilyUnavailable
from core.outage import tracker
from machines.models import DefaultMachine, Machine, MachineConnection, PathRecency, RoutingCounter
from machines.protocol import OPERATIONS
from machines.services.errors import MachineError
from machines.shim.protocol import supports_live_operations


@dataclass(frozen=True)
class Candidate:
    """An attached machine as the router sees it."""

    machine_id: str
    hostname: str
    display_name: str
    channel_name: str
    connection_id: str
    server_process_id: str
    granted_capabilities: tuple[str, ...]
    allowed_roots: tuple[str, ...]
    limits: dict[str, int]
    protocol_version: str = "2.0"  # the connection's negotiated version
    shim_version: str = ""  # the shim program's version, from its HELLO

    @property
    def name(self) -> str:
        return self.display_name or self.hostname or self.machine_id

    @property
    def live(self) -> bool:
        """Whether the connection has protocol 2.1's live operations (streamed output,
        ``CANCEL``, streamed stdin, ``FLOW``)."""
        return supports_live_operations(self.protocol_version)

    def require_live(self, feature: str) -> None:
        """Raise ``DispatchError`` ``UNSUPPORTED_OPERATION`` unless the connection speaks
        2.1 (a 2.0 shim keeps working, and asking it for a live feature names its version;
        docs/shim-protocol.md#version-20-compatibility): "machine 'laptop' runs shim 0.1.0
        (protocol 2.0); <feature> needs protocol 2.1"."""
        if not self.live:
            raise DispatchError(
                "UNSUPPORTED_OPERATION",
                f"machine '{self.name}' runs shim {self.shim_version or '(unknown version)'} "
                f"(protocol {self.protocol_version}); {feature} needs protocol 2.1",
                {
                    "machine_id": self.machine_id,
                    "shim_version": self.shim_version,
                    "protocol_version": self.protocol_version,
                },
            )

    @classmethod
    def of(cls, row: MachineConnection) -> Candidate:
        """The candidate for a connection row (with its machine loaded)."""
        return cls(
            machine_id=row.machine.machine_id,
            hostname=row.machine.hostname,
            display_name=row.machine.display_name,
            channel_name=row.channel_name,
            connection_id=row.connection_id,
            server_process_id=row.server_process_id,
            granted_capabilities=tuple(row.granted_capabilities),
            allowed_roots=tuple(row.machine.allowed_roots),
            limits=dict(row.limits),
            protocol_version=row.protocol_version,
            shim_version=row.machine.shim_version,
        )


ROUTE_CACHE_SECONDS = 1.0
"""How long ``choose_cached`` reuses a session's attached machines, so that most
operations are routed without a query (bench B4 in bench/README.md). A process forgets
them at once when it connects, disconnects, re-grants or revokes a machine
(``route_cache_clear``); another process's change is seen within this. A candidate taken
from it whose connection turns out gone is routed again, fresh, only for an operation that
may run twice (``rerouting_safe``; machine_op)."""
_ROUTE_CACHE_MAX = 4096  # (user, session) entries before the cache is emptied
_routes: dict[tuple[int, str], tuple[float, tuple[Candidate, ...]]] = {}


def route_cache_clear() -> None:
    """Forget every cached route of this process (a connection came, went or changed)."""
    _routes.clear()


def route_cache_clear_on_commit() -> None:
    """``route_cache_clear`` now and when the current transaction commits (a route read
    meanwhile, by another thread, saw the rows before the change)."""
    route_cache_clear()
    transaction.on_commit(route_cache_clear)


def rerouting_safe(op: str, payload: dict[str, Any]) -> bool:
    """Whether running ``op`` twice does no harm, so a stale cached route may be retried:
    not ``EXECUTE_COMMAND``, ``FILE_MOVE``, an appending ``FILE_WRITE`` (never sent twice)
    nor ``FILE_DELETE`` (a second one fails)."""
    if op in ("EXECUTE_COMMAND", "FILE_MOVE", "FILE_DELETE"):
        return False
    return not (op == "FILE_WRITE" and payload.get("append"))


def attached_candidates(*, user: User, session_id: str) -> list[Candidate]:
    """Every machine of ``user`` attached to ``session_id`` now, by name (one query). The
    answer is kept for ``choose_cached`` (``ROUTE_CACHE_SECONDS``)."""
    started = time.monotonic()
    rows = MachineConnection.objects.filter(user=user, machine__revoked_at__isnull=True).select_related("machine")
    found = sorted(
        (Candidate.of(row) for row in rows if row.attached_to(session_id)), key=lambda c: (c.name.lower(), c.machine_id)
    )
    if len(_routes) >= _ROUTE_CACHE_MAX:
        _routes.clear()
    _routes[(user.pk, session_id)] = (started, tuple(found))  # stamped before the read: a change racing it ages out
    return found


class Named(Protocol):
    """What ``match_target`` reads of a machine: a ``Candidate`` or a ``Machine`` row."""

    @property
    def machine_id(self) -> str: ...

    @property
    def hostname(self) -> str: ...

    @property
    def display_name(self) -> str: ...

    @property
    def name(self) -> str: ...


NamedMachine = TypeVar("NamedMachine", bound=Named)


def describe(machine: Named) -> dict[str, str]:
    """``{machine_id, hostname, display_name}``: a machine as an error's details list it.
    ``display_name`` is the name shown everywhere else (``GET /api/v1/machines``, the
    Machines page): the one set, else the hostname, else the id — never empty."""
    return {"machine_id": machine.machine_id, "hostname": machine.hostname, "display_name": machine.name}


def match_target(
    candidates: Sequence[NamedMachine], target: str, *, scope: str = "is attached to this session"
) -> NamedMachine:
    """Resolve an explicit ``target_machine`` (step 1) among ``candidates``: exact
    ``machine_id``, then exact host or display name (case-insensitive), then a unique
    prefix of either. Raises ``MACHINE_AMBIGUOUS`` (details: the ``candidates`` matched) or
    ``MACHINE_NOT_ATTACHED`` ("no machine '<target>' <scope>"; details: the ``attached``
    candidates)."""
    wanted = target.strip()
    lowered = wanted.lower()
    for rule in (
        lambda c: c.machine_id == wanted,
        lambda c: c.hostname.lower() == lowered or c.display_name.lower() == lowered,
        lambda c: (
            c.machine_id.startswith(wanted)
            or c.hostname.lower().startswith(lowered)
            or c.display_name.lower().startswith(lowered)
        ),
    ):
        matches = [c for c in candidates if wanted and rule(c)]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise DispatchError(
                "MACHINE_AMBIGUOUS",
                f"'{target}' matches {len(matches)} machines: "
                + ", ".join(f"{c.name} ({c.machine_id})" for c in matches),
                {"candidates": [describe(c) for c in matches]},
            )
    raise DispatchError(
        "MACHINE_NOT_ATTACHED",
        f"no machine '{target}' {scope}",
        {"attached": [describe(c) for c in candidates]},
    )


def none_attached(message: str, details: dict[str, Any] | None = None) -> DispatchError:
    """The error for finding no attached machine: ``MACHINE_NOT_ATTACHED`` (``message``,
    ``details``), but 503 ``TEMPORARILY_UNAVAILABLE`` naming the channel layer while this
    process finds it down (``core.outage``): shims are disconnected during a Redis outage
    and come back with it, so "not attached" would tell the caller the wrong thing
    (docs/operating.md#health)."""
    if tracker.down("channel_layer"):
        return TemporarilyUnavailable(
            f"{CHANNEL_LAYER_UNAVAILABLE} (machines cannot be reached without it)", {"service": "channel_layer"}
        )
    return DispatchError("MACHINE_NOT_ATTACHED", message, details)


def _inside(path: str, root: str) -> bool:
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def operation_path(op: str, payload: dict[str, Any]) -> str | None:
    """The absolute path an operation works on, for locality and recency (or ``None``)."""
    if not op.startswith("FILE_"):
        return None
    path = payload.get("path") if op != "FILE_MOVE" else payload.get("src")
    if not isinstance(path, str) or not path.startswith("/"):
        return None
    try:
        path.encode()
    except UnicodeEncodeError:  # a lone surrogate (a JSON "\ud800" escape): not storable
        return None
    return posixpath.normpath(path)


def choose(*, user: User, session_id: str, op: str, payload: dict[str, Any], target_machine: str | None) -> Candidate:
    """Pick the machine for ``op`` in ``session_id`` (the four steps above).

    Raises ``DispatchError`` ``MACHINE_NOT_ATTACHED`` (none attached / explicit target
    unknown), ``MACHINE_AMBIGUOUS`` or ``CAPABILITY_NOT_GRANTED``.
    """
    candidates = attached_candidates(user=user, session_id=session_id)
    picked = _first_steps(candidates, session_id=session_id, op=op, payload=payload, target_machine=target_machine)
    if isinstance(picked, Candidate):
        return picked
    capable, local, path = picked
    if len(local) > 1:
        recent = (
            PathRecency.objects.filter(user=user, session_id=session_id, path=path)
            .values_list("machine_id", flat=True)
            .first()
        )
        local = [c for c in local if c.machine_id == recent] or local
        if len(local) == 1:
            return local[0]
    default_id = default_machine_id(user=user)
    for candidate in capable:
        if candidate.machine_id == default_id:
            return candidate
    return capable[_next_turn(user=user, session_id=session_id) % len(capable)]


async def route(*, user: User, session_id: str, op: str, payload: dict[str, Any], target: str | None) -> Candidate:
    """``choose`` on the database thread; its routing error as a ``MachineError``."""
    try:
        return await database_sync_to_async(choose)(
            user=user, session_id=session_id, op=op, payload=payload, target_machine=target
        )
    except DispatchError as exc:
        raise MachineError(exc.code, exc.message, exc.details) from None


async def route_many(
    *, user: User, session_id: str, op: str, target_machines: list[str] | Literal["*"]
) -> list[FanOutTarget]:
    """``choose_many`` on the database thread; its routing error as a ``MachineError``."""
    try:
        return await database_sync_to_async(choose_many)(
            user=user, session_id=session_id, op=op, target_machines=target_machines
        )
    except DispatchError as exc:
        raise MachineError(exc.code, exc.message, exc.details) from None


def choose_cached(
    *, user: User, session_id: str, op: str, payload: dict[str, Any], target_machine: str | None
) -> Candidate | None:
    """``choose`` without the database, for an operation that may run twice
    (``rerouting_safe``): from this process's attached machines of less than
    ``ROUTE_CACHE_SECONDS`` ago, when steps 1–2 decide without recency. ``None`` — route
    with ``choose`` — on a cache miss, a routing error, or a choice that needs recency, the
    default machine or the round-robin counter. Safe on the event loop (no I/O)."""
    if not rerouting_safe(op, payload):
        return None
    hit = _routes.get((user.pk, session_id))
    if hit is None or time.monotonic() - hit[0] >= ROUTE_CACHE_SECONDS:
        return None
    try:
        picked = _first_steps(hit[1], session_id=session_id, op=op, payload=payload, target_machine=target_machine)
    except DispatchError:
        return None  # a machine may have come meanwhile: the database says
    return picked if isinstance(picked, Candidate) else None


def _first_steps(
    candidates: Sequence[Candidate], *, session_id: str, op: str, payload: dict[str, Any], target_machine: str | None
) -> Candidate | tuple[list[Candidate], list[Candidate], str | None]:
    """Steps 1 and 2 over ``candidates``: the machine they pick, or what is left for
    recency and steps 3–4: ``(capable, local, path)`` (``local``: the capable machines whose
    roots hold ``path``, several, or none). Raises as ``choose``."""
    capability = OPERATIONS[op][0]
    if target_machine:
        if not candidates:
            raise none_attached(f"no machine '{target_machine}' is attached to this session", {"attached": []})
        chosen = match_target(candidates, target_machine)
        if capability and capability not in chosen.granted_capabilities:
            raise DispatchError(
                "CAPABILITY_NOT_GRANTED", f"machine '{chosen.name}' was not granted the '{capability}' capability"
            )
        return chosen
    if not candidates:
        raise none_attached(f"no machine is attached to session '{session_id}'")
    capable = [c for c in candidates if capability is None or capability in c.granted_capabilities]
    if not capable:
        raise DispatchError(
            "CAPABILITY_NOT_GRANTED", f"no machine attached to this session was granted the '{capability}' capability"
        )
    if len(capable) == 1:
        return capable[0]
    path = operation_path(op, payload)
    local: list[Candidate] = []
    if path is not None:
        local = [c for c in capable if any(_inside(path, root) for root in c.allowed_roots)]
        if local:
            capable = local
            if len(local) == 1:
                return local[0]
    return capable, local, path


@dataclass(frozen=True)
class FanOutTarget:
    """One entry of a fan-out: the machine asked for (``requested``: a name, or the
    machine's id for ``"*"``) and either the ``candidate`` chosen or the routing ``error``."""

    requested: str
    candidate: Candidate | None = None
    error: DispatchError | None = None


def choose_many(*, user: User, session_id: str, op: str, target_machines: list[str] | str) -> list[FanOutTarget]:
    """The machines of a fan-out (docs/live-operations.md#fan-out-to-many-machines):
    ``"*"`` → every machine attached to ``session_id`` that was granted the op's capability
    (by name); a list → each entry resolved as an explicit ``target_machine`` (step 1), in
    order, a machine named twice kept once. An entry that does not resolve (``MACHINE_NOT_ATTACHED``,
    ``MACHINE_AMBIGUOUS``) or lacks the capability (``CAPABILITY_NOT_GRANTED``) is an entry
    with its ``error``, not a failure of the whole call.

    Raises ``DispatchError`` only when ``"*"`` finds nothing: ``MACHINE_NOT_ATTACHED`` (no
    machine attached) or ``CAPABILITY_NOT_GRANTED`` (none capable).
    """
    candidates = attached_candidates(user=user, session_id=session_id)
    capability = OPERATIONS[op][0]
    if target_machines == "*":
        if not candidates:
            raise none_attached(f"no machine is attached to session '{session_id}'")
        capable = [c for c in candidates if capability is None or capability in c.granted_capabilities]
        if not capable:
            raise DispatchError(
                "CAPABILITY_NOT_GRANTED",
                f"no machine attached to this session was granted the '{capability}' capability",
            )
        return [FanOutTarget(requested=c.name, candidate=c) for c in capable]
    targets: list[FanOutTarget] = []
    seen: set[str] = set()
    for requested in target_machines:
        try:
            chosen = match_target(candidates, requested)
        except DispatchError as exc:
            targets.append(FanOutTarget(requested=requested, error=exc))
            continue
        if chosen.machine_id in seen:
            continue
        seen.add(chosen.machine_id)
        if capability and capability not in chosen.granted_capabilities:
            error = DispatchError(
                "CAPABILITY_NOT_GRANTED", f"machine '{chosen.name}' was not granted the '{capability}' capability"
            )
            targets.append(FanOutTarget(requested=requested, candidate=chosen, error=error))
            continue
        targets.append(FanOutTarget(requested=requested, candidate=chosen))
    return targets


def _next_turn(*, user: User, session_id: str) -> int:
    """The next value of the session's round-robin counter (Redis when configured)."""
    if settings.REDIS_URL:
        client = _redis()
        return int(client.incr(f"{settings.REDIS_PREFIX}:machines:rr:{user.pk}:{session_id}")) - 1
    with transaction.atomic():
        counter, _ = RoutingCounter.objects.get_or_create(user=user, session_id=session_id)
        RoutingCounter.objects.filter(pk=counter.pk).update(value=F("value") + 1)
        return int(RoutingCounter.objects.values_list("value", flat=True).get(pk=counter.pk)) - 1


def default_machine_id(*, user: User) -> str | None:
    """The user's default machine id (cached in Redis when configured; routing step 3)."""
    key = f"{settings.REDIS_PREFIX}:machines:default_machine:{user.pk}"
    if settings.REDIS_URL:
        cached = _redis().get(key)
        if cached is not None:
            return cached.decode() or None
    value = DefaultMachine.objects.filter(user=user).values_list("machine_id", flat=True).first()
    if settings.REDIS_URL:
        _redis().set(key, value or "", ex=300)
    return value


@transaction.atomic
def default_machine_set(*, user: User, machine: str | None) -> str | None:
    """Set the user's default machine (step 3) to ``machine`` — whatever a ``target_machine``
    may be: a ``machine_id``, a host or display name, a unique prefix — among their machines
    that are not revoked, connected or not; ``None`` clears it. Returns the ``machine_id``
    set (or ``None``). Raises ``MACHINE_NOT_ATTACHED`` (no such machine) or
    ``MACHINE_AMBIGUOUS``, as ``match_target`` does."""
    machine_id = None
    if machine is None:
        DefaultMachine.objects.filter(user=user).delete()
    else:
        machines = list(Machine.objects.filter(user=user, revoked_at__isnull=True).order_by("display_name", "hostname"))
        machine_id = match_target(machines, machine, scope="is one of yours").machine_id
        DefaultMachine.objects.update_or_create(user=user, defaults={"machine_id": machine_id})
    if settings.REDIS_URL:
        key = f"{settings.REDIS_PREFIX}:machines:default_machine:{user.pk}"
        transaction.on_commit(lambda: _redis().delete(key))
    return machine_id


def _redis() -> Any:
    import redis

    from core.channel_layer import sync_redis_pool

    global _REDIS_CLIENT
    if _REDIS_CLIENT is None:
        _REDIS_CLIENT = redis.Redis(connection_pool=sync_redis_pool(settings.REDIS_URL))
    return _REDIS_CLIENT


_REDIS_CLIENT: Any = None
