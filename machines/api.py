"""REST routes of the machines app (docs/shim-protocol.md: routing, copy;
docs/live-operations.md). The device-login endpoints are ``machines.device_api``.

The operation routes wait on a shim, so they are async views. The bodies of these
views are the models of ``machines.schemas``, which validate them and describe them in
the OpenAPI schema (``core.openapi.documented``).

Live operations (docs/live-operations.md): ``POST …/ops`` and ``POST …/copy`` with ``stream: true``
answer ``text/event-stream`` (``event: <name>`` + one JSON ``data:`` line per event, no
``id``: nothing is replayed; a ``: keep-alive`` comment after ``KEEPALIVE_SECONDS`` of
silence), read from ``machines.services.live`` as the body is written, so the command's
output credit follows the client; closing the HTTP stream cancels the operation.
Errors found before the first event (bad input, routing, a 2.0 shim) are plain JSON
errors. On these routes ``UNSUPPORTED_OPERATION`` (a feature the machine's shim protocol
lacks) answers 409, not the generic 400: the request is fine, the machine cannot do it;
``MACHINE_BUSY`` (the machine has not read what it was sent) answers 503 and
``RATE_LIMITED`` (too many operations in flight) 429, both with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.decorators import login_not_required
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.http import require_http_methods, require_POST
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from agents.tokens import agent_scope_forbid, agent_scope_session, calling_agent
from core.api import DispatchAPIView
from core.authentication import authenticated_user
from core.errors import DispatchError, InvalidRequest, unavailable_error
from core.http import error_response, json_api, json_object
from core.openapi import Operation, documented
from core.validation import parse_plain
from dispatch.sse import KEEP_ALIVE, sse_event, sse_json
from machines import selectors
from machines.list_schemas import MachineData, MachineList, SessionMachineData, SessionMachines
from machines.protocol import SESSION_ID_PATTERN
from machines.schemas import (
    DefaultMachineAnswer,
    DefaultMachineBody,
    OperationsInFlightAnswer,
    SessionCancelAnswer,
    SessionCopyAnswer,
    SessionCopyBody,
    SessionOpBody,
    SessionOpResult,
    SessionPipeAnswer,
    SessionPipeBody,
    request_id_of,
)
from machines.services import connections, live, router
from machines.services.arguments import check_session_id
from machines.services.copy import copy_between_machines
from machines.services.operations import machine_op

logger = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 15.0  # a comment on a silent event stream, so proxies keep it open
MACHINE_ROUTE_STATUS = {"UNSUPPORTED_OPERATION": 409, "MACHINE_BUSY": 503}  # see the module docstring
# Seconds a client should wait before trying again (Retry-After, RFC 9110 §10.2.3): the
# machine's socket drains, operations in flight end (docs/operating.md#bounds).
RETRY_AFTER = {"MACHINE_BUSY": 1, "RATE_LIMITED": 1}
# The path parameters of the session routes as their views check them (check_session_id,
# request_id_of), so the schema does not call valid what they refuse.
SESSION_ID_SCHEMA = {"type": "string", "pattern": SESSION_ID_PATTERN}
SESSION_PATH = {"session_id": SESSION_ID_SCHEMA}
OPERATION_PATH = {**SESSION_PATH, "request_id": {"type": "string", "format": "uuid"}}


class MachineListView(DispatchAPIView):
    """``GET /api/v1/machines`` → ``{"machines": [...]}``: the caller's machines with status."""

    @extend_schema(responses={200: MachineList})
    def get(self, request: Request) -> Response:
        user = authenticated_user(request)
        default_machine_id = router.default_machine_id(user=user)
        machines = [
            MachineData.from_row(machine, default_machine_id=default_machine_id)
            for machine in selectors.machines_for(user=user)
        ]
        return Response(MachineList(machines=machines).model_dump(mode="json"))


class MachineDetailView(DispatchAPIView):
    """``DELETE /api/v1/machines/{machine_id}``: revoke a machine (its sockets close 4401)."""

    @extend_schema(responses={200: MachineData})
    def delete(self, request: Request, machine_id: str) -> Response:
        agent_scope_forbid(calling_agent(request), "revoke machines")
        machine = connections.machine_revoke(user=authenticated_user(request), machine_id=machine_id)
        # is_default: false, as before (a revoked machine is no one's default any more).
        return Response(MachineData.from_row(machine).model_dump(mode="json"))


