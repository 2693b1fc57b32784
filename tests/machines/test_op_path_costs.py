"""What a routed operation costs beyond routing (bench B4 in bench/README.md): queries per FILE_STAT over
REST, the 1 s route cache and its safe re-routing, the throttled ``last_active_at`` write,
the one-statement path recency."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.db import connection
from django.db.backends import utils as backend_utils
from django.test import AsyncClient
from django.test.utils import CaptureQueriesContext

from core.authentication import bearer_cache_clear
from machines.models import AuditRecord, Machine, PathRecency
from machines.services import router
from machines.services.audit import audit_record_create, path_recency_record
from machines.services.operations import machine_op
from tests.machines.conftest import settle, until

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "/home/alice/a.txt"


@contextmanager
def every_query() -> Iterator[list[str]]:
    """The SQL run by any thread (the database thread of ``database_sync_to_async`` too)."""
    seen: list[str] = []
    wrapper: Any = backend_utils.CursorWrapper
    run = wrapper._execute

    def counted(self: Any, sql: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(sql)
        return run(self, sql, *args, **kwargs)

    wrapper._execute = counted
    try:
        yield seen
    finally:
        wrapper._execute = run


def cached_stat(owner: Any) -> router.Candidate | None:
    """What the route cache answers for a FILE_STAT of PATH in s1."""
    return router.choose_cached(
        user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, target_machine=None
    )


async def file_stat(client: AsyncClient, token: str, **extra: Any) -> dict[str, Any]:
    response = await client.post(
        "/api/v1/sessions/s1/ops",
        json.dumps({"op": "FILE_STAT", "payload": {"path": PATH}, **extra}),
        content_type="application/json",
        headers={"authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content
    return response.json()


async def test_a_rest_file_stat_costs_two_queries_once_warm(shims: Any, owner: Any, owner_token: Any) -> None:
    bearer_cache_clear()
    shim = await shims.connect(owner, machine_id="m1")
    shim.files[PATH] = b"x"
    client = AsyncClient()
    await file_stat(client, owner_token)  # warms the token, the route and last_active_at
    await settle()
    with every_query() as queries:
        for _ in range(5):
            assert (await file_stat(client, owner_token))["machine_id"] == "m1"
        await settle()
    # Per operation: the audit INSERT (before the send: the record that it ran), then one
    # transaction (its BEGIN is not a query) with the path recency UPDATE (a routing input,
    # before the reply) and the audit result UPDATE. Before the route cache and these merged
    # writes: token SELECT, route SELECT, recency update_or_create (savepoint, SELECT,
    # UPDATE, release), audit INSERT and two UPDATEs.
    statements = [sql for sql in queries if not sql.startswith("BEGIN")]
    assert len(statements) <= 3 * 5, "\n".join(queries)
    assert await database_sync_to_async(AuditRecord.objects.filter(op="FILE_STAT").count)() == 6


async def test_a_route_to_a_connection_gone_is_routed_again_for_an_operation_that_may_run_twice(
    shims: Any, owner: Any
) -> None:
    shim = await shims.connect(owner, machine_id="m1")
    shim.files[PATH] = b"x"
    await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="test")
    key = (owner.pk, "s1")
    stamped, (live,) = router._routes[key]
    # As if the shim had reconnected to another process less than a second ago: this
    # process's cached route names a connection that no longer exists.
    gone = router.Candidate(**{**live.__dict__, "channel_name": "gone!nowhere", "connection_id": "conn_gone"})
    router._routes[key] = (stamped, (gone,))
    assert router.choose_cached(
        user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, target_machine=None
    )
    response = await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="test")
    assert response["machine_id"] == "m1"
    assert len(shim.ops("FILE_STAT")) == 2
    assert router._routes[key][1] == (live,)  # the fresh route replaced the stale one


async def test_a_command_is_never_routed_from_the_cache(shims: Any, owner: Any) -> None:
    shim = await shims.connect(owner, machine_id="m1")
    shim.files[PATH] = b"x"
    await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="test")
    unsafe: list[tuple[str, dict[str, Any]]] = [
        ("EXECUTE_COMMAND", {"argv": ["true"]}),
        ("FILE_MOVE", {"src": PATH, "dst": PATH + ".2"}),
        ("FILE_DELETE", {"path": PATH}),
        ("FILE_WRITE", {"path": PATH, "content": "y", "append": True}),
    ]
    for op, payload in unsafe:
        assert not router.rerouting_safe(op, payload)
        assert router.choose_cached(user=owner, session_id="s1", op=op, payload=payload, target_machine=None) is None
    assert router.choose_cached(
        user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, target_machine=None
    )


async def test_a_machine_connecting_here_drops_the_cached_routes_at_once(shims: Any, owner: Any) -> None:
    first = await shims.connect(owner, machine_id="m1")
    first.files[PATH] = b"x"
    await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="test")
    assert router.choose_cached(
        user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, target_machine=None
    )
    await shims.connect(owner, machine_id="m2", hostname="server", allowed_roots=["/srv"])
    assert cached_stat(owner) is None
    await first.disconnect()
    assert router._routes == {}


async def test_last_active_is_written_once_per_resolution_and_overloaded_clears_at_once(shims: Any, owner: Any) -> None:
    shim = await shims.connect(owner, machine_id="m1")
    record = {"user": owner, "session_id": "s1", "machine_id": "m1", "op": "FILE_STAT", "payload": {}, "caller": "t"}

    def create(result: dict[str, Any]) -> list[str]:
        with CaptureQueriesContext(connection) as captured:
            audit_record_create(request_id="00000000-0000-4000-8000-000000000000", result=result, **record)
        return [q["sql"] for q in captured]

    def health() -> str:
        return Machine.objects.get(user=owner, machine_id="m1").health

    first = await database_sync_to_async(create)({"ok": True})
    second = await database_sync_to_async(create)({"ok": True})
    assert [q.split()[0] for q in first] == ["INSERT", "UPDATE"]
    assert [q.split()[0] for q in second] == ["INSERT"]
    await database_sync_to_async(create)({"ok": False, "error_code": "SHIM_OVERLOADED"})
    assert await database_sync_to_async(health)() == Machine.Health.OVERLOADED
    await database_sync_to_async(create)({"ok": True})
    assert await database_sync_to_async(health)() == Machine.Health.OK
    assert shim.consumer_alive()


def test_path_recency_is_one_update_once_the_path_is_known(owner: Any) -> None:
    path_recency_record(user=owner, session_id="s1", machine_id="m1", op="FILE_STAT", payload={"path": PATH})
    with CaptureQueriesContext(connection) as captured:
        path_recency_record(user=owner, session_id="s1", machine_id="m2", op="FILE_STAT", payload={"path": PATH})
    assert [q["sql"].split()[0] for q in captured] == ["UPDATE"]
    assert PathRecency.objects.get(user=owner, session_id="s1", path=PATH).machine_id == "m2"


@contextmanager
def database_thread_calls() -> Iterator[list[str]]:
    """The names of the functions sent to the database thread (``database_sync_to_async``)."""
    from channels.db import DatabaseSyncToAsync

    seen: list[str] = []
    handler = DatabaseSyncToAsync.thread_handler

    def counted(self: Any, loop: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(getattr(self.func, "__name__", "?"))
        return handler(self, loop, *args, **kwargs)

    DatabaseSyncToAsync.thread_handler = counted  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        DatabaseSyncToAsync.thread_handler = handler  # type: ignore[method-assign]


async def test_an_answered_operation_writes_its_recency_and_audit_result_in_one_step(shims: Any, owner: Any) -> None:
    from machines.services import audit

    shim = await shims.connect(owner, machine_id="m1")
    shim.files[PATH] = b"x"
    await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="test")
    await settle()
    with database_thread_calls() as calls:
        await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="test")
        # Written by the time the answer is back: nothing left in the background.
        assert not [task for task in audit._background if not task.done()]
    # The audit record before the send, then one call for the recency and the audit result
    # (was three: the record, the recency, the result in the background).
    assert calls == ["audit_record_begin", "operation_recorded"], calls
    record = await database_sync_to_async(AuditRecord.objects.filter(op="FILE_STAT").latest)("pk")
    assert record.result["ok"] is True and "duration_ms" in record.result
    assert (
        await database_sync_to_async(PathRecency.objects.get)(user=owner, session_id="s1", path=PATH)
    ).machine_id == "m1"


async def test_when_the_recorded_writes_fail_the_answer_still_returns_with_its_recency(
    shims: Any, owner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine ran the operation: a failed transaction of its audit result does not
    turn it into an error (a client could run a command twice); its recency is written
    alone and its audit result in the background."""
    from django.db import DatabaseError

    from machines.services import audit

    shim = await shims.connect(owner, machine_id="m1")
    shim.files[PATH] = b"x"
    finish = audit.audit_record_finish
    calls: list[int] = []

    def broken_once(**record: Any) -> None:  # the write after the recency; the retry works
        calls.append(1)
        if len(calls) == 1:
            raise DatabaseError("disk full")
        finish(**record)

    monkeypatch.setattr(audit, "audit_record_finish", broken_once)
    answer = await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="test")
    assert answer["machine_id"] == "m1"
    await settle()
    assert len(calls) == 2
    recency = await database_sync_to_async(PathRecency.objects.get)(user=owner, session_id="s1", path=PATH)
    assert recency.machine_id == "m1"
    record = await database_sync_to_async(AuditRecord.objects.filter(op="FILE_STAT").latest)("pk")
    assert record.result["ok"] is True and record.result.get("pending") is not True


