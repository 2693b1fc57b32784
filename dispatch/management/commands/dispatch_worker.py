"""``manage.py dispatch_worker``: run only the background services (no sockets)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from asgiref.sync import sync_to_async
from django.core.management.base import BaseCommand
from django.db import connection

from core import services
from core.models import ServerProcess
from core.presence import current_process_id
from dispatch.background import heartbeat_loop, run_background_services
from dispatch.management.commands.serve import exit_now


class Command(BaseCommand):
    help = "Run Dispatch's background services only (pair with `serve --no-background`)."

    def handle(self, *args: Any, **options: Any) -> None:
        services.server_process_register(kind=ServerProcess.Kind.WORKER)
        connection.close()
        self.stdout.write(f"Dispatch worker running (process {current_process_id()})")
        self.stdout.flush()
        asyncio.run(self._run())
        exit_now(0)  # never join a worker thread left waiting for the stopped loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        tasks = [
            asyncio.ensure_future(heartbeat_loop(kind=ServerProcess.Kind.WORKER)),
            asyncio.ensure_future(run_background_services()),
        ]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await sync_to_async(services.server_process_unregister, thread_sensitive=True)()
