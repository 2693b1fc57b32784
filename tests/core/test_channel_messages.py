"""Every channel-layer message is a typed model (``core.protocol``;
docs/architecture.md#where-a-new-feature-goes).

Four holds, each read from the code rather than trusted:

- **send sites** (``ast``): every call of ``core.realtime``'s send functions (``ring``,
  ``ring_on_commit``, ``send_on_commit``, ``layer_send``, ``request_reply``,
  ``layer_request``) hands over a model construction or a variable, never a dict, and no
  module but ``core.realtime`` sends on the layer itself;
- **consumers**: every channel-layer handler of every consumer (each public coroutine
  method that is not Channels' websocket machinery, a cleanup hook or a ``/ws`` action) is
  declared with ``@receives(<model>)`` under the name its model's ``type`` dispatches to,
  and a malformed or unknown message is dropped while the socket stays;
- **subscriptions** (``ast``): every ``Subscription`` names the models it takes;
- **models**: each lives in its app's ``protocol.py``, is frozen, refuses unknown fields,
  carries its ``type`` as a one-value ``Literal`` default, is built by some sender, and
  round-trips through the Redis layer's msgpack to the very dict the senders sent before
  the models existed (the layer's wire format is unchanged).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.layers import get_channel_layer
from channels_redis.serializers import MsgPackSerializer

from agents.protocol import CliDoorbellMessage, UserEventMessage
from core import realtime
from core.consumers import DispatchConsumer
from core.protocol import (
    ChannelMessage,
    ChannelRequest,
    CredentialEndedMessage,
    CredentialsRingMessage,
    HealthProbeMessage,
    PresencePingMessage,
    PresencePingReply,
    ServerShutdownMessage,
    ToolsChangedMessage,
)
from dispatch.ws.consumer import SessionConsumer
from machines.consumers import ShimConsumer
from machines.protocol import (
    MachineCancelMessage,
    MachineFlowMessage,
    MachineInputMessage,
    MachineOpMessage,
    MachineOutputMessage,
    MachineReplyMessage,
    MachineRevokedMessage,
    MachineTakeoverMessage,
    OperationCancelMessage,
)
from peers.protocol import MirrorRescanMessage, MirrorResnapshotMessage, OutboxDoorbellMessage
from remotes.models import WsSession
from remotes.protocol import (
    RemoteCallMessage,
    RemoteCallReply,
    RemoteDisconnectedMessage,
    RemoteProbeMessage,
    RemoteProbeReply,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "remotes", "machines", "agents", "peers", "dispatch")
CLIENT_PACKAGES = ("machines/shim/", "remotes/client/")  # websockets, not the layer; Django-free
PROTOCOL_MODULES = (
    "core.protocol",
    "remotes.protocol",
    "machines.protocol",
    "agents.protocol",
    "peers.protocol",
    "dispatch.ws.protocol",
)
SEND_FUNCTIONS = ("ring", "ring_on_commit", "send_on_commit", "layer_send", "request_reply", "layer_request")
# Two replies share one type: the caller names the model it waits for (request_reply's ``reply``).
SHARED_TYPES = {"remote.reply": {RemoteCallReply, RemoteProbeReply}}

# Every model, an instance as its sender builds it, and the dict the layer carries — the
# very dict the sender built by hand before the models existed (``request_reply`` adds the
# reply channel).
EXAMPLES: list[tuple[ChannelMessage, dict[str, Any]]] = [
    (HealthProbeMessage(probe="0f3c"), {"type": "health.probe", "probe": "0f3c"}),
    (ServerShutdownMessage(), {"type": "server.shutdown"}),
    (CredentialEndedMessage(), {"type": "credential.ended"}),
    (CredentialsRingMessage(), {"type": "credentials.ring"}),
    (ToolsChangedMessage(), {"type": "tools.changed"}),
    (
        PresencePingMessage(channel_names=["specific.a!b"]),
        {"type": "presence.ping", "channel_names": ["specific.a!b"], "reply_channel": "specific.test!reply"},
    ),
    (
        PresencePingReply(process_id="proc_0123456789abcdef", holding=["specific.a!b"]),
        {"type": "presence.pong", "process_id": "proc_0123456789abcdef", "holding": ["specific.a!b"]},
    ),
    (
        RemoteCallMessage(
            remote_id=3, remotename="weather", function="get_forecast", args={"city": "Rome"}, timeout=30.0
        ),
        {
            "type": "remote.call",
            "remote_id": 3,
            "remotename": "weather",
            "function": "get_forecast",
            "args": {"city": "Rome"},
            "timeout": 30.0,
            "reply_channel": "specific.test!reply",
        },
    ),
    (RemoteProbeMessage(remote_id=3), {"type": "remote.probe", "remote_id": 3, "reply_channel": "specific.test!reply"}),
    (RemoteDisconnectedMessage(remote_id=3), {"type": "remote.disconnected", "remote_id": 3}),
    (
        RemoteCallReply(result={"hour": 9, "nested": [1, None, {"x": 1.5}]}),
        {"type": "remote.reply", "result": {"hour": 9, "nested": [1, None, {"x": 1.5}]}},
    ),
    (RemoteCallReply(result=None), {"type": "remote.reply", "result": None}),
    (
        RemoteCallReply(error="remote 'weather' disconnected", code="REMOTE_DISCONNECTED", delivered=False),
        {
            "type": "remote.reply",
            "error": "remote 'weather' disconnected",
            "code": "REMOTE_DISCONNECTED",
            "delivered": False,
        },
    ),
    (RemoteProbeReply(serving=True), {"type": "remote.reply", "serving": True}),
    (
        MachineOpMessage(op="READ_FILE", payload={"path": "/a"}, request_id="req-1", session_id="s1", timeout=40.0),
        {
            "type": "machine.op",
            "op": "READ_FILE",
            "payload": {"path": "/a"},
            "request_id": "req-1",
            "session_id": "s1",
            "timeout": 40.0,
            "reply_channel": "specific.test!reply",
        },
    ),
    (
        MachineReplyMessage(response_type="ERROR", payload={"code": "TIMEOUT", "message": "late"}),
        {"type": "machine.reply", "response_type": "ERROR", "payload": {"code": "TIMEOUT", "message": "late"}},
    ),
    (
        MachineOutputMessage(request_id="req-1", stream="stdout", data="hi\n", encoding="utf-8", seq=0),
        {
            "type": "machine.output",
            "request_id": "req-1",
            "stream": "stdout",
            "data": "hi\n",
            "encoding": "utf-8",
            "seq": 0,
        },
    ),
    (
        MachineFlowMessage(request_id="req-1", stream="stdout", credit_total=2097152),
        {"type": "machine.flow", "request_id": "req-1", "stream": "stdout", "credit_total": 2097152},
    ),
    (
        MachineInputMessage(request_id="req-1", data="aGk=", encoding="base64", eof=True),
        {"type": "machine.input", "request_id": "req-1", "data": "aGk=", "encoding": "base64", "eof": True},
    ),
    (MachineCancelMessage(request_id="req-1"), {"type": "machine.cancel", "request_id": "req-1"}),
    (OperationCancelMessage(request_id="req-1"), {"type": "operation.cancel", "request_id": "req-1"}),
    (MachineRevokedMessage(), {"type": "machine.revoked"}),
    (MachineTakeoverMessage(connection_id="conn_1"), {"type": "machine.takeover", "connection_id": "conn_1"}),
    (
        UserEventMessage(event="agent.deleted", data={"id": "agt_1"}),
        {"type": "user.event", "event": "agent.deleted", "data": {"id": "agt_1"}},
    ),
    (CliDoorbellMessage(), {"type": "cli.doorbell"}),
    (OutboxDoorbellMessage(), {"type": "outbox.doorbell"}),
    (MirrorRescanMessage(), {"type": "mirror.rescan"}),
    (MirrorResnapshotMessage(peer_id=7), {"type": "mirror.resnapshot", "peer_id": 7}),
]


# --- reading the code ----------------------------------------------------------------------------


def _server_sources() -> list[Path]:
    files = [
        path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts and not path.relative_to(ROOT).as_posix().startswith(CLIENT_PACKAGES)
    ]
    assert len(files) > 100, "the packages were not found"
    return files


def _namespace(path: Path, tree: ast.AST) -> dict[str, Any]:
    """The names of the module at ``path``: its globals, plus what its functions import
    (``dispatch.background`` imports the apps inside its loops)."""
    dotted = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
    names = dict(vars(importlib.import_module(dotted)))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            source = importlib.import_module(node.module)
            for alias in node.names:
                names.setdefault(alias.asname or alias.name, getattr(source, alias.name, None))
    return names


def _resolve(node: ast.expr, names: dict[str, Any]) -> Any:
    """The object a ``Name`` or ``a.b.c`` expression stands for among ``names`` (``None``
    when it is not one of them)."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, names)
        return getattr(owner, node.attr, None) if owner is not None else None
    return None


