"""Every write of the remotes app, and the remote call itself.

Docs: docs/ws-protocol.md (ws sessions, remotes). The registry lives in
the database (``WsSession`` and ``Remote`` rows); a call is a channel-layer message to
the serving session's channel carrying a reply channel
(docs/architecture.md#which-way-data-flows).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone
from jsonschema.exceptions import ValidationError, best_match
from referencing.exceptions import Unresolvable

from core import metrics, presence
from core.errors import DispatchError
from core.models import ServerProcess
from core.presence import current_process_id
from core.realtime import Gone, layer_request, request_reply, send_on_commit
from core.rows import delete_returning
from core.services import server_process_ensure, server_process_liveness, server_process_takeover_reap
from core.tool_changes import tools_changed_on_commit
from remotes.inflight import CALLS_IN_FLIGHT, Admission, CallRefused
from remotes.models import Remote, WsSession
from remotes.protocol import (
    FunctionSpec,
    RemoteCallMessage,
    RemoteCallReply,
    RemoteDisconnectedMessage,
    RemoteProbeMessage,
    RemoteProbeReply,
    remote_call_event,
)
from remotes.schemas import ArgumentValidator, compile_validator, has_patterns

logger = logging.getLogger(__name__)

# Default wait for a remote's answer, seconds (docs/ws-protocol.md#limits); overridden by
# DISPATCH_REMOTE_CALL_TIMEOUT and per call.
REMOTE_CALL_TIMEOUT = 30.0

# The channel-layer messages (remotes.protocol: RemoteCallMessage, RemoteProbeMessage,
# RemoteDisconnectedMessage) are handled by dispatch.ws.consumer.SessionConsumer, which
# answers a call with a RemoteCallReply and a probe with a RemoteProbeReply.
REMOTE_PROBE_TIMEOUT = 1.0  # seconds a name's (live) holder has to answer a probe


class RemoteError(DispatchError):
    """Any failure of a remote operation, with a message fit to show a model (docs/ws-protocol.md#remote-call).

    ``code`` tells the kind: ``REMOTE_NOT_CONNECTED``, ``REMOTE_ALREADY_CONNECTED``,
    ``INVALID_REQUEST`` (unknown function, bad args, arguments too large), ``REMOTE_BUSY``,
    ``REMOTE_DISCONNECTED``, ``TIMEOUT``, ``SHUTTING_DOWN``, or ``REMOTE_ERROR`` for an
    error the remote itself reported.
    """

    def __init__(self, message: str, code: str = "REMOTE_ERROR") -> None:
        super().__init__(code, message)


def not_connected(remotename: str) -> RemoteError:
    return RemoteError(f"no connected remote named '{remotename}'", "REMOTE_NOT_CONNECTED")


def disconnected(remotename: str) -> RemoteError:
    return RemoteError(f"remote '{remotename}' disconnected", "REMOTE_DISCONNECTED")


# --- ws sessions ----------------------------------------------------------------------


def ws_session_open(
    *,
    user: User,
    channel_name: str,
    auth_method: str,
    client_address: str = "",
    api_token_id: int | None = None,
    session_key: str = "",
) -> WsSession:
    """Record an authenticated ``/ws`` connection held by this process, with the credential
    it stands on (``api_token_id`` for header/token logins, ``session_key`` for cookie
    logins) so that ending the credential closes it (``core.revocation``).

    This process's ``ServerProcess`` row is read (and re-created if need be) at most once
    per ``core.presence.PROCESS_ROW_TRUST_SECONDS``, as a shim's HELLO does: a session
    recorded on a row reaped meanwhile fails its foreign key at commit, and is recorded
    again after ``server_process_ensure``. Raises what the database raises."""
    fields: dict[str, Any] = {
        "user": user,
        "channel_name": channel_name,
        "auth_method": auth_method,
        "client_address": client_address[:64],
        "api_token_id": api_token_id,
        "session_key": session_key or "",
    }
    # Inside a caller's transaction the foreign key is checked at the caller's commit, too
    # late to record the session again: the memo is trusted only when the INSERT commits alone.
    trusted = presence.process_row_trusted() and not transaction.get_connection().in_atomic_block
    if trusted:
        try:
            return WsSession.objects.create(server_process_id=current_process_id(), **fields)
        except IntegrityError:
            presence.process_row_forget()
    session = WsSession.objects.create(server_process_id=server_process_ensure(), **fields)
    # Only a session that read the row renews the memo: renewed by every trusted one, it
    # would never be read again under steady load (and miss a stopped marker).
    presence.process_row_confirmed()
    return session


def ws_session_close(*, ws_session_id: str) -> None:
    """Forget a closed ws session and every remote it served: the remotes'
    ``DELETE … RETURNING``, then the session's ``DELETE`` (``core.rows``: nothing else
    refers to either row, so Django's cascade collection, a SELECT more, is not run)."""
    served = [
        (int(user_id), str(name))
        for user_id, name in delete_returning(Remote, "ws_session", ws_session_id, "user", "name")
    ]
    for user_id, remotename in served:
        forget_route(user_id, remotename)
    delete_returning(WsSession, "id", ws_session_id)
    tools_changed_on_commit(user_id for user_id, _ in served)


# --- the registry ---------------------------------------------------------------------


def remote_connect(
    *, user: User, ws_session_id: str, channel_name: str, remotename: str, tools: list[FunctionSpec]
) -> Remote:
    """Register ``remotename`` for ``user``, served by the given ws session (docs/ws-protocol.md#remote-connect).

    ``tools`` are already validated (``RemoteConnectBody``). Raises ``RemoteError``
    ``"remote 'x' is already connected"`` when the user has a remote of that name
    (no overriding), or ``"ws session closed"`` when the serving session is gone.
    """
    session = WsSession.objects.filter(pk=ws_session_id, user=user).only("server_process_id").first()
    if session is None:
        raise RemoteError("ws session closed", "REMOTE_DISCONNECTED")
    try:
        with transaction.atomic():
            remote = Remote.objects.create(
                user=user,
                name=remotename,
                ws_session_id=ws_session_id,
                channel_name=channel_name,
                server_process_id=session.server_process_id,
                tools=[spec.model_dump() for spec in tools],
            )
            tools_changed_on_commit([user.pk])
            return remote
    except IntegrityError:
        raise RemoteError(f"remote '{remotename}' is already connected", "REMOTE_ALREADY_CONNECTED") from None
    finally:
        forget_route(user.pk, remotename)


@dataclass(frozen=True)
class RemoteHolder:
    """Who holds a remote name: the row, its serving ws session, channel and process."""

    remote_id: int
    ws_session_id: str
    channel_name: str
    server_process_id: str


def remote_holder(*, user: User, remotename: str) -> RemoteHolder | None:
    """The row holding ``user``'s ``remotename``, if any."""
    row = (
        Remote.objects.filter(user=user, name=remotename)
        .values_list("pk", "ws_session_id", "channel_name", "server_process_id")
        .first()
    )
    return None if row is None else RemoteHolder(*row)


@transaction.atomic
def remote_holder_forget(*, holder: RemoteHolder, session_stale: bool) -> None:
    """Delete a stale registration found by ``remote_connect_probing``.

    With ``session_stale`` (its process lives but has no open connection on the session's
    channel) the whole ws session goes, with every remote it served (``ws_session_close``);
    else (the consumer lives but does not serve that row) only the remote row. Nothing
    happens when the row has changed meanwhile (another connect took the name).
    """
    remote = Remote.objects.select_for_update().filter(pk=holder.remote_id, ws_session_id=holder.ws_session_id).first()
    if remote is None:
        return
    logger.warning(
        "remote '%s' of user %s was registered by a session that %s; forgetting it",
        remote.name,
        remote.user_id,
        "is closed" if session_stale else "no longer serves it",
    )
    if session_stale:
        ws_session_close(ws_session_id=holder.ws_session_id)
    else:
        remote.delete()
        forget_route(remote.user_id, remote.name)
        tools_changed_on_commit([remote.user_id])


async def _holder_released(holder: RemoteHolder) -> bool:
    """Whether a name's holder is gone and its registration was removed
    (docs/operating.md#a-client-of-a-dead-process-registering-again).

    Its process is checked at once (``core.services.server_process_liveness``). Gone — it
    missed two heartbeats and did not answer (or this host knows its pid is gone) — the
    process is reaped and its rows go by cascade. Alive without a connection on the
    session's channel — the consumer died without its cleanup (a Redis outage, say) — the ws
    session is forgotten. Alive with it, the consumer is probed: one that answers it no
    longer serves the row loses only that row. Anything else keeps the name: a live
    process's name is never taken, however late its heartbeat or answer.
    """
    liveness = await server_process_liveness(process_id=holder.server_process_id, channel_names=[holder.channel_name])
    if not liveness.answered:
        if not liveness.stale:
            return False  # silent, but heartbeating: not proven gone
        return bool(await database_sync_to_async(server_process_takeover_reap)(process_id=holder.server_process_id))
    if holder.channel_name not in liveness.holding:
        await database_sync_to_async(remote_holder_forget)(holder=holder, session_stale=True)
        return True
    probe = RemoteProbeMessage(remote_id=holder.remote_id)
    answer = await layer_request(holder.channel_name, probe, reply=RemoteProbeReply, timeout=REMOTE_PROBE_TIMEOUT)
    if answer is None or answer.serving:
        return False
    await database_sync_to_async(remote_holder_forget)(holder=holder, session_stale=False)
    return True


async def remote_connect_probing(
    *, user: User, ws_session_id: str, channel_name: str, remotename: str, tools: list[FunctionSpec]
) -> Remote:
    """``remote_connect``, taking over a name whose holder is gone (docs/ws-protocol.md#remote-connect).

    When the name is taken by another session, the holder's process is checked at once
    (a ``presence.ping``, answered within ``core.services.PRESENCE_PING_TIMEOUT``, 1 s) and,
    if it lives and still has that session open, the session's consumer is probed
    (``remote.probe``, ``REMOTE_PROBE_TIMEOUT``, 1 s). The name is taken over when the
    holder's process missed two heartbeats and did not answer (it is reaped, with every
    row it held), when the process no longer has the session open (a consumer that died
    without its cleanup, e.g. in a Redis outage), or when the consumer answers that it no
    longer serves the name; never from a live consumer that serves it or does not answer.
    Of two connects taking over at once, one wins. Waits on the channel layer, never on
    the database thread. Raises ``RemoteError`` ``REMOTE_ALREADY_CONNECTED`` otherwise.
    """
    connect = database_sync_to_async(remote_connect)
    try:
        return await connect(
            user=user, ws_session_id=ws_session_id, channel_name=channel_name, remotename=remotename, tools=tools
        )
    except RemoteError as exc:
        if exc.code != "REMOTE_ALREADY_CONNECTED":
            raise
        holder = await database_sync_to_async(remote_holder)(user=user, remotename=remotename)
        if holder is not None and (holder.channel_name == channel_name or not await _holder_released(holder)):
            raise  # this very session serves it, or its holder lives
    return await connect(
        user=user, ws_session_id=ws_session_id, channel_name=channel_name, remotename=remotename, tools=tools
    )


@transaction.atomic
def remote_disconnect(*, user: User, remotename: str) -> Remote:
    """Disconnect one of ``user``'s remotes, from any of the user's sessions (docs/ws-protocol.md#remote-disconnect).

    After commit the serving session is told (``remote.disconnected``) and fails the
    remote's pending calls at once. Raises ``RemoteError`` ``"no connected remote named
    'x'"`` when ``user`` has no such remote (another user's remote included).
    """
    remote = Remote.objects.select_for_update().filter(user=user, name=remotename).first()
    if remote is None:
        raise not_connected(remotename)
    remote_id, channel_name = remote.pk, remote.channel_name
    remote.delete()
    forget_route(user.pk, remotename)
    tools_changed_on_commit([user.pk])
    send_on_commit(channel_name, RemoteDisconnectedMessage(remote_id=remote_id))
    return remote


# --- calls -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteRoute:
    """Where a call goes: the remote's row id, its serving channel and process, its specs."""

    remote_id: int
    channel_name: str
    server_process_id: str
    tools: list[dict[str, Any]]


_VALIDATORS: OrderedDict[tuple[int, str], ArgumentValidator] = OrderedDict()
_VALIDATOR_CACHE_SIZE = 2048


def _validator(route: RemoteRoute, spec: dict[str, Any]) -> ArgumentValidator:
    """The compiled argument validator of one function of one connected remote.

    Cached by (remote row id, function): a row's specs never change, and a reconnect makes
    a new row, so a cached validator is never stale.
    """
    key = (route.remote_id, spec["name"])
    validator = _VALIDATORS.get(key)
    if validator is None:
        schema = spec["parameters"]
        validator = compile_validator(schema)
        _VALIDATORS[key] = validator
        if len(_VALIDATORS) > _VALIDATOR_CACHE_SIZE:
            _VALIDATORS.popitem(last=False)
    return validator


# Routes seen recently by this process: (user id, remote name) → (expiry, route).
# A stale route is harmless: the serving consumer answers "not delivered" for a remote
# it no longer serves (the call is then re-routed once), and a vanished serving session
# is caught by the liveness check. Entries live ROUTE_CACHE_SECONDS at most.
_ROUTES: dict[tuple[int, str], tuple[float, RemoteRoute]] = {}
ROUTE_CACHE_SECONDS = 1.0
REPLY_GRACE = 0.2  # seconds to wait for an in-flight answer once the serving row is gone
_ROUTE_CACHE_SIZE = 4096


@database_sync_to_async
def _route_from_database(user_id: int, remotename: str) -> RemoteRoute | None:
    row = (
        Remote.objects.filter(user_id=user_id, name=remotename)
        .values_list("pk", "channel_name", "server_process_id", "tools")
        .first()
    )
    return None if row is None else RemoteRoute(*row)


# The lookups under way, by key: callers that miss the cache together (64 sessions calling
# one remote when its entry expires) share one query instead of making one each.
_ROUTE_LOOKUPS: dict[tuple[int, str], asyncio.Future[RemoteRoute | None]] = {}


async def _route(user_id: int, remotename: str, *, fresh: bool = False) -> tuple[RemoteRoute | None, bool]:
    """The remote's route and whether it came from this process's short-lived cache.

    One database lookup per key at a time: a caller that misses while another's lookup of
    the same key is under way on the same event loop shares its answer (or its error).
    ``fresh`` skips the cache and makes its own lookup, which is cached even if
    ``forget_route`` ran meanwhile (a shared lookup that ``forget_route`` overtook is not):
    a route stale that way lasts at most ``ROUTE_CACHE_SECONDS`` and is harmless (see
    ``_ROUTES``). Raises what the database raises."""
    key = (user_id, remotename)
    now = time.monotonic()
    cached = None if fresh else _ROUTES.get(key)
    if cached is not None and cached[0] > now:
        return cached[1], True
    loop = asyncio.get_running_loop()
    while (shared := None if fresh else _ROUTE_LOOKUPS.get(key)) is not None and shared.get_loop() is loop:
        try:
            return await asyncio.shield(shared), False
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not shared.cancelled() or (task is not None and task.cancelling()):
                raise
            # Its owner was cancelled, not this caller: look again.
    lookup: asyncio.Future[RemoteRoute | None] = loop.create_future()
    if not fresh:
        _ROUTE_LOOKUPS[key] = lookup
    try:
        route = await _route_from_database(user_id, remotename)
    except Exception as exc:
        lookup.set_exception(exc)
        lookup.exception()  # retrieved: the sharers, if any, raise it themselves
        raise
    except BaseException:  # cancelled (or stopping): the sharers look again themselves
        lookup.cancel()
        raise
    finally:
        shared_still = _ROUTE_LOOKUPS.get(key) is lookup  # not overtaken by forget_route
        if shared_still:
            del _ROUTE_LOOKUPS[key]
    lookup.set_result(route)
    if route is None:
        _ROUTES.pop(key, None)
    elif fresh or shared_still:
        if len(_ROUTES) >= _ROUTE_CACHE_SIZE:
            _ROUTES.clear()
        _ROUTES[key] = (now + ROUTE_CACHE_SECONDS, route)
    return route, False


def forget_route(user_id: int, remotename: str) -> None:
    """Drop a cached route (after a connect, disconnect or failed delivery); a lookup of
    it under way is no longer shared (callers from now on look again)."""
    _ROUTES.pop((user_id, remotename), None)
    _ROUTE_LOOKUPS.pop((user_id, remotename), None)


@database_sync_to_async
def _serving_state(route: RemoteRoute) -> str:
    """``"served"`` while the remote's row exists and its process is alive;
    ``"closed"`` when the row is gone but its process lives (the session closed cleanly);
    ``"lost"`` when its process is dead or gone.

    A process that stopped cleanly (its stopped marker, ``core.models.ServerProcess``) is
    ``"closed"``: it answered every call it forwarded before its rows went, so a call still
    unanswered never ran, and the caller may re-route it (a route cached from before a
    rolling restart, docs/deploy.md#rolling-restart). A reaped process is ``"lost"``: the
    call may have run."""
    if route.server_process_id == current_process_id():
        process_alive = True
    else:
        row = ServerProcess.objects.filter(pk=route.server_process_id).values_list("heartbeat_at", "stopped_at").first()
        if row is not None and row[1] is not None:
            return "closed"
        process_alive = row is not None and row[0] >= timezone.now() - timedelta(seconds=settings.PROCESS_TTL)
    if not process_alive:
        return "lost"
    return "served" if Remote.objects.filter(pk=route.remote_id).exists() else "closed"


def uses_patterns(route: RemoteRoute, function: str) -> bool:
    """Whether the function's schema has regular expressions (cached per remote row)."""
    key = (route.remote_id, function)
    found = _PATTERNS.get(key)
    if found is None:
        spec = next((tool for tool in route.tools if tool["name"] == function), None)
        found = _PATTERNS[key] = spec is not None and has_patterns(spec["parameters"])
        if len(_PATTERNS) > _VALIDATOR_CACHE_SIZE:
            _PATTERNS.clear()
    return found


_PATTERNS: dict[tuple[int, str], bool] = {}


def check_arguments(route: RemoteRoute, remotename: str, function: str, args: dict[str, Any]) -> int:
    """Raise ``RemoteError`` unless ``function`` exists and ``args`` fit its schema;
    return the size of the call's downstream frame in UTF-8 bytes (what it holds in flight)."""
    spec = next((tool for tool in route.tools if tool["name"] == function), None)
    if spec is None:
        raise RemoteError(f"remote '{remotename}' has no function '{function}'", "INVALID_REQUEST")
    validator = _validator(route, spec)
    try:
        error = None if validator.is_valid(args) else best_match(validator.iter_errors(args))
    except (ValidationError, Unresolvable, RecursionError) as exc:
        problem = getattr(exc, "message", None) or f"the schema cannot be applied ({type(exc).__name__})"
        raise RemoteError(f"invalid arguments for '{remotename}.{function}': {problem}", "INVALID_REQUEST") from None
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path)
        suffix = f" (at '{where}')" if where else ""
        raise RemoteError(
            f"invalid arguments for '{remotename}.{function}': {error.message}{suffix}", "INVALID_REQUEST"
        )
    # The serving client cannot read a frame over the /ws limit (docs/ws-protocol.md#limits); the request id
    # is at most the name, '#' and 20 digits.
    frame = remote_call_event(
        request_id=f"{remotename}#{'9' * 20}", remotename=remotename, function=function, args=args
    )
    size = len(frame) if frame.isascii() else len(frame.encode())
    if size > settings.WS_MAX_MESSAGE_BYTES:
        raise RemoteError("arguments too large", "INVALID_REQUEST")
    return size


