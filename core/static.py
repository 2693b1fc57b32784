"""WhiteNoise as an async-capable middleware.

WhiteNoise's own middleware is sync-only. One sync-only middleware makes Django run the
whole request, async views included, through the process's one shared sync thread, so a
view that waits on a remote or a shim (up to minutes) would freeze every other database
call of the process. This subclass answers static files from a worker thread and passes
every other request straight through, staying async.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponseBase
from whitenoise.middleware import WhiteNoiseMiddleware

from core.http import adapt_to_chain


class AsyncWhiteNoiseMiddleware(WhiteNoiseMiddleware):
    """Serve ``STATIC_URL`` files (finders on, as configured) without blocking async views."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        super().__init__(get_response)
        self.is_async = adapt_to_chain(self, get_response)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        return super().__call__(request)

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        if request.path_info.startswith(self.static_prefix):
            static_file = (
                await sync_to_async(self.find_file, thread_sensitive=False)(request.path_info)
                if self.autorefresh
                else self.files.get(request.path_info)
            )
            if static_file is not None:
                # Opening the file is I/O: a worker thread, not the shared sync thread.
                response: HttpResponseBase = await sync_to_async(self.serve, thread_sensitive=False)(
                    static_file, request
                )
                return response
        get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]] = self.get_response
        return await get_response(request)