class SessionMachinesView(DispatchAPIView):
    """``GET /api/v1/sessions/{session_id}/machines`` → ``{"machines": [machine, …]}``, the
    machines attached to the session (``attached_machines``)."""

    @extend_schema(
        parameters=[OpenApiParameter("session_id", str, OpenApiParameter.PATH, pattern=SESSION_ID_PATTERN)],
        responses={200: SessionMachines},
    )
    def get(self, request: Request, session_id: str) -> Response:
        agent_scope_session(calling_agent(request), session_id)
        entries = selectors.attached_machines(user=authenticated_user(request), session_id=session_id)
        machines = [SessionMachineData.from_entry(entry) for entry in entries]
        # exclude_unset: what a shim did not report is left out, not null.
        return Response(SessionMachines(machines=machines).model_dump(mode="json", exclude_unset=True))


@documented(
    Operation(
        "put",
        "Set (or clear, with null) your default machine, named as target_machine may be",
        "machines",
        DefaultMachineBody,
        DefaultMachineAnswer,
    )
)
@require_http_methods(["PUT"])
@json_api
async def default_machine(request: HttpRequest, user: User) -> dict[str, Any]:
    """``PUT /api/v1/machines/default`` ``{"machine_id": "<machine>" | null}`` (``DefaultMachineBody``):
    the routing default (docs/shim-protocol.md#routing, step 3), named as a ``target_machine`` may be (id, host or
    display name, unique prefix) → ``{"machine_id": "<its id>" | null}``. Errors:
    ``MACHINE_NOT_ATTACHED`` (404: none of the caller's machines), ``MACHINE_AMBIGUOUS``
    (409, with the candidates), ``INVALID_REQUEST`` (400), ``PERMISSION_DENIED`` (403: an
    agent token)."""
    agent_scope_forbid(calling_agent(request), "set the default machine")
    body = parse_plain(DefaultMachineBody, json_object(request))
    machine_id = await database_sync_to_async(router.default_machine_set)(user=user, machine=body.machine_id)
    return DefaultMachineAnswer(machine_id=machine_id).model_dump()