def _is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, ChannelMessage)


def _built_model(call: ast.Call, names: dict[str, Any]) -> Any:
    """The model ``call`` builds — ``Model(...)``, or ``Model.model_construct(...)`` (a
    hot path's message whose fields are checked already) — else ``None``."""
    built = _resolve(call.func, names)
    if _is_model(built):
        return built
    if isinstance(call.func, ast.Attribute) and call.func.attr == "model_construct":
        owner = _resolve(call.func.value, names)
        return owner if _is_model(owner) else None
    return None


def _send_calls(tree: ast.AST, names: dict[str, Any]) -> list[tuple[ast.Call, str]]:
    """The calls of ``core.realtime``'s send functions in ``tree`` (resolved through the
    module's names, so an unrelated ``ring`` is not one)."""
    senders = [(getattr(realtime, name), name) for name in SEND_FUNCTIONS]
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            target = _resolve(node.func, names)
            calls += [(node, name) for function, name in senders if target is function]
    return calls


def _message_argument(call: ast.Call) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == "message":
            return keyword.value
    return call.args[1] if len(call.args) > 1 else None


def _refusal(argument: ast.expr | None, names: dict[str, Any]) -> str | None:
    """Why ``argument`` is not a model construction or a variable (``None`` when it is;
    a call of a function typed to return a model counts as a construction)."""
    if argument is None:
        return "no message"
    if isinstance(argument, ast.Name):
        return None  # a variable: its type is mypy's to check (a ChannelMessage parameter)
    if isinstance(argument, ast.Call):
        if _built_model(argument, names) is not None:
            return None  # a model
        built = _resolve(argument.func, names)
        if inspect.isfunction(built) and _is_model(get_type_hints(built).get("return")):
            return None  # a model, or a function typed to return one
    return f"a {type(argument).__name__} ({ast.unparse(argument)[:60]}), not a ChannelMessage"