@metrics.observe_remote_calls
async def remote_call(
    *,
    user: User,
    remotename: str,
    function: str,
    args: dict[str, Any],
    timeout: float | None = None,
    caller_session: str | None = None,
) -> Any:
    """Call ``function`` of the caller's remote ``remotename`` with ``args``; return its result.

    Usable from any process and any async context (ws sessions, agent runs, MCP): the
    serving session may be held by another server process. Waits on the channel
    layer, never on a thread. ``timeout`` is in seconds (default
    ``DISPATCH_REMOTE_CALL_TIMEOUT``, 30 s; at most 300). While waiting it re-checks every
    ``DISPATCH_REMOTE_LIVENESS_INTERVAL`` seconds that the remote's row exists and its
    process is alive.

    The call counts as in flight (``remotes.inflight``) for ``caller_session`` (the
    caller's ``/ws`` session id; ``None`` for callers without one), its user and this
    process until it ends; one that would pass a cap is refused at once
    (docs/operating.md#bounds).

    Returns the JSON value the remote answered (``None`` when it sent no ``result``).
    Raises ``RemoteError`` for every failure (docs/ws-protocol.md#remote-call): not
    connected, unknown function, arguments failing the schema or too large, too many calls
    in flight (``RATE_LIMITED``), busy (``REMOTE_BUSY``: the remote's client has not read
    what it was sent), disconnected, timed out, or the error string the remote reported.
    """
    if timeout is None:
        timeout = settings.REMOTE_CALL_TIMEOUT
    deadline = asyncio.get_running_loop().time() + timeout
    route, _cached = await _route(user.pk, remotename)
    reroutes_left = 1
    admission: Admission | None = None
    try:
        while True:
            if route is None:
                raise not_connected(remotename)
            if uses_patterns(route, function):
                # Off the event loop: a pattern may be slow to apply (see remotes.schemas).
                check = sync_to_async(check_arguments, thread_sensitive=False)
                size = await check(route, remotename, function, args)
            else:
                size = check_arguments(route, remotename, function, args)
            if admission is None:
                try:
                    admission = CALLS_IN_FLIGHT.admit(user_id=user.pk, session=caller_session, size=size)
                except CallRefused as exc:
                    raise RemoteError(exc.message, exc.code) from None
            reply = await _deliver(route, remotename, function, args, timeout, deadline)
            if reply.error is None:
                return reply.result
            if reply.delivered is False:
                # The serving session no longer serves that remote row: nothing ran, so the
                # call may go to the remote's current session, if it has one.
                forget_route(user.pk, remotename)
                if reroutes_left:
                    reroutes_left -= 1
                    route, _cached = await _route(user.pk, remotename, fresh=True)
                    continue
            raise RemoteError(reply.error, reply.code or "REMOTE_ERROR")
    finally:
        if admission is not None:
            admission.release()