def _machine_errors(view: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Render a ``DispatchError`` of a machine operation route with ``MACHINE_ROUTE_STATUS``
    (``UNSUPPORTED_OPERATION`` → 409), every other code with its usual status."""

    async def wrapper(request: HttpRequest, user: User, **kwargs: Any) -> Any:
        try:
            return await view(request, user, **kwargs)
        except DispatchError as exc:
            return _error_answer(exc)

    wrapper.__name__ = view.__name__
    wrapper.__doc__ = view.__doc__
    return wrapper


def _error_answer(exc: DispatchError) -> JsonResponse:
    response = error_response(exc)
    response.status_code = MACHINE_ROUTE_STATUS.get(exc.code, response.status_code)
    if exc.code in RETRY_AFTER:
        response["Retry-After"] = str(RETRY_AFTER[exc.code])
    return response


def _release_body(request: HttpRequest) -> None:
    """Drop ``request``'s raw body once it is parsed. Django's request objects sit in
    reference cycles (``request.htmx``, the messages storage, the response's
    ``asgi_request``) that only the cyclic collector's rare full passes free, so a burst of
    large writes refused at once would otherwise keep their bodies (up to
    ``DISPATCH_MAX_REQUEST_BYTES`` each) long after the answers went out
    (docs/operating.md#bounds)."""
    request._body = b""  # Django's cache of the read body
    request._stream = io.BytesIO()


def _given(**arguments: Any) -> dict[str, Any]:
    """The keyword arguments that are set (the live-operation ones are passed only then)."""
    return {name: value for name, value in arguments.items() if value is not None}


def json_event(event: str, data: Any) -> str:
    """One server-sent event named ``event`` with ``data`` as one line of JSON
    (``dispatch.sse``: ASCII escapes, so a lone surrogate from a shim cannot break the body)."""
    return sse_event(event=event, data=sse_json(data))


def _event_stream(frames: AsyncIterator[str]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(frames, content_type="text/event-stream; charset=utf-8")
    response["Cache-Control"] = "no-cache"
    return response


def _unexpected(exc: Exception) -> DispatchError:
    """What the stream says about an exception that is not a ``DispatchError``."""
    mapped = unavailable_error(exc)
    if mapped is not None:
        return mapped
    logger.exception("live operation stream failed", exc_info=exc)
    return DispatchError("INTERNAL_ERROR", "the operation's stream failed unexpectedly; see the server log")


EVENT_NAMES: dict[type, str] = {
    live.Started: "started",
    live.Output: "output",
    live.Result: "result",
    live.Failed: "error",
    live.Progress: "progress",
}


def _outcome(event: live.Result | live.Failed) -> dict[str, Any]:
    """A fan-out ``done`` entry, as the JSON answer has it: ``{machine_id, name, ok, result |
    error: {code, message, details}}`` (``machines.services.errors.fan_out_error``)."""
    if isinstance(event, live.Result):
        result = {"machine_id": event.machine_id, "type": event.type, "payload": event.payload}
        return {"machine_id": event.machine_id, "name": event.name, "ok": True, "result": result}
    error = {"code": event.code, "message": event.message, "details": event.details or {}}
    return {"machine_id": event.machine_id, "name": event.name, "ok": False, "error": error}


async def _close(events: AsyncIterator[Any]) -> None:
    """Close ``events`` when it is an async generator (ending the operations it runs)."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


async def _next_or_keepalive(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``events`` one by one, with ``None`` after each ``KEEPALIVE_SECONDS`` of silence.

    Each ``__anext__`` runs as a task that a keep-alive never cancels (cancelling it would
    end ``events``); leaving this generator early cancels the pending one and closes
    ``events`` — for ``machines.services.live`` that cancels the operations still running.
    """
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(events))
            while not (await asyncio.wait({pending}, timeout=KEEPALIVE_SECONDS))[0]:
                yield None
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await _close(events)


async def _operation_frames(
    first: live.LiveEvent | None, events: AsyncIterator[live.LiveEvent], *, fan_out: bool
) -> AsyncIterator[str]:
    """The SSE body of ``POST …/ops`` with ``stream: true``: ``first``, then ``events``
    (``started``, ``output``, ``result`` | ``error``; fan-out: each machine's, then ``done
    {results}``). A failure of the stream itself after the first event is one ``error``
    event naming no machine."""
    outcomes: list[dict[str, Any]] = []

    def frame(event: live.LiveEvent) -> str:
        if isinstance(event, live.Result | live.Failed):
            outcomes.append(_outcome(event))
        return json_event(EVENT_NAMES.get(type(event), "event"), event.as_json())

    request_id = getattr(first, "request_id", None)
    try:
        if first is not None:
            yield frame(first)
        async for event in _next_or_keepalive(events):
            yield KEEP_ALIVE if event is None else frame(event)
    except Exception as exc:
        failure = exc if isinstance(exc, DispatchError) else _unexpected(exc)
        data = {"request_id": request_id, "machine_id": None, "name": None, "code": failure.code}
        yield json_event("error", {**data, "message": failure.message, "details": failure.details})
        return
    if fan_out:
        yield json_event("done", {"results": outcomes})


OPS_EVENTS = (
    "with stream: true, `started {request_id, machine_id, name}`, `output {request_id, machine_id, name, "
    "stream, data, encoding, seq}`, then `result {request_id, machine_id, name, type, payload}` or `error "
    "{request_id, machine_id, name, code, message, details}`; with target_machines, those of each machine "
    "(each names its machine), then `done {results}`"
)


@require_POST
@json_api
@_machine_errors
async def session_op(request: HttpRequest, user: User, session_id: str) -> Any:
    """``POST /api/v1/sessions/{session_id}/ops`` ``{op, payload, target_machine? |
    target_machines?, stream?, request_id?}`` (docs/live-operations.md).

    200 ``{"machine_id", "type", "payload"}`` (the shim's response); with
    ``target_machines`` ``{"results": [{machine_id, name, ok, result | error}]}``. With
    ``stream: true`` (EXECUTE_COMMAND): ``text/event-stream`` (``OPS_EVENTS``); closing
    it cancels the command. Errors carry their code (docs/shim-protocol.md#errors; ``MACHINE_NOT_ATTACHED`` 404,
    ``PATH_OUTSIDE_ALLOWED_ROOT`` 400, ``OPERATION_EXISTS`` 409 for a ``request_id`` in
    flight, ``UNSUPPORTED_OPERATION`` 409 for streaming on a protocol 2.0 shim,
    ``INVALID_REQUEST`` 400 for ``target_machine`` with ``target_machines`` or a payload its
    operation's model refuses (``"payload.<field>: <sentence>"``, before any machine is
    asked: ``machines.schemas.CALLER_PAYLOAD_MODELS``), …).
    """
    agent_scope_session(calling_agent(request), session_id)
    body = parse_plain(SessionOpBody, json_object(request))
    _release_body(request)
    if not body.stream:
        return await machine_op(
            user=user,
            session_id=session_id,
            op=body.op,
            payload=body.payload,
            target_machine=body.target_machine,
            caller="api",
            **_given(target_machines=body.target_machines, request_id=body.request_id),
        )
    events = live.operation_stream(
        user=user,
        session_id=session_id,
        op=body.op,
        payload=body.payload,
        target_machine=body.target_machine,
        target_machines=body.target_machines,
        caller="api",
        request_id=body.request_id,
    )
    try:
        first: live.LiveEvent | None = await anext(events)  # routing errors: a JSON answer
    except StopAsyncIteration:
        first = None
    except BaseException:
        await _close(events)
        raise
    return _event_stream(_operation_frames(first, events, fan_out=body.target_machines is not None))


@documented(
    Operation(
        "post",
        "Cancel an operation in flight (a command, a copy or a pipe), from any server process",
        "machines",
        answer=SessionCancelAnswer,
        status=202,
        path_schemas=OPERATION_PATH,
    )
)
@require_POST
@json_api
@_machine_errors
async def session_op_cancel(request: HttpRequest, user: User, session_id: str, request_id: str) -> HttpResponse:
    """``POST /api/v1/sessions/{session_id}/ops/{request_id}/cancel`` → 202 ``{request_id,
    cancelled: true}``: the cancel was sent; the operation ends with its own answer
    (a command's result says ``cancelled: true``; a copy fails ``CANCELLED``). Errors:
    ``OPERATION_NOT_FOUND`` 404 (not in flight in this session of yours),
    ``UNSUPPORTED_OPERATION`` 409 (on a protocol 2.0 shim), ``INVALID_REQUEST`` 400 (not a UUID).
    """
    agent_scope_session(calling_agent(request), session_id)
    check_session_id(session_id)
    try:
        canonical = request_id_of(request_id)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    assert canonical is not None
    answer = await live.cancel_operation(user=user, session_id=session_id, request_id=canonical)
    return JsonResponse(answer, status=202)


@documented(
    Operation(
        "post",
        "Route an operation to a machine of the session, or to several (target_machines); "
        "stream: true answers server-sent events",
        "machines",
        SessionOpBody,
        SessionOpResult,
        events=OPS_EVENTS,
        path_schemas=SESSION_PATH,
    ),
    Operation(
        "get",
        "The operations in flight in the session (commands, copies, pipes), newest first",
        "machines",
        answer=OperationsInFlightAnswer,
        path_schemas=SESSION_PATH,
    ),
)
@login_not_required  # each view answers 401 itself (json_api)
@require_http_methods(["GET", "POST"])
async def session_ops(request: HttpRequest, **kwargs: Any) -> HttpResponse:
    """``/api/v1/sessions/{session_id}/ops``: ``POST`` runs an operation (``session_op``),
    ``GET`` lists the operations in flight (``session_ops_in_flight``)."""
    view = session_op if request.method == "POST" else session_ops_in_flight
    response: HttpResponse = await view(request, **kwargs)
    return response


@json_api
async def session_ops_in_flight(request: HttpRequest, user: User, session_id: str) -> dict[str, Any]:
    """``GET /api/v1/sessions/{session_id}/ops`` → ``{"operations": [{request_id, session_id,
    kind, op, machine_ids, machines, summary, caller, started_at}, …]}`` (newest first;
    ``machines.services.live.operations_in_flight``)."""
    agent_scope_session(calling_agent(request), session_id)
    check_session_id(session_id)
    operations = await database_sync_to_async(live.operations_in_flight)(user=user, session_id=session_id)
    return {"operations": operations}


@documented(
    Operation(
        "post",
        "Pipe a command's stdout on one machine into a command's stdin on another",
        "machines",
        SessionPipeBody,
        SessionPipeAnswer,
        path_schemas=SESSION_PATH,
    )
)
@require_POST
@json_api
@_machine_errors
async def session_pipe(request: HttpRequest, user: User, session_id: str) -> dict[str, Any]:
    """``POST /api/v1/sessions/{session_id}/pipe`` ``{source: {machine, argv | command,
    cwd?}, destination: {…}, timeout_seconds?, request_id?}`` → ``{request_id, bytes,
    source, destination}`` (docs/live-operations.md#cross-machine-pipes: both need ``shell``; the source
    failing closes the destination's stdin, the destination exiting first stops the
    source). Errors: the router's (404, 403, 409), ``UNSUPPORTED_OPERATION`` 409 (a
    protocol 2.0 shim), ``OPERATION_EXISTS`` 409, ``INVALID_REQUEST`` 400.
    """
    agent_scope_session(calling_agent(request), session_id)
    body = parse_plain(SessionPipeBody, json_object(request))
    return await live.pipe(
        user=user,
        session_id=session_id,
        source=body.source,
        destination=body.destination,
        timeout_seconds=body.timeout_seconds,
        caller="api",
        request_id=body.request_id,
    )


COPY_EVENTS = (
    "with stream: true, `progress {request_id, bytes_done, bytes_total}` events, then `result {request_id, "
    "size_bytes, sha256}` or `error {request_id, code, message, details}`"
)


@documented(
    Operation(
        "post",
        "Copy a file between two machines, verified by SHA-256; stream: true answers progress events",
        "machines",
        SessionCopyBody,
        SessionCopyAnswer,
        events=COPY_EVENTS,
        path_schemas=SESSION_PATH,
    )
)
@require_POST
@json_api
@_machine_errors
async def session_copy(request: HttpRequest, user: User, session_id: str) -> Any:
    """``POST /api/v1/sessions/{session_id}/copy`` → ``{"size_bytes", "sha256"}``
    (docs/shim-protocol.md#cross-machine-copy); ``request_id`` (a UUID) makes it
    cancellable by that id; with ``stream: true``, ``text/event-stream`` (``COPY_EVENTS``),
    and closing it cancels the copy (the partial file is removed)."""
    agent_scope_session(calling_agent(request), session_id)
    body = parse_plain(SessionCopyBody, json_object(request))
    copy_arguments: dict[str, Any] = {
        "user": user,
        "session_id": session_id,
        "source_machine": body.source_machine,
        "source_path": body.source_path,
        "destination_machine": body.destination_machine,
        "destination_path": body.destination_path,
        "overwrite": body.overwrite,
        "caller": "api",
    }
    if not body.stream:
        return await copy_between_machines(**copy_arguments, **_given(request_id=body.request_id))
    request_id = body.request_id or str(uuid.uuid4())
    frames = _copy_frames(copy_arguments, request_id)
    try:
        await anext(frames)  # the copy started; an error before (routing, …) is a JSON answer
    except BaseException:
        await frames.aclose()
        raise
    return _event_stream(frames)


async def _copy_frames(copy_arguments: dict[str, Any], request_id: str) -> AsyncGenerator[str, None]:
    """The SSE body of a streamed copy: first ``""`` once the copy is in flight (not sent:
    an error before it — a machine not attached, a ``request_id`` in flight — is raised
    instead, for a JSON answer), then the latest progress whenever it changed (a slow
    reader skips reports, never queues them), then ``result`` or ``error``. Leaving early
    (the client went away) cancels the copy task."""
    changed = asyncio.Event()
    latest: tuple[int, int | None] | None = None
    started = False

    def on_started() -> None:
        nonlocal started
        started = True
        changed.set()

    async def on_progress(bytes_done: int, bytes_total: int | None) -> None:
        nonlocal latest, started
        latest = (bytes_done, bytes_total)
        started = True
        changed.set()

    copying = asyncio.ensure_future(
        copy_between_machines(**copy_arguments, request_id=request_id, on_progress=on_progress, on_started=on_started)
    )
    copying.add_done_callback(lambda _task: changed.set())
    try:
        await changed.wait()
        if not started:
            copying.result()  # raises the error that stopped it before it started
        yield ""
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_SECONDS):
                    await changed.wait()
            except TimeoutError:
                yield KEEP_ALIVE
                continue
            changed.clear()
            if latest is not None:
                bytes_done, bytes_total = latest
                latest = None
                yield json_event(
                    "progress", {"request_id": request_id, "bytes_done": bytes_done, "bytes_total": bytes_total}
                )
            if copying.done():
                break
        try:
            answer = copying.result()
        except Exception as exc:
            failure = exc if isinstance(exc, DispatchError) else _unexpected(exc)
            data = {"request_id": request_id, "code": failure.code, "message": failure.message}
            yield json_event("error", {**data, "details": failure.details})
            return
        yield json_event("result", {"request_id": request_id, **answer})
    finally:
        if not copying.done():
            copying.cancel()
            await asyncio.gather(copying, return_exceptions=True)