def _send_site_problems(path: Path, source: str) -> tuple[list[str], int]:
    tree = ast.parse(source, filename=str(path))
    names = _namespace(path, tree)
    problems, sites = [], 0
    for call, name in _send_calls(tree, names):
        sites += 1
        refusal = _refusal(_message_argument(call), names)
        if refusal is not None:
            problems.append(f"{path.relative_to(ROOT)}:{call.lineno}: {name}() gets {refusal}")
    return problems, sites


def _sources_calling(names: tuple[str, ...]) -> list[tuple[Path, str]]:
    found = []
    for path in _server_sources():
        source = path.read_text(encoding="utf-8")
        if any(f"{name}(" in source for name in names):
            found.append((path, source))
    return found


def test_every_send_site_hands_the_layer_a_model_never_a_dict() -> None:
    problems, sites = [], 0
    for path, source in _sources_calling(SEND_FUNCTIONS):
        found, count = _send_site_problems(path, source)
        problems += found
        sites += count
    assert problems == [], "build the message's model (its app's protocol.py):\n" + "\n".join(problems)
    assert sites >= 20, f"only {sites} send sites were found: the check is not reading the code"


def test_the_send_site_check_sees_a_dict() -> None:
    path = ROOT / "core" / "tool_changes.py"
    bad = path.read_text(encoding="utf-8").replace("ToolsChangedMessage()", '{"type": "tools.changed"}')
    problems, sites = _send_site_problems(path, bad)
    assert sites == 2 and len(problems) == 2
    assert "ring() gets a Dict" in problems[0]


def _layer_uses(tree: ast.AST) -> list[tuple[int, str]]:
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "get_channel_layer":
            uses.append((node.lineno, "get_channel_layer"))
        if isinstance(node, ast.Attribute) and node.attr in ("send", "group_send"):
            receiver = ast.unparse(node.value)
            if "layer" in receiver:
                uses.append((node.lineno, f"{receiver}.{node.attr}"))
    return uses


