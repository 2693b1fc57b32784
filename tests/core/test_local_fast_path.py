"""Request/reply between two ends of one process skips the channel layer
(docs/operating.md#channel-layer): the request goes straight into the serving consumer's
inbox in memory and the reply straight back, while every bound of the layer still holds
(a full inbox is "busy", a consumer that ends keeps nothing) and no message is shared
between sender and receiver.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from core import realtime
from core.consumers import DispatchConsumer, receives
from core.errors import DispatchError
from core.protocol import ChannelMessage, ChannelRequest
from core.realtime import local
from dispatch.ws.consumer import SessionConsumer
from remotes import services
from remotes.models import Remote
from remotes.services import RemoteError
from tests.core.test_consumer_pump import Socket

WEATHER = "weather-service"


class LayerSpy:
    """Counts what goes through the default layer's ``send``, ``receive`` and ``group_send``
    from the moment it is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.layer = get_channel_layer()
        self.calls: list[tuple[str, str]] = []
        for name in ("send", "receive", "group_send"):
            monkeypatch.setattr(self.layer, name, self._wrap(name, getattr(self.layer, name)))

    def _wrap(self, name: str, original: Any) -> Any:
        async def operation(target: str, *args: Any) -> Any:
            self.calls.append((name, target))
            return await original(target, *args)

        return operation


class Hold:
    """Makes every ``SessionConsumer`` stop at a ``test.hold`` message until ``release()``:
    while it holds, the consumer reads none of its other messages."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held = asyncio.Event()
        self.released = asyncio.Event()
        self.dispatched: list[dict[str, Any]] = []
        original = SessionConsumer.dispatch

        async def dispatch(consumer: SessionConsumer, message: dict[str, Any]) -> None:
            self.dispatched.append(message)
            if message.get("type") == "test.hold":
                self.held.set()
                await self.released.wait()
                return
            await original(consumer, message)

        monkeypatch.setattr(SessionConsumer, "dispatch", dispatch)

    def release(self) -> None:
        self.released.set()


async def connect_weather(ws: Any, tools: Any) -> str:
    """Serve ``weather-service`` on ``ws``; the serving channel's name."""
    reply = await ws.request("remote-connect", {"remotename": WEATHER, "tools": tools})
    assert reply["message"] == "remote connected", reply
    return str(await database_sync_to_async(lambda: Remote.objects.get(name=WEATHER).channel_name)())


async def serve_one(server: Any, result: Any) -> dict[str, Any]:
    """Answer the next call event on ``server`` with ``result``; the event."""
    event: dict[str, Any] = await server.next_event()
    await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": result})
    return event


def call(owner: Any, args: dict[str, Any], timeout: float = 30) -> Any:
    return services.remote_call(user=owner, remotename=WEATHER, function="get_forecast", args=args, timeout=timeout)


