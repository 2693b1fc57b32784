"""A caller process for the live-operation integration tests (docs/live-operations.md): it
runs ``machines.services`` live operations against an instance's PostgreSQL + Redis, so the
caller and the shim's consumer live in different processes.

``python -m tests.integration.live_caller '<json request>'`` (in an instance's environment)
prints one JSON line per event (``{"event", "t", ...}``, ``t`` in seconds since the start)
and ends with ``{"event": "end", "answer" | "error": ...}``. The request:
``{"do": "stream" | "op" | "pipe" | "cancel", "user": "admin", "session_id", ...}`` with the
service's own arguments, plus for ``stream``: ``pause`` (seconds to sleep after each event:
a slow consumer), ``stop_after`` (outputs to take before leaving the stream) and ``quiet``
(print an output's length in place of its data). While it
runs it heartbeats its ``ServerProcess`` row as every Dispatch process does, and prints
its own RSS (``rss``, KiB) with each event.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

START = time.monotonic()


def emit(event: str, **fields: Any) -> None:
    line = {"event": event, "t": round(time.monotonic() - START, 3), "rss": _rss(), **fields}
    print(json.dumps(line), flush=True)


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def main(request: dict[str, Any]) -> None:
    from channels.db import database_sync_to_async
    from django.contrib.auth import get_user_model

    from core.errors import DispatchError
    from core.models import ServerProcess
    from core.services import server_process_ensure, server_process_heartbeat
    from machines.services import audit, live, operations

    await database_sync_to_async(server_process_ensure)(kind=ServerProcess.Kind.WORKER)

    async def heartbeat() -> None:
        while True:
            await database_sync_to_async(server_process_heartbeat)(kind=ServerProcess.Kind.WORKER)
            await asyncio.sleep(0.5)

    beating = asyncio.ensure_future(heartbeat())
    user = await database_sync_to_async(get_user_model().objects.get)(username=request.pop("user", "admin"))
    action = request.pop("do")
    pause = float(request.pop("pause", 0))
    stop_after = request.pop("stop_after", None)
    quiet = request.pop("quiet", False)  # outputs without their data (a long stream)
    emit("ready")
    try:
        if action == "stream":
            events = live.operation_stream(user=user, caller="it", op="EXECUTE_COMMAND", **request)
            outputs = 0
            async for event in events:
                fields = event.as_json()
                if quiet and isinstance(event, live.Output):
                    fields["data"] = len(fields["data"])
                emit(event.event, **fields)
                if isinstance(event, live.Output):
                    outputs += 1
                    if stop_after is not None and outputs >= stop_after:
                        break
                if pause:
                    await asyncio.sleep(pause)
            await events.aclose()
            emit("end", answer=None)
        elif action == "op":
            emit("end", answer=await operations.machine_op(user=user, caller="it", **request))
        elif action == "pipe":
            emit("end", answer=await live.pipe(user=user, caller="it", **request))
        elif action == "cancel":
            emit("end", answer=await live.cancel_operation(user=user, **request))
        else:
            raise SystemExit(f"unknown action {action!r}")
    except DispatchError as exc:
        emit("end", error={"code": exc.code, "message": exc.message})
    finally:
        beating.cancel()
    # Audit records are written after the answer, in background tasks
    # (machines.services.audit.in_background): exiting before they end would lose them.
    async with asyncio.timeout(10):
        while audit._background:
            await asyncio.wait(set(audit._background))


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dispatch.settings")
    import django

    django.setup()
    asyncio.run(main(json.loads(sys.argv[1])))