async def test_an_operation_run_while_its_caller_handles_an_exception_is_recorded_in_one_step(
    shims: Any, owner: Any
) -> None:
    """What ended an operation is what it raised, not an exception its caller is handling
    (a copy's clean-up runs inside an except): such an operation still writes its recency."""
    shim = await shims.connect(owner, machine_id="m1")
    shim.files[PATH] = b"x"
    try:
        raise RuntimeError("the caller's own trouble")
    except RuntimeError:
        with database_thread_calls() as calls:
            await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="test")
    assert "operation_recorded" in calls, calls
    recency = await database_sync_to_async(PathRecency.objects.get)(user=owner, session_id="s1", path=PATH)
    assert recency.machine_id == "m1"


async def test_a_caller_gone_before_the_recorded_writes_still_leaves_the_recency_and_audit_result(
    shims: Any, owner: Any
) -> None:
    """A caller cancelled (an MCP cancel, a client gone) once the machine has answered,
    while the writes wait for the one database thread: a queued call is dropped with its
    caller, so the recency and the audit result are written in the background instead."""
    from asgiref.sync import SyncToAsync

    shim = await shims.connect(owner, machine_id="m1")
    shim.files[PATH] = b"x"
    busy, release = threading.Event(), threading.Event()
    answer = shim.handler

    async def answer_with_the_database_thread_busy(request: dict[str, Any]) -> dict[str, Any] | None:
        if request["type"] == "FILE_STAT":
            blockers.append(asyncio.ensure_future(database_sync_to_async(lambda: busy.set() or release.wait(10))()))
            await until(busy.is_set, what="the database thread busy")
        return await answer(request)

    blockers: list[asyncio.Future[Any]] = []
    shim.handler = answer_with_the_database_thread_busy
    call = asyncio.ensure_future(
        machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="test")
    )
    queue = SyncToAsync.single_thread_executor._work_queue  # type: ignore[attr-defined]
    await until(lambda: queue.qsize() > 0, what="the recorded writes queued behind the busy thread")
    call.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.gather(*blockers)
    await settle()
    recency = await database_sync_to_async(PathRecency.objects.get)(user=owner, session_id="s1", path=PATH)
    assert recency.machine_id == "m1"
    record = await database_sync_to_async(AuditRecord.objects.filter(op="FILE_STAT").latest)("pk")
    assert record.result["ok"] is True and record.result.get("pending") is not True