@pytest.mark.django_db(transaction=True)
async def test_a_same_process_remote_call_and_its_reply_never_touch_the_channel_layer(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ws_connect(token=owner_token) as server:
        await connect_weather(server, weather_tools)
        spy = LayerSpy(monkeypatch)
        result, event = await asyncio.gather(call(owner, {"city": "Rome"}), serve_one(server, {"sky": "clear"}))
        assert event["args"] == {"city": "Rome"}
        assert result == {"sky": "clear"}
        assert spy.calls == []


@pytest.mark.django_db(transaction=True)
async def test_the_serving_consumer_gets_a_copy_of_the_arguments_never_the_callers_objects(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = Hold(monkeypatch)
    async with ws_connect(token=owner_token) as server:
        await connect_weather(server, weather_tools)
        spy = LayerSpy(monkeypatch)
        tags: list[Any] = ["a", {"b": [1, 2]}]
        args = {"city": "Rome", "tags": tags}
        result, _event = await asyncio.gather(call(owner, args), serve_one(server, "ok"))
        assert result == "ok"
        [received] = [message for message in hold.dispatched if message.get("type") == "remote.call"]
        assert received["args"] == args
        assert received["args"] is not args
        assert received["args"]["tags"] is not tags and received["args"]["tags"][1] is not tags[1]
        tags[1]["b"].append(3)  # the caller changing its objects later changes nothing received
        assert received["args"]["tags"] == ["a", {"b": [1, 2]}]
        assert spy.calls == []


@pytest.mark.django_db(transaction=True)
async def test_a_full_local_inbox_answers_remote_busy_at_once(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(get_channel_layer(), "capacity", 3)  # the serving channel holds 3
    hold = Hold(monkeypatch)
    async with ws_connect(token=owner_token) as server:
        channel = await connect_weather(server, weather_tools)
        inbox = realtime.local_inbox(channel)
        assert inbox is not None and inbox.capacity == 3
        inbox.put({"type": "test.hold"})
        await asyncio.wait_for(hold.held.wait(), 5)
        for _ in range(3):
            inbox.put({"type": "test.filler"})  # dropped later: no handler

        with pytest.raises(RemoteError) as refused:
            async with asyncio.timeout(5):  # the call's own timeout is 30 s
                await call(owner, {"city": "Rome"})
        assert (refused.value.code, refused.value.message) == ("REMOTE_BUSY", f"remote '{WEATHER}' is busy")
        assert await server.nothing_received()

        hold.release()
        result, _event = await asyncio.gather(call(owner, {"city": "Oslo"}), serve_one(server, "free"))
        assert result == "free"


@pytest.mark.django_db(transaction=True)
async def test_a_serving_consumer_that_ends_unregisters_its_inbox_and_a_call_waiting_there_ends(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: Any, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    settings.REMOTE_LIVENESS_INTERVAL = 0.1
    hold = Hold(monkeypatch)
    async with ws_connect(token=owner_token) as server:
        channel = await connect_weather(server, weather_tools)
        inbox = realtime.local_inbox(channel)
        assert inbox is not None
        inbox.put({"type": "test.hold"})
        await asyncio.wait_for(hold.held.wait(), 5)
        waiting = asyncio.ensure_future(call(owner, {"city": "Rome"}))
        async with asyncio.timeout(5):
            while len(inbox) < 1:  # the call waits in the inbox, unread
                await asyncio.sleep(0.01)
        await server.communicator.send_input({"type": "websocket.disconnect", "code": 1000})
        async with asyncio.timeout(5):
            # Taken by the socket's reader, which now waits behind the hold: the disconnect
            # is handled before the call the inbox's reader would take next.
            while not server.communicator.input_queue.empty():
                await asyncio.sleep(0.005)
        hold.release()
        await server.communicator.wait(5)

        assert realtime.local_inbox(channel) is None
        assert channel not in local._consumer_inboxes
        with pytest.raises(RemoteError) as ended:
            async with asyncio.timeout(5):  # the call's own timeout is 30 s
                await waiting
        # Never forwarded: re-routed once, and the remote is gone.
        assert ended.value.code == "REMOTE_NOT_CONNECTED"
        assert not [message for message in hold.dispatched if message.get("type") == "remote.call"]


# --- the reply's side, with a consumer of the test's own ---------------------------------------


class AskRequest(ChannelRequest):
    type: Literal["test.ask"] = "test.ask"
    question: dict[str, Any]


class AskReply(ChannelMessage):
    type: Literal["test.answer"] = "test.answer"
    answer: dict[str, Any]


class Answerer(DispatchConsumer):
    """Answers each ``test.ask`` with the one ``answer`` object it keeps."""

    instances: list[Answerer] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept: dict[str, Any] = {"items": [1, 2]}
        self.asked: list[AskRequest] = []
        Answerer.instances.append(self)

    @receives(AskRequest)
    async def test_ask(self, request: AskRequest) -> None:
        self.asked.append(request)
        await realtime.layer_send(request.reply_channel, AskReply(answer=self.kept))


@pytest.fixture
def answerer() -> Iterator[None]:
    Answerer.instances = []
    yield


async def test_the_reply_is_a_copy_of_what_the_answerer_sent(answerer: None, monkeypatch: pytest.MonkeyPatch) -> None:
    socket = Socket()
    app = asyncio.ensure_future(Answerer.as_asgi()({"type": "websocket", "path": "/"}, socket.receive, socket.send))
    async with asyncio.timeout(5):
        while not socket.sent:  # the accept
            await asyncio.sleep(0.01)
    consumer = Answerer.instances[-1]
    spy = LayerSpy(monkeypatch)
    question = {"q": ["why"]}
    reply = await realtime.request_reply(
        consumer.channel_name,
        AskRequest(question=question),
        reply=AskReply,
        timeout=5,
        timed_out=DispatchError("TIMEOUT", "no answer"),
    )
    assert reply.answer == {"items": [1, 2]}
    assert reply.answer is not consumer.kept and reply.answer["items"] is not consumer.kept["items"]
    assert consumer.asked[0].question == question and consumer.asked[0].question["q"] is not question["q"]
    assert spy.calls == []

    socket.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
    async with asyncio.timeout(5):
        await app
    assert realtime.local_inbox(consumer.channel_name) is None


# --- one path for every message of this process to a consumer of this process ------------------


class Notice(ChannelMessage):
    type: Literal["test.notice"] = "test.notice"
    n: int


class Listener(DispatchConsumer):
    """Records the order of the ``test.notice`` and ``test.ask`` messages it handles."""

    instances: list[Listener] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[str] = []
        Listener.instances.append(self)

    @receives(Notice)
    async def test_notice(self, notice: Notice) -> None:
        self.seen.append(f"notice {notice.n}")

    @receives(AskRequest)
    async def test_ask(self, request: AskRequest) -> None:
        self.seen.append("ask")
        await realtime.layer_send(request.reply_channel, AskReply(answer={}))


async def open_listener() -> tuple[Listener, Socket, asyncio.Future[None]]:
    Listener.instances = []
    socket = Socket()
    app = asyncio.ensure_future(Listener.as_asgi()({"type": "websocket", "path": "/"}, socket.receive, socket.send))
    async with asyncio.timeout(5):
        while not socket.sent:  # the accept
            await asyncio.sleep(0.01)
    return Listener.instances[-1], socket, app


async def close_listener(socket: Socket, app: asyncio.Future[None]) -> None:
    socket.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
    async with asyncio.timeout(5):
        await app


async def test_a_notice_sent_before_a_request_is_handled_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A "remote disconnected" notice (``layer_send``) then a call (``request_reply``) from
    this process: the consumer sees them in that order, neither through the layer."""
    consumer, socket, app = await open_listener()
    spy = LayerSpy(monkeypatch)
    await realtime.layer_send(consumer.channel_name, Notice(n=1))
    await realtime.request_reply(
        consumer.channel_name,
        AskRequest(question={}),
        reply=AskReply,
        timeout=5,
        timed_out=DispatchError("TIMEOUT", "no answer"),
    )
    assert consumer.seen == ["notice 1", "ask"]
    assert spy.calls == []
    await close_listener(socket, app)


@pytest.mark.django_db(transaction=True)
async def test_a_notice_sent_on_commit_from_the_database_thread_arrives_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    consumer, socket, app = await open_listener()
    spy = LayerSpy(monkeypatch)
    await database_sync_to_async(realtime.send_on_commit)(consumer.channel_name, Notice(n=2))
    async with asyncio.timeout(5):
        while consumer.seen != ["notice 2"]:
            await asyncio.sleep(0.01)
    assert spy.calls == []
    await close_listener(socket, app)


async def test_a_reply_whose_same_process_caller_stopped_waiting_is_dropped_not_sent_to_the_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With Redis frozen, sending it would hold the answering consumer for the layer's
    deadline and then close it as if the layer were lost."""
    consumer, socket, app = await open_listener()
    asked = asyncio.Event()

    async def test_ask(self: Listener, request: AskRequest) -> None:
        asked.set()
        await asyncio.sleep(0.3)  # the caller's 0.1 s are over: its reply inbox is closed
        self.seen.append("answering late")
        await realtime.layer_send(request.reply_channel, AskReply(answer={}))
        self.seen.append("answered late")

    monkeypatch.setattr(Listener, "test_ask", receives(AskRequest)(test_ask))
    spy = LayerSpy(monkeypatch)
    with pytest.raises(DispatchError):
        await realtime.request_reply(
            consumer.channel_name,
            AskRequest(question={}),
            reply=AskReply,
            timeout=0.1,
            timed_out=DispatchError("TIMEOUT", "no answer"),
        )
    assert asked.is_set()
    async with asyncio.timeout(5):
        while "answered late" not in consumer.seen:
            await asyncio.sleep(0.01)
    assert spy.calls == []
    await close_listener(socket, app)
