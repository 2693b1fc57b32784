"""Every ``/ws`` action and every channel-layer message the session consumer receives has
its pydantic model (dispatch/ws/protocol.py, remotes/protocol.py, agents/protocol.py;
docs/ws-protocol.md#actions)."""

from __future__ import annotations

import importlib.util
from typing import Any, get_args

import pytest
from pydantic import BaseModel, ValidationError

from agents.protocol import SendAgentPromptBody, UserEventMessage, run_finished_frame
from core.errors import InvalidRequest
from dispatch.ws.consumer import SessionConsumer
from dispatch.ws.protocol import NoBody
from remotes.protocol import (
    RemoteCallBody,
    RemoteCallMessage,
    RemoteCallResult,
    RemoteConnectBody,
    RemoteDisconnectedMessage,
    RemoteNameBody,
    RemoteProbeMessage,
)

VALID_BODIES: dict[str, dict[str, Any]] = {
    "ping": {},
    "remote-connect": {"remotename": "weather", "tools": []},
    "remote-disconnect": {"remotename": "weather"},
    "remote-list": {},
    "remote-call": {"remotename": "weather", "function": "forecast", "args": {"city": "Rome"}},
    "remote-call-result": {"requestId": "weather#0", "result": 1},
    "send-agent-prompt": {"agentId": "agt_0123456789ab", "instruction": "hi"},
}


ACTIONS = SessionConsumer.ACTIONS


def parse_action(action: str, message: dict[str, Any], body: Any) -> BaseModel:
    return ACTIONS[action].parse(message, body)


def test_every_action_the_consumer_handles_has_a_body_model() -> None:
    assert set(ACTIONS) == set(VALID_BODIES)
    for action, entry in ACTIONS.items():
        parsed = parse_action(action, {"action": action, "body": VALID_BODIES[action]}, VALID_BODIES[action])
        assert isinstance(parsed, entry.body), action
        assert issubclass(entry.body, BaseModel)


def test_one_table_names_each_actions_model_handler_and_limit() -> None:
    # One row per action: its handler is the consumer's method for it (docs/ws-protocol.md#actions),
    # and only ping and remote-call-result escape the rate limit (docs/ws-protocol.md#limits).
    for action, entry in ACTIONS.items():
        assert entry.handler is getattr(SessionConsumer, "do_" + action.replace("-", "_")), action
    assert {action for action, entry in ACTIONS.items() if not entry.limited} == {"ping", "remote-call-result"}


@pytest.mark.parametrize("body", [{}, [], "x", 5, {"anything": [1, 2]}])
def test_ping_and_remote_list_take_any_body(body: Any) -> None:
    for action in ("ping", "remote-list"):
        assert isinstance(parse_action(action, {"action": action}, body), NoBody)


@pytest.mark.parametrize(
    ("action", "body", "error"),
    [
        ("remote-connect", {"tools": []}, "missing field 'remotename'"),
        ("remote-connect", {"remotename": "w", "functions": [{"name": "bad name"}]}, "invalid functions[0].name"),
        ("remote-disconnect", [], "invalid body"),
        ("remote-call", {"remotename": "w", "function": "f", "timeout": 301}, "invalid timeout"),
        ("send-agent-prompt", "text", "body must be a JSON object with agentId and instruction"),
        ("send-agent-prompt", [1], "body must be a JSON object with agentId and instruction"),
    ],
)
def test_a_bad_body_is_refused_naming_what_is_wrong(action: str, body: Any, error: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_action(action, {"action": action, "body": body}, body)
    assert refused.value.message.startswith(error), refused.value.message


def test_a_remote_call_result_is_read_at_the_top_level_first_then_under_body() -> None:
    top = {"action": "remote-call-result", "requestId": "w#1", "result": "top", "body": {"requestId": "w#2"}}
    assert RemoteCallResult.from_frame(top, top["body"]).request_id == "w#1"
    nested = {"action": "remote-call-result", "body": {"requestId": "w#2", "result": [1, None]}}
    parsed = RemoteCallResult.from_frame(nested, nested["body"])
    assert (parsed.request_id, parsed.reply().for_layer()) == ("w#2", {"type": "remote.reply", "result": [1, None]})
    assert RemoteCallResult.from_frame({"action": "remote-call-result"}, "not an object").request_id is None


def test_a_remote_call_result_never_refuses_and_relays_errors_as_text() -> None:
    assert RemoteCallResult.model_validate({"requestId": 7}).request_id is None  # matches no call

    def relayed(result: dict[str, Any]) -> dict[str, Any]:
        """What the waiting caller's channel gets for a ``remote-call-result``."""
        return RemoteCallResult.model_validate({"requestId": "w#0", **result}).reply().for_layer()

    assert relayed({}) == {"type": "remote.reply", "result": None}
    assert relayed({"error": "no city"}) == {"type": "remote.reply", "error": "no city"}
    assert relayed({"error": {"code": 1}}) == {"type": "remote.reply", "error": '{"code": 1}'}


def test_a_prompt_body_passes_its_fields_on_as_sent() -> None:
    options = {"remotes": ["weather"]}
    parsed = SendAgentPromptBody.parse({"agentId": 5, "instruction": None, "options": options, "extra": 1})
    assert (parsed.agent_id, parsed.instruction, parsed.input) == (5, None, None)
    assert parsed.options is options


def test_the_session_consumer_handles_each_channel_message_under_its_type_with_its_model() -> None:
    handled = {
        "remote.call": RemoteCallMessage,
        "remote.probe": RemoteProbeMessage,
        "remote.disconnected": RemoteDisconnectedMessage,
        "user.event": UserEventMessage,
    }
    for kind, model in handled.items():
        assert get_args(model.model_fields["type"].annotation) == (kind,)
        assert getattr(SessionConsumer, kind.replace(".", "_")).channel_message is model


def test_a_malformed_channel_message_is_refused() -> None:
    call = {
        "type": "remote.call",
        "remote_id": 1,
        "remotename": "w",
        "function": "f",
        "args": {},
        "reply_channel": "reply!x",
        "timeout": 3.0,
    }
    assert RemoteCallMessage.received(call).timeout == 3.0
    for broken in (
        {**call, "type": "remote.probe"},
        {k: v for k, v in call.items() if k != "reply_channel"},
        {**call, "unknown": 1},
    ):
        with pytest.raises(ValidationError):
            RemoteCallMessage.received(broken)


def test_a_run_update_becomes_an_event_only_when_the_run_finished() -> None:
    assert run_finished_frame({"id": 1, "agent_id": "agt_1", "status": "running"}) is None
    assert run_finished_frame({"id": 1, "agent_id": "agt_1", "status": "succeeded", "output": "ok"}) == {
        "action": "run-finished",
        "agentId": "agt_1",
        "runId": 1,
        "status": "succeeded",
        "output": "ok",
    }


def test_the_ws_route_is_the_projects_not_the_remotes_app() -> None:
    from dispatch.routing import websocket_urlpatterns

    assert importlib.util.find_spec("remotes.routing") is None
    consumers = [getattr(route.callback, "consumer_class", None) for route in websocket_urlpatterns]
    assert SessionConsumer in consumers


def test_the_body_models_are_the_remotes_apps() -> None:
    # The remote actions' models live in the remotes app, below the /ws edge.
    for model in (RemoteConnectBody, RemoteNameBody, RemoteCallBody, RemoteCallResult):
        assert model.__module__ == "remotes.protocol"
