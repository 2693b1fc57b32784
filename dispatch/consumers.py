"""The base of Dispatch's websocket consumers."""

from __future__ import annotations

import logging
from typing import Any

from channels.consumer import get_handler_name
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.layers import get_channel_layer

from dispatch import presence
from dispatch.http import bearer_credentials

logger = logging.getLogger(__name__)

# Sent to every consumer of this process when it stops or finds itself reaped.
SHUTDOWN_MESSAGE = {"type": "server.shutdown"}


class DispatchConsumer(AsyncWebsocketConsumer):
    """A websocket consumer known to its process (for shutdown), without Channels'
    per-message database hop.

    Channels ≥ 4.2 runs ``aclose_old_connections()`` on the process's one sync thread
    before every handler. Dispatch consumers never touch the ORM outside
    ``database_sync_to_async`` (which closes stale connections itself), so that hop —
    about a third of a remote call's cost — is skipped here.
    """

    async def websocket_connect(self, message: dict[str, Any]) -> None:
        presence.connection_opened(self)
        await super().websocket_connect(message)

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        presence.connection_closed(self)
        await super().websocket_disconnect(message)

    async def dispatch(self, message: dict[str, Any]) -> None:
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        try:
            await handler(message)
        except StopConsumer:
            raise
        except Exception:
            # A consumer that dies never receives websocket.disconnect: clean up here, or
            # its rows (remotes, machines) would outlive the socket as ghosts.
            logger.exception("%s failed on %s; closing the connection", type(self).__name__, message["type"])
            presence.connection_closed(self)
            try:
                await self.disconnect(1011)
            except Exception:
                logger.exception("cleanup after a failure failed too")
            await self.close(code=1011)
            raise StopConsumer() from None

    def bearer_token(self) -> str | None:
        """The token of the upgrade request's ``Authorization: Bearer`` header, if any."""
        for name, value in self.scope.get("headers", []):
            if name == b"authorization":
                return bearer_credentials(value.decode("latin-1"))
        return None

    async def server_shutdown(self, event: dict[str, Any]) -> None:
        """``server.shutdown``: close with 1012 (service restart); subclasses fail work first."""
        await self.close(code=1012)


async def shutdown_local_connections() -> int:
    """Tell every consumer of this process to fail its pending work and close.

    Returns how many were told.
    """
    layer = get_channel_layer()
    names = presence.local_channel_names()
    for name in names:
        try:
            await layer.send(name, SHUTDOWN_MESSAGE)
        except Exception:  # a full channel must not stop the others from closing
            logger.warning("could not tell %s to shut down", name, exc_info=True)
    return len(names)
