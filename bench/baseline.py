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

``python bench/baseline.py redis-relay --port P --redis URL [--prefix K]``
    The bare relay split over processes: started twice on one Redis, a call from a
    caller on one process to a remote served by the other goes through Redis as one
    PUBLISH each way (the serving process's channel, found in a Redis hash when the
    remote connects), JSON in and out, nothing else. The floor of any relay that
    crosses processes through Redis pub/sub: B2's cross-process cost with nothing of
    Dispatch or Channels in it.

All print ``listening on P`` once ready and stop on SIGTERM.
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


def call_event(request_id: str, name: str, function: str, args: Any) -> str:
    """The downstream ``remote-call`` event a serving client receives."""
    return encode(
        {"action": "remote-call", "requestId": request_id, "remotename": name, "function": function, "args": args}
    )


def call_reply(nonce: Any, result: Any, error: Any) -> str:
    """The caller's reply: ``{"error"}`` when the remote answered one, else ``{"result"}``."""
    return encode({"error": error, "nonce": nonce} if error is not None else {"result": result, "nonce": nonce})


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
                    await target.send(call_event(request_id, name, body["function"], body.get("args") or {}))
                elif action == "remote-call-result":
                    waiting = self.pending.pop(message.get("requestId"), None)
                    if waiting is None:
                        continue
                    caller, caller_nonce = waiting
                    await caller.send(call_reply(caller_nonce, message.get("result"), message.get("error")))
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


# --- the bare relay over two processes and Redis ----------------------------------------


class RedisRelay:
    """One process of the two-process relay: its own websockets, its Redis channel."""

    def __init__(self, redis: Any, prefix: str, port: int) -> None:
        self.redis = redis
        self.registry = f"{prefix}:remotes"  # Redis hash: remotename -> its process's channel
        self.channel = f"{prefix}:{port}"
        self.remotes: dict[str, Any] = {}  # remotename -> serving connection of this process
        self.counters: dict[str, int] = {}
        self.where: dict[str, str] = {}  # remotename -> channel of its process (looked up once)
        self.waiting: dict[str, tuple[Any, Any]] = {}  # call id -> (caller connection, nonce)
        self.pending: dict[str, tuple[str, str]] = {}  # requestId -> (caller's channel, call id)
        self.calls = 0

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
                    channel = self.where.get(name)
                    if channel is None:
                        found = await self.redis.hget(self.registry, name)
                        if found is None:
                            await ws.send(encode({"error": f"no connected remote named '{name}'", "nonce": nonce}))
                            continue
                        channel = self.where[name] = found.decode()
                    self.calls += 1
                    call_id = f"{self.channel}#{self.calls}"
                    self.waiting[call_id] = (ws, nonce)
                    call = {"call": call_id, "reply_to": self.channel, "remotename": name}
                    call.update(function=body["function"], args=body.get("args") or {})
                    await self.redis.publish(channel, encode(call))
                elif action == "remote-call-result":
                    route = self.pending.pop(message.get("requestId"), None)
                    if route is None:
                        continue
                    reply_to, call_id = route
                    reply = {"reply": call_id, "result": message.get("result"), "error": message.get("error")}
                    await self.redis.publish(reply_to, encode(reply))
                elif action == "remote-connect":
                    name = body["remotename"]
                    self.remotes[name] = ws
                    self.counters[name] = 0
                    served.append(name)
                    await self.redis.hset(self.registry, name, self.channel)
                    await ws.send(encode({"message": "remote connected", "remotename": name, "nonce": nonce}))
                else:
                    await ws.send(encode({"error": f"unknown action '{action}'", "nonce": nonce}))
        finally:
            for name in served:
                self.remotes.pop(name, None)

    async def read(self, pubsub: Any) -> None:
        async for item in pubsub.listen():
            if item.get("type") != "message":
                continue
            message = json.loads(item["data"])
            if "call" in message:  # to a remote of this process
                name = message["remotename"]
                target = self.remotes.get(name)
                if target is None:
                    continue
                number = self.counters[name]
                self.counters[name] = number + 1
                request_id = f"{name}#{number}"
                self.pending[request_id] = (message["reply_to"], message["call"])
                await target.send(call_event(request_id, name, message["function"], message["args"]))
            else:  # a reply to a caller of this process
                waiting = self.waiting.pop(message["reply"], None)
                if waiting is None:
                    continue
                caller, nonce = waiting
                await caller.send(call_reply(nonce, message.get("result"), message.get("error")))


async def run_redis_relay(port: int, redis_url: str, prefix: str) -> None:
    import redis.asyncio as aioredis
    from websockets.asyncio.server import serve

    redis = aioredis.Redis.from_url(redis_url)
    relay = RedisRelay(redis, prefix, port)
    pubsub = redis.pubsub()
    await pubsub.subscribe(relay.channel)
    reader = asyncio.create_task(relay.read(pubsub))
    stop = asyncio.get_running_loop().create_future()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set_result, None)
    async with serve(relay.handle, "127.0.0.1", port, compression=None, max_size=16 * 1024 * 1024):
        print(f"listening on {port}", flush=True)
        await stop
    reader.cancel()


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
            await self.send(call_event(request_id, name, event["function"], event["args"]))

        async def relay_reply(self, event: dict[str, Any]) -> None:
            await self.send(call_reply(event["nonce"], event.get("result"), event.get("error")))

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
    parser.add_argument("kind", choices=["relay", "channels", "redis-relay"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis", default="", help="redis-relay: the Redis URL both processes share")
    parser.add_argument("--prefix", default="bench-relay", help="redis-relay: the key and channel prefix both share")
    options = parser.parse_args(argv)
    if options.kind == "relay":
        asyncio.run(run_relay(options.port))
    elif options.kind == "redis-relay":
        if not options.redis:
            parser.error("redis-relay needs --redis URL")
        asyncio.run(run_redis_relay(options.port, options.redis, options.prefix))
    else:
        run_channels(options.port)


if __name__ == "__main__":
    main(sys.argv[1:])
