"""Typed ``/ws`` wire messages, validated on the way in (spec/sessions-and-remotes.md).

Every parser raises ``InvalidRequest`` whose message names the field that is wrong; the
consumer turns it into ``{"error": "<message>", "nonce"}``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator

from core.errors import InvalidRequest
from remotes.schemas import non_local_refs

REMOTENAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,63}$"
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_FUNCTIONS = 128
MAX_CALL_TIMEOUT = 300.0  # seconds (§2.3)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

REMOTENAME_RULE = "1-64 characters from letters, digits and '._/-', starting with a letter or digit"
FUNCTION_NAME_RULE = "1-64 characters from letters, digits, '_' and '-'"


def describe_validation_error(exc: ValidationError) -> str:
    """The first pydantic error as ``invalid <field path>: <reason>``."""
    error = exc.errors(include_url=False)[0]
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    reason = str(error.get("ctx", {}).get("error") or error["msg"])
    if error["type"] == "missing":
        return f"missing field '{path}'"
    return f"invalid {path or 'body'}: {reason}"


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """Validate an action's ``body`` against ``model``; ``InvalidRequest`` names the bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


def check_remotename(value: str) -> str:
    """Return ``value`` when it is a valid remote name (§2.1), else raise ``ValueError``."""
    if not re.fullmatch(REMOTENAME_PATTERN, value):
        raise ValueError(f"must be {REMOTENAME_RULE}")
    return value


class FunctionSpec(BaseModel):
    """One function of a remote: ``{name, description, parameters}`` (§2.1)."""

    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    description: StrictStr = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(FUNCTION_NAME_PATTERN, value):
            raise ValueError(f"must be {FUNCTION_NAME_RULE}")
        return value

    @field_validator("description", mode="before")
    @classmethod
    def _description(cls, value: Any) -> Any:
        return "" if value is None else value

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters(cls, value: Any) -> Any:
        if value is None:
            return dict(EMPTY_PARAMETERS)
        if not isinstance(value, dict):
            raise ValueError("must be a JSON Schema object")
        try:
            validator_for(value, default=Draft202012Validator).check_schema(value)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        if value.get("type") != "object":
            raise ValueError('the schema\'s "type" must be "object"')
        remote_refs = non_local_refs(value)
        if remote_refs:
            raise ValueError(f"only local $ref ('#/...') are allowed, got {remote_refs[0][:100]!r}")
        return value


class RemoteConnectBody(BaseModel):
    """``remote-connect`` body: ``{remotename, tools}`` (``functions`` is an alias of ``tools``)."""

    model_config = ConfigDict(extra="ignore")

    remotename: StrictStr
    tools: list[FunctionSpec]

    @field_validator("remotename")
    @classmethod
    def _remotename(cls, value: str) -> str:
        return check_remotename(value)

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[FunctionSpec]) -> list[FunctionSpec]:
        if len(value) > MAX_FUNCTIONS:
            raise ValueError(f"a remote has 0 to {MAX_FUNCTIONS} functions, got {len(value)}")
        seen: set[str] = set()
        for spec in value:
            if spec.name in seen:
                raise ValueError(f"duplicate function name '{spec.name}'")
            seen.add(spec.name)
        return value

    @classmethod
    def parse(cls, body: Any) -> RemoteConnectBody:
        """Validate a ``remote-connect`` body, accepting ``functions`` for ``tools``."""
        alias = isinstance(body, dict) and "tools" not in body and "functions" in body
        if alias:
            body = {**body, "tools": body["functions"]}
        try:
            parsed: RemoteConnectBody = parse_body(cls, body)
        except InvalidRequest as exc:
            if alias:  # name the field the client actually sent
                exc.message = exc.message.replace("tools", "functions", 1)
                exc.args = (exc.message,)
            raise
        return parsed


class RemoteNameBody(BaseModel):
    """``remote-disconnect`` body: ``{remotename}``."""

    model_config = ConfigDict(extra="ignore")

    remotename: StrictStr


class RemoteCallBody(BaseModel):
    """``remote-call`` body: ``{remotename, function, args, timeout?}`` (timeout in seconds, ≤ 300)."""

    model_config = ConfigDict(extra="ignore")

    remotename: StrictStr
    function: StrictStr
    args: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError("must be an object")
        return value

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout_type(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError("must be a number of seconds")
        return value

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= MAX_CALL_TIMEOUT:
            raise ValueError(f"must be a number of seconds above 0 and at most {MAX_CALL_TIMEOUT:g}")
        return value


def encode(message: dict[str, Any]) -> str:
    """Serialise one outgoing frame (compact JSON, UTF-8 kept as is).

    A string may hold a lone surrogate (a client's ``"\\ud800"`` escape decodes to one),
    which UTF-8 cannot carry: the server would fail to send the frame. Such a frame is
    written with ``\\u`` escapes instead, which mean the same JSON.
    """
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            return json.dumps(message, separators=(",", ":"))
    return text


def remote_call_event(*, request_id: str, remotename: str, function: str, args: dict[str, Any]) -> str:
    """The downstream ``remote-call`` event (§2.2) as a frame; it never carries a nonce."""
    return encode(
        {"action": "remote-call", "requestId": request_id, "remotename": remotename, "function": function, "args": args}
    )
