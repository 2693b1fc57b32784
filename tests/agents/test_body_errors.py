"""The pydantic request bodies of the agents app's DRF views (launch, prompt, message,
approval answer, approval rule, hook report) read a body and refuse it as the DRF
serializers they replaced did: the same values, and the same 400 ``VALIDATION_ERROR``
message and details (``core.validation.parse_request``). The oracles below are those
serializers as they were; one sentence differs on purpose and is pinned at the end."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel
from rest_framework import exceptions, serializers

from agents import approvals, cli_hooks, messages
from agents.api import AgentLaunchBody, MessageSendBody
from agents.approval_api import AnswerApprovalBody, ApprovalRuleCreateBody
from agents.hook_api import HookReportBody, _holds_nul
from agents.models import ApprovalRule
from agents.protocol import AgentPromptBody
from core.api import exception_handler
from core.validation import parse_request


class StrictCharField(serializers.CharField):
    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictChoiceField(serializers.ChoiceField):
    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid_choice", input=str(data)[:40])
        return super().to_internal_value(data)


class LaunchOracle(serializers.Serializer):
    type = StrictCharField(max_length=40, required=False, allow_blank=True, default="")
    name = StrictCharField(max_length=1000, trim_whitespace=False)
    prompt = StrictCharField(required=False, allow_blank=True, default="", trim_whitespace=False)
    cwd = StrictCharField(max_length=4096, trim_whitespace=False, required=False, allow_blank=True, default="")
    location = StrictCharField(required=False, allow_null=True, allow_blank=True, default=None)
    child = StrictBooleanField(required=False, default=False)
    full_access = StrictBooleanField(required=False, default=False)
    trust_folder = StrictBooleanField(required=False, default=False)


class PromptOracle(serializers.Serializer):
    instruction = StrictCharField(trim_whitespace=False)
    input = serializers.JSONField(required=False, allow_null=True, default=None)
    options = serializers.DictField(required=False, allow_null=True, default=None)


class MessageOracle(serializers.Serializer):
    content = StrictCharField(trim_whitespace=False, max_length=messages.MAX_MESSAGE_LENGTH)


class AnswerOracle(serializers.Serializer):
    decision = StrictChoiceField(choices=list(approvals.ANSWERS))
    message = StrictCharField(required=False, allow_blank=True, default="", max_length=approvals.MAX_MESSAGE)


class RuleOracle(serializers.Serializer):
    tool = StrictCharField(max_length=approvals.MAX_TOOL_NAME)
    pattern = StrictCharField(
        required=False, allow_blank=True, default="", max_length=approvals.MAX_PATTERN, trim_whitespace=False
    )
    action = StrictChoiceField(choices=ApprovalRule.Action.values)
    agent_id = StrictCharField(required=False, allow_null=True, default=None)


class HookPayloadField(serializers.JSONField):
    def to_internal_value(self, data: Any) -> Any:
        if data is None:
            return None
        if not isinstance(data, dict):
            raise serializers.ValidationError("must be a JSON object or null")
        if _holds_nul(data):
            raise serializers.ValidationError("must not hold a NUL character")
        size = len(json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > cli_hooks.MAX_PAYLOAD_BYTES:
            raise serializers.ValidationError(f"must be at most {cli_hooks.MAX_PAYLOAD_BYTES} bytes of JSON")
        return data


class HookOracle(serializers.Serializer):
    event = serializers.ChoiceField(choices=cli_hooks.HOOK_EVENTS)
    payload = HookPayloadField(allow_null=True)


def answered(exc: exceptions.ValidationError) -> tuple[int, Any]:
    response = exception_handler(exc, {})
    assert response is not None
    return response.status_code, json.loads(json.dumps(response.data))


def refusal_of(oracle: type[serializers.Serializer], body: Any) -> tuple[int, Any] | None:
    serializer = oracle(data=body)
    try:
        serializer.is_valid(raise_exception=True)
    except exceptions.ValidationError as exc:
        return answered(exc)
    return None


def parsed_or_refused(model: type[BaseModel], body: Any) -> tuple[int, Any] | BaseModel:
    try:
        return parse_request(model, body)
    except exceptions.ValidationError as exc:
        return answered(exc)


LONG = "x" * 1001
CASES: list[tuple[type[BaseModel], type[serializers.Serializer], Any]] = [
    # launch
    (AgentLaunchBody, LaunchOracle, {"name": "a"}),
    (AgentLaunchBody, LaunchOracle, {"name": " a ", "type": " expert ", "location": "  ", "cwd": " /x "}),
    (AgentLaunchBody, LaunchOracle, {"name": "a", "location": None, "child": True, "full_access": False}),
    (AgentLaunchBody, LaunchOracle, {"type": "expert", "cwd": "/tmp"}),
    (AgentLaunchBody, LaunchOracle, {"name": "a", "cwd": 3}),
    (AgentLaunchBody, LaunchOracle, {"name": 5}),
    (AgentLaunchBody, LaunchOracle, {"name": "a", "prompt": 5}),
    (AgentLaunchBody, LaunchOracle, {"type": 1, "name": "a"}),
    (AgentLaunchBody, LaunchOracle, {"type": ["expert"], "name": "a"}),
    (AgentLaunchBody, LaunchOracle, {"name": ""}),
    (AgentLaunchBody, LaunchOracle, {"name": "   "}),
    (AgentLaunchBody, LaunchOracle, {"name": None}),
    (AgentLaunchBody, LaunchOracle, {"name": LONG}),
    (AgentLaunchBody, LaunchOracle, {"name": "a", "type": "t" * 41}),
    (AgentLaunchBody, LaunchOracle, {"name": "a", "full_access": "yes"}),
    (AgentLaunchBody, LaunchOracle, {"name": "a", "child": 1}),
    (AgentLaunchBody, LaunchOracle, {"name": "a", "trust_folder": None}),
    (AgentLaunchBody, LaunchOracle, {"name": "a\x00b"}),
    (AgentLaunchBody, LaunchOracle, {"name": "a", "location": "l\x00"}),
    (AgentLaunchBody, LaunchOracle, {"name": "", "cwd": 3, "child": "no"}),
    (AgentLaunchBody, LaunchOracle, ["name"]),
    (AgentLaunchBody, LaunchOracle, "name"),
    # prompt
    (AgentPromptBody, PromptOracle, {"instruction": "  hi  ", "input": [1, {"a": None}], "options": {"tools": []}}),
    (AgentPromptBody, PromptOracle, {"instruction": "   "}),
    (AgentPromptBody, PromptOracle, {}),
    (AgentPromptBody, PromptOracle, {"instruction": ""}),
    (AgentPromptBody, PromptOracle, {"instruction": None}),
    (AgentPromptBody, PromptOracle, {"instruction": 5}),
    (AgentPromptBody, PromptOracle, {"instruction": "a\x00"}),
    (AgentPromptBody, PromptOracle, {"instruction": "hi", "options": ["remotes"]}),
    (AgentPromptBody, PromptOracle, {"instruction": "hi", "options": "x"}),
    (AgentPromptBody, PromptOracle, {"instruction": "hi", "options": None, "input": None}),
    # message
    (MessageSendBody, MessageOracle, {"content": " text "}),
    (MessageSendBody, MessageOracle, {"content": ""}),
    (MessageSendBody, MessageOracle, {"content": 1}),
    (MessageSendBody, MessageOracle, {"content": "x" * (messages.MAX_MESSAGE_LENGTH + 1)}),
    (MessageSendBody, MessageOracle, {}),
    # approval answer
    (AnswerApprovalBody, AnswerOracle, {"decision": "deny", "message": " no "}),
    (AnswerApprovalBody, AnswerOracle, {"decision": "allow_once"}),
    (AnswerApprovalBody, AnswerOracle, {"decision": "maybe"}),
    (AnswerApprovalBody, AnswerOracle, {"decision": ""}),
    (AnswerApprovalBody, AnswerOracle, {"decision": 5}),
    (AnswerApprovalBody, AnswerOracle, {"decision": None}),
    (AnswerApprovalBody, AnswerOracle, {"decision": "deny", "message": 5}),
    (AnswerApprovalBody, AnswerOracle, {"decision": "deny", "message": "m" * 2001}),
    (AnswerApprovalBody, AnswerOracle, {}),
    # approval rule
    (ApprovalRuleCreateBody, RuleOracle, {"tool": " Bash ", "pattern": " ls * ", "action": "allow"}),
    (ApprovalRuleCreateBody, RuleOracle, {"tool": "*", "action": "deny", "agent_id": " agt_1 "}),
    (ApprovalRuleCreateBody, RuleOracle, {"tool": "*", "action": "deny", "agent_id": None}),
    (ApprovalRuleCreateBody, RuleOracle, {"tool": "*", "action": "deny", "agent_id": ""}),
    (ApprovalRuleCreateBody, RuleOracle, {"tool": "", "action": "nope"}),
    (ApprovalRuleCreateBody, RuleOracle, {"tool": "t" * 201, "action": "ask"}),
    (ApprovalRuleCreateBody, RuleOracle, {"tool": "*", "action": "ask", "pattern": "p" * 1001}),
    (ApprovalRuleCreateBody, RuleOracle, {"tool": 3, "action": True}),
    (ApprovalRuleCreateBody, RuleOracle, {}),
    # hook report
    (HookReportBody, HookOracle, {"event": "Stop", "payload": {"a": [1, None]}}),
    (HookReportBody, HookOracle, {"event": "Stop", "payload": None}),
    (HookReportBody, HookOracle, {"event": "Nope", "payload": {}}),
    (HookReportBody, HookOracle, {"event": "sessionstart", "payload": {}}),
    (HookReportBody, HookOracle, {"event": 7, "payload": {}}),
    (HookReportBody, HookOracle, {"payload": {}}),
    (HookReportBody, HookOracle, {"event": "Stop"}),
    (HookReportBody, HookOracle, {"event": "Stop", "payload": [1, 2]}),
    (HookReportBody, HookOracle, {"event": "Stop", "payload": "text"}),
    (HookReportBody, HookOracle, {"event": "Stop", "payload": {"m": "a\x00b"}}),
    (HookReportBody, HookOracle, {"event": "Stop", "payload": {"k\x00": [{"deep": ["\x00"]}]}}),
    (HookReportBody, HookOracle, {"event": "Stop", "payload": {"m": "x" * cli_hooks.MAX_PAYLOAD_BYTES}}),
]


@pytest.mark.parametrize(("model", "oracle", "body"), CASES)
def test_a_body_is_read_or_refused_as_its_drf_serializer_did(
    model: type[BaseModel], oracle: type[serializers.Serializer], body: Any
) -> None:
    expected = refusal_of(oracle, body)
    got = parsed_or_refused(model, body)
    if expected is not None:
        assert got == expected
        return
    assert isinstance(got, BaseModel), got
    serializer = oracle(data=body)
    assert serializer.is_valid()
    assert got.model_dump() == dict(serializer.validated_data)


def test_a_refused_value_is_echoed_at_most_40_characters_long() -> None:
    # An error must not echo a client's megabyte back at it: a refused value is quoted
    # cut to 40 characters, a short one whole.
    status, data = parsed_or_refused(AnswerApprovalBody, {"decision": ["x" * 50]})  # type: ignore[misc]
    assert status == 400
    assert data["error"]["details"] == {"decision": [f'"{str(["x" * 50])[:40]}" is not a valid choice.']}
    status, data = parsed_or_refused(AnswerApprovalBody, {"decision": "maybe"})  # type: ignore[misc]
    assert data["error"]["details"] == {"decision": ['"maybe" is not a valid choice.']}


@pytest.mark.parametrize(
    ("model", "body", "valid"),
    [
        (AgentLaunchBody, {"name": "a", "trust_folder": True}, True),
        (AgentLaunchBody, {"name": "a", "location": "lab"}, True),
        (AgentLaunchBody, {"name": "a", "location": "lab", "trust_folder": True}, False),
        (AnswerApprovalBody, {"decision": "deny", "message": "no"}, True),
        (AnswerApprovalBody, {"decision": "allow_once", "message": " "}, True),
        (AnswerApprovalBody, {"decision": "allow_once", "message": "why"}, False),
        (ApprovalRuleCreateBody, {"tool": "Bash", "action": "allow"}, True),
        (ApprovalRuleCreateBody, {"tool": "my tool", "action": "allow"}, False),
        (ApprovalRuleCreateBody, {"tool": "Bash\x7f", "action": "allow"}, False),
    ],
)
def test_a_request_schema_states_what_the_service_refuses(model: type[BaseModel], body: Any, valid: bool) -> None:
    # The rules the services add to the fields' types (a launch's trust_folder is for a
    # launch here, a message goes with deny only, a tool's name is one word) are in the
    # model's own schema, so the OpenAPI document states them.
    schema = model.model_json_schema(mode="validation")
    assert Draft202012Validator(schema).is_valid(body) is valid