def test_no_module_but_core_realtime_sends_on_the_layer() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {use}"
        for path in _server_sources()
        if path.relative_to(ROOT).parent.as_posix() != "core/realtime"
        for line, use in _layer_uses(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert offending == [], "send through core.realtime (layer_send, ring, …) with a model:\n" + "\n".join(offending)
    realtime_modules = sorted((ROOT / "core" / "realtime").glob("*.py"))
    assert any(_layer_uses(ast.parse(path.read_text(encoding="utf-8"))) for path in realtime_modules)


def test_every_subscription_names_the_models_it_takes() -> None:
    problems, subscriptions = [], 0
    for path, source in _sources_calling(("Subscription",)):
        tree = ast.parse(source)
        names = _namespace(path, tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _resolve(node.func, names) is realtime.Subscription):
                continue
            subscriptions += 1
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            receives = next((k.value for k in node.keywords if k.arg == "receives"), None)
            if not isinstance(receives, ast.List | ast.Tuple) or not receives.elts:
                problems.append(f"{where}: no receives=[<models>]")
                continue
            problems += [
                f"{where}: {ast.unparse(element)} is not a ChannelMessage"
                for element in receives.elts
                if not _is_model(_resolve(element, names))
            ]
    assert problems == [], "\n".join(problems)
    assert subscriptions >= 8, f"only {subscriptions} subscriptions were found"


# --- consumers -----------------------------------------------------------------------------------

NOT_CHANNEL_HANDLERS = frozenset(dir(AsyncWebsocketConsumer)) | {"delete_rows", "release_layer", "layer_quietly"}


def _consumers() -> list[type[DispatchConsumer]]:
    found, pending = [], [DispatchConsumer]
    while pending:
        cls = pending.pop()
        if not cls.__module__.startswith("tests."):
            found.append(cls)
        pending += cls.__subclasses__()
    return found


def _channel_handlers(consumer: type[DispatchConsumer]) -> dict[str, Any]:
    """The consumer's channel-layer handlers: its public coroutine methods but Channels'
    websocket machinery, the cleanup hooks and the ``/ws`` actions (``do_*``)."""
    return {
        name: member
        for name, member in inspect.getmembers(consumer, inspect.iscoroutinefunction)
        if not name.startswith(("_", "do_")) and name not in NOT_CHANNEL_HANDLERS
    }


def test_every_type_a_consumer_handles_has_its_model_under_its_name() -> None:
    consumers = _consumers()
    assert {SessionConsumer, ShimConsumer, DispatchConsumer} <= set(consumers)
    handled: dict[str, set[str]] = {}
    for consumer in consumers:
        for name, handler in _channel_handlers(consumer).items():
            model = getattr(handler, "channel_message", None)
            assert _is_model(model), f"{consumer.__name__}.{name} is not declared with @receives(<model>)"
            assert model.message_type().replace(".", "_") == name
            handled.setdefault(consumer.__name__, set()).add(model.message_type())
    assert handled["SessionConsumer"] == {
        "remote.call",
        "remote.probe",
        "remote.disconnected",
        "user.event",
        "server.shutdown",
        "credential.ended",
    }
    assert handled["ShimConsumer"] == {
        "machine.op",
        "machine.flow",
        "machine.input",
        "machine.cancel",
        "machine.revoked",
        "machine.takeover",
        "server.shutdown",
        "credential.ended",
    }


def test_a_handler_under_another_name_than_its_type_is_refused_at_import() -> None:
    from core.consumers import receives

    with pytest.raises(TypeError, match="must be named remote_call"):

        @receives(RemoteCallMessage)
        async def remote_kall(self: Any, call: RemoteCallMessage) -> None:
            pass


@pytest.mark.parametrize(
    "message",
    [
        {"type": "machine.op"},  # its fields missing
        {"type": "machine.takeover", "connection_id": "conn_1", "extra": 1},  # a field it does not declare
        {"type": "machine.takeover", "connection_id": 5},  # a field of the wrong type
        {"type": "machine.nothing"},  # a type nobody handles
        {"type": "delete.rows"},  # a method that is not a channel handler
        {"nothing": "at all"},  # no type
    ],
)
async def test_a_malformed_message_to_a_shim_consumer_is_logged_and_dropped(
    message: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    consumer = ShimConsumer()
    consumer.connection_id = "conn_1"
    with caplog.at_level(logging.WARNING):
        await consumer.dispatch(message)  # neither raises nor reaches a handler
    assert any("dropped" in record.getMessage() for record in caplog.records)
    assert consumer.connection_id == "conn_1"  # a takeover would have given the machine away


@pytest.mark.django_db(transaction=True)
async def test_a_malformed_message_to_a_session_is_dropped_and_the_session_stays(
    ws_connect: Any, owner: Any, owner_token: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with ws_connect(token=owner_token) as ws:
        assert (await ws.request("ping"))["pong"] is True  # authenticated: its row exists
        channel = await database_sync_to_async(lambda: WsSession.objects.get(user=owner).channel_name)()
        with caplog.at_level(logging.WARNING):
            for message in (
                {"type": "remote.call", "remote_id": 1},  # no function, no reply channel
                {"type": "user.event", "event": "agent.event"},  # no data
                {"type": "remote.probe", "remote_id": 1},  # a request nobody could answer
                {"type": "do.ping"},  # an action's method, not a channel handler
                {"type": "nope.nope"},
            ):
                await get_channel_layer().send(channel, message)
            assert (await ws.request("ping"))["pong"] is True
            assert await ws.nothing_received()
        dropped = [r.getMessage() for r in caplog.records if "SessionConsumer dropped" in r.getMessage()]
        assert len(dropped) == 5, dropped


# --- the models ----------------------------------------------------------------------------------


def _models() -> list[type[ChannelMessage]]:
    for name in PROTOCOL_MODULES:
        importlib.import_module(name)
    found, pending = [], list(ChannelMessage.__subclasses__())
    while pending:
        model = pending.pop()
        pending += model.__subclasses__()
        if not model.__module__.startswith("tests.") and model is not ChannelRequest:
            found.append(model)
    return found


def test_each_model_lives_in_its_apps_protocol_and_is_strict() -> None:
    models = _models()
    assert len(models) >= 19
    types: dict[str, set[type[ChannelMessage]]] = {}
    for model in models:
        assert model.__module__ in PROTOCOL_MODULES, f"{model.__name__} is not in its app's protocol.py"
        assert model.model_config.get("frozen") is True and model.model_config.get("extra") == "forbid"
        annotation = model.model_fields["type"].annotation
        assert get_origin(annotation) is Literal and get_args(annotation) == (model.message_type(),)
        types.setdefault(model.message_type(), set()).add(model)
    shared = {kind: found for kind, found in types.items() if len(found) > 1}
    assert shared == SHARED_TYPES


def test_every_model_has_an_example_and_a_sender() -> None:
    models = set(_models())
    assert {type(instance) for instance, _ in EXAMPLES} == models
    built: set[type[ChannelMessage]] = set()
    for path in _server_sources():
        if path.relative_to(ROOT).as_posix().endswith("protocol.py"):
            continue  # a protocol module's own helpers do not make it sent
        source = path.read_text(encoding="utf-8")
        if "Message(" not in source and "Reply(" not in source:
            continue
        tree = ast.parse(source)
        names = _namespace(path, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (model := _built_model(node, names)) is not None:
                built.add(model)
    assert models - built == set(), "models nobody sends"


@pytest.mark.parametrize(("instance", "layer_dict"), EXAMPLES, ids=lambda value: getattr(value, "type", ""))
def test_a_message_round_trips_through_the_redis_layer_as_the_dict_it_always_was(
    instance: ChannelMessage, layer_dict: dict[str, Any]
) -> None:
    if isinstance(instance, ChannelRequest):
        instance = instance.model_copy(update={"reply_channel": "specific.test!reply"})  # as request_reply sends it
    sent = instance.for_layer()
    assert sent == layer_dict
    assert next(iter(sent)) == "type"
    serializer = MsgPackSerializer()
    carried = serializer.deserialize(serializer.serialize(sent))
    assert carried == layer_dict
    assert type(instance).received(carried) == instance


def test_a_request_received_without_its_reply_channel_is_malformed() -> None:
    from pydantic import ValidationError

    built = RemoteProbeMessage(remote_id=1)  # the sender leaves it to request_reply
    assert built.reply_channel == "" and "reply_channel" not in built.for_layer()
    with pytest.raises(ValidationError, match="a request needs its reply_channel"):
        RemoteProbeMessage.received({"type": "remote.probe", "remote_id": 1})


def test_floats_the_layer_carries_stay_floats() -> None:
    # msgpack carries NaN and the infinities; the JSON dump must not turn them into null.
    sent = RemoteCallReply(result={"n": float("inf")}).for_layer()
    assert sent["result"]["n"] == float("inf")


def test_a_value_with_no_json_form_is_refused_before_it_reaches_the_layer() -> None:
    with pytest.raises(ValueError):
        RemoteCallReply(result=object()).for_layer()