class _NotDelivered(RemoteError):
    """The serving session was gone before it forwarded the call: nothing ran."""


async def _deliver(
    route: RemoteRoute, remotename: str, function: str, args: dict[str, Any], timeout: float, deadline: float
) -> RemoteCallReply:
    """Send one call to the serving channel and wait for its reply until ``deadline``
    (``core.realtime.request_reply``), re-checking the serving side every
    ``DISPATCH_REMOTE_LIVENESS_INTERVAL`` seconds."""

    async def serving() -> Gone | None:
        state = await _serving_state(route)
        if state == "served":
            return None
        # A session that closes cleanly answers every call it forwarded before its rows
        # go: such an answer gets a moment (REPLY_GRACE) to arrive before concluding.
        if state == "closed":
            # Never forwarded (the session was gone when the call reached its channel):
            # the caller may re-route it.
            return Gone(_NotDelivered(disconnected(remotename).message, "REMOTE_DISCONNECTED"), grace=REPLY_GRACE)
        return Gone(disconnected(remotename), grace=REPLY_GRACE)

    try:
        return await request_reply(
            route.channel_name,
            # Built without validation: every field is already checked and typed here (the
            # arguments against the function's schema), and the serving consumer validates
            # what it receives.
            RemoteCallMessage.model_construct(
                remote_id=route.remote_id, remotename=remotename, function=function, args=args, timeout=float(timeout)
            ),
            reply=RemoteCallReply,
            deadline=deadline,
            timed_out=lambda: RemoteError(
                f"remote call '{remotename}.{function}' timed out after {timeout:g}s", "TIMEOUT"
            ),
            busy=lambda: RemoteError(f"remote '{remotename}' is busy", "REMOTE_BUSY"),
            unsendable=lambda exc: RemoteError(f"arguments cannot be sent: {exc}", "INVALID_REQUEST"),
            liveness=serving,
        )
    except _NotDelivered as exc:
        return RemoteCallReply(error=exc.message, code=exc.code, delivered=False)
