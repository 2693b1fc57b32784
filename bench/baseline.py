"""The baselines Dispatch is measured against (bench/README.md).

``python bench/baseline.py relay --port P``
    A bare ``websockets`` server in one process relaying the same JSON frames as
    Dispatch's ``/ws`` between a caller and a serving client: it parses each frame and
    re-serialises the downstream ``remote-call`` event and the reply, with the same
    envelope shapes (docs/ws-protocol.md#frames, #remote-call, #remote-call-result). No auth, no
    database, no schema check, no channel layer: what any relay must do at least.

``python bench/baseline.py channels --port P``
    A minimal Channels ``AsyncWebsocketConsumer`` relay under daphne (same server options
    as ``manage.py serve``), relaying between two connections over the in-memory channel
    layer: the framework's cost, with nothing of Dispatch in it.

Both print ``listening on P`` once ready and stop on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any


def encode(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False)


# --- bare websockets relay --------------------------------------------------------------


class Relay:
    """Registry of served remotes and pending calls, all in this one process."""

    def __init__(self) -> None:
        self.remotes: dict[str, Any] = {}  # remotename -> serving connection
        self.counters: dict[str, int] = {}
        self.pending: dict[str, tuple[Any, Any]] = {}  # requestId -> (caller connection, nonce)

    async def handle(self, ws: Any) -> None:
        served: list[str] = []
        try:
            async for frame in ws:
                message = json.loads(frame)
                action = message.get("action")
                nonce = message.get("nonce")
                body = message.get("body") or {}
                if action == "remote-call":
                    name = body["remotename"]
                    target = self.remotes.get(name)
                    if target is None:
                        await ws.send(encode({"error": f"no connected remote named '{name}'", "nonce": nonce}))
                        continue
                    number = self.counters[name]
                    self.counters[name] = number + 1
                    request_id = f"{name}#{number}"
                    self.pending[request_id] = (ws, nonce)
                    await target.send(
                        encode(
                            {
                                "action": "remote-call",
                                "requestId": request_id,
                                "remotename": name,
                                "function": body["function"],
                                "args": body.get("args") or {},
                            }
                        )
                    )
                elif action == "remote-call-result":
                    waiting = self.pending.pop(message.get("requestId"), None)
                    if waiting is None:
                        continue
                    caller, caller_nonce = waiting
                    if message.get("error") is not None:
                        reply = {"error": message["error"], "nonce": caller_nonce}
                    else:
                        reply = {"result": message.get("result"), "nonce": caller_nonce}
                    await caller.send(encode(reply))
                elif action == "remote-connect":
                    name = body["remotename"]
                    if name in self.remotes:
                        await ws.send(encode({"error": f"remote '{name}' is already connected", "nonce": nonce}))
                        continue
                    self.remotes[name] = ws
                    self.counters[name] = 0
                    served.append(name)
                    await ws.send(encode({"message": "remote connected", "remotename": name, "nonce": nonce}))
                elif action == "ping":
                    await ws.send(encode({"pong": True, "nonce": nonce}))
                else:
                    await ws.send(encode({"error": f"unknown action '{action}'", "nonce": nonce}))
        finally:
            for name in served:
                self.remotes.pop(name, None)


async def run_relay(port: int) -> None:
    from websockets.asyncio.server import serve

    relay = Relay()
    stop = asyncio.get_running_loop().create_future()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set_result, None)
    async with serve(relay.handle, "127.0.0.1", port, compression=None, max_size=16 * 1024 * 1024):
        print(f"listening on {port}", flush=True)
        await stop


# --- Channels relay under daphne ---------------------------------------------------------


def channels_application() -> Any:
    """A tiny ASGI app: one ``AsyncWebsocketConsumer`` relaying over the in-memory layer."""
    import django
    from django.conf import settings

    settings.configure(
        DEBUG=False,
        SECRET_KEY="bench-only",
        INSTALLED_APPS=["channels"],
        CHANNEL_LAYERS={
            "default": {"BACKEND": "channels.layers.InMemoryChannelLayer", "CONFIG": {"capacity": 10_000, "expiry": 60}}
        },
        LOGGING_CONFIG=None,
    )
    django.setup()

    from channels.generic.websocket import AsyncWebsocketConsumer
    from channels.routing import ProtocolTypeRouter, URLRouter
    from django.urls import re_path

    remotes: dict[str, str] = {}  # remotename -> serving consumer's channel

    class RelayConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]
        async def connect(self) -> None:
            self.served: dict[str, int] = {}
            self.pending: dict[str, tuple[str, Any]] = {}  # requestId -> (reply channel, nonce)
            await self.accept()

        async def disconnect(self, code: int) -> None:
            for name in self.served:
                remotes.pop(name, None)

        async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
            message = json.loads(text_data or "")
            action = message.get("action")
            nonce = message.get("nonce")
            body = message.get("body") or {}
            if action == "remote-call":
                channel = remotes.get(body["remotename"])
                if channel is None:
                    await self.send(encode({"error": "no connected remote", "nonce": nonce}))
                    return
                await self.channel_layer.send(
                    channel,
                    {
                        "type": "relay.call",
                        "remotename": body["remotename"],
                        "function": body["function"],
                        "args": body.get("args") or {},
                        "reply_channel": self.channel_name,
                        "nonce": nonce,
                    },
                )
            elif action == "remote-call-result":
                waiting = self.pending.pop(message.get("requestId"), None)
                if waiting is None:
                    return
                reply_channel, caller_nonce = waiting
                await self.channel_layer.send(
                    reply_channel,
                    {
                        "type": "relay.reply",
                        "nonce": caller_nonce,
                        "result": message.get("result"),
                        "error": message.get("error"),
                    },
                )
            elif action == "remote-connect":
                name = body["remotename"]
                if name in remotes:
                    await self.send(encode({"error": f"remote '{name}' is already connected", "nonce": nonce}))
                    return
                remotes[name] = self.channel_name
                self.served[name] = 0
                await self.send(encode({"message": "remote connected", "remotename": name, "nonce": nonce}))
            else:
                await self.send(encode({"error": f"unknown action '{action}'", "nonce": nonce}))

        async def relay_call(self, event: dict[str, Any]) -> None:
            name = event["remotename"]
            number = self.served[name]
            self.served[name] = number + 1
            request_id = f"{name}#{number}"
            self.pending[request_id] = (event["reply_channel"], event["nonce"])
            await self.send(
                encode(
                    {
                        "action": "remote-call",
                        "requestId": request_id,
                        "remotename": name,
                        "function": event["function"],
                        "args": event["args"],
                    }
                )
            )

        async def relay_reply(self, event: dict[str, Any]) -> None:
            if event.get("error") is not None:
                await self.send(encode({"error": event["error"], "nonce": event["nonce"]}))
            else:
                await self.send(encode({"result": event["result"], "nonce": event["nonce"]}))

    return ProtocolTypeRouter({"websocket": URLRouter([re_path(r"^ws/?$", RelayConsumer.as_asgi())])})


def run_channels(port: int) -> None:
    application = channels_application()
    from daphne.endpoints import build_endpoint_description_strings
    from daphne.server import Server  # installs twisted's asyncio reactor

    class ReadyServer(Server):  # type: ignore[misc]
        def listen_success(self, listening_port: Any) -> None:
            super().listen_success(listening_port)
            print(f"listening on {port}", flush=True)

    # The same options as `manage.py serve` (dispatch/management/commands/serve.py).
    ReadyServer(
        application=application,
        endpoints=build_endpoint_description_strings(host="127.0.0.1", port=port),
        signal_handlers=True,
        websocket_timeout=-1,
        websocket_max_message_size=16 * 1024 * 1024 + 64 * 1024,
        websocket_max_frame_size=16 * 1024 * 1024 + 64 * 1024,
        ping_interval=20,
        ping_timeout=30,
        application_close_timeout=5,
    ).run()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["relay", "channels"])
    parser.add_argument("--port", type=int, required=True)
    options = parser.parse_args(argv)
    if options.kind == "relay":
        asyncio.run(run_relay(options.port))
    else:
        run_channels(options.port)


if __name__ == "__main__":
    main(sys.argv[1:])
