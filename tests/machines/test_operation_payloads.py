"""The machine-operation payloads, defined once in ``machines.shim.payloads`` (``PAYLOADS``:
standard-library dataclasses, since the shim installs without pydantic) and read three
ways: by the shim (``payload_of``), by the platform's pydantic models
(``machines.schemas.PAYLOAD_MODELS``, which ``POST …/ops`` validates with) and as the
tools' input schemas (``machines.tools``). docs/shim-protocol.md#operations."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from django.test import AsyncClient
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from machines import tools as machine_tools
from machines.schemas import (
    CALLER_PAYLOAD_MODELS,
    PAYLOAD_MODELS,
    SessionCopyBody,
    SessionOpBody,
    SessionPipeBody,
    without_nulls,
)
from machines.shim.payloads import MAX_LIST_ENTRIES, PATH_DESCRIPTION, PAYLOADS, LiveFields, payload_of
from machines.shim.protocol import ShimError

ACCEPTED, REFUSED = True, False

# Each operation's payloads, good and bad, with the verdict machines/shim/payloads.py's
# rules give (docs/shim-protocol.md#operations): the shim must give it, and every other
# reader must agree with the shim. A rule lost from the shared dataclasses would leave the
# three readers agreeing on a wrong verdict; the expected verdict catches that. Every
# required field, minimum length and numeric bound has a refusal here (and each bound its
# accepted edge).
SAMPLES: dict[str, list[tuple[dict[str, Any], bool]]] = {
    "FILE_READ": [
        ({"path": "a.txt"}, ACCEPTED),
        ({"path": "a.txt", "encoding": "base64", "offset": 0, "length": 10}, ACCEPTED),
        ({"path": "a.txt", "encoding": None, "offset": None}, ACCEPTED),  # null: absent
        ({"path": "a.txt", "length": 0}, ACCEPTED),  # length ge 0: its edge
        ({"path": "a.txt", "encoding": "utf-8"}, ACCEPTED),
        ({"path": ""}, REFUSED),  # path min_length 1
        ({"path": 3}, REFUSED),
        ({}, REFUSED),  # path is required
        ({"path": None, "offset": 3}, REFUSED),  # null reads as absent: still required
        ({"path": "a.txt", "encoding": "latin-1"}, REFUSED),
        ({"path": "a.txt", "offset": -1}, REFUSED),  # offset ge 0
        ({"path": "a.txt", "offset": "3"}, REFUSED),
        ({"path": "a.txt", "length": -1}, REFUSED),  # length ge 0
        ({"path": "a.txt", "length": True}, REFUSED),
        ({"path": "a.txt", "length": 2.5}, REFUSED),
    ],
    "FILE_WRITE": [
        ({"path": "a", "content": ""}, ACCEPTED),  # content may be empty
        ({"path": "a", "content": "x", "create_parents": True, "append": False}, ACCEPTED),
        ({"path": "a", "content": "eA==", "encoding": "base64"}, ACCEPTED),
        ({"path": "a"}, REFUSED),  # content is required
        ({"content": "x"}, REFUSED),  # path is required
        ({"path": "", "content": "x"}, REFUSED),  # path min_length 1
        ({"path": "a", "content": 5}, REFUSED),
        ({"path": "a", "content": "x", "encoding": "ascii"}, REFUSED),
        ({"path": "a", "content": "x", "append": 1}, REFUSED),
        ({"path": "a", "content": "x", "create_parents": "yes"}, REFUSED),
    ],
    "FILE_STAT": [
        ({"path": "/x"}, ACCEPTED),
        ({"path": "/x", "hash": True}, ACCEPTED),
        ({"path": "/x", "hash": None}, ACCEPTED),
        ({}, REFUSED),  # path is required
        ({"path": ""}, REFUSED),  # path min_length 1
        ({"path": "/x", "hash": "true"}, REFUSED),
        ({"path": ["/x"]}, REFUSED),
    ],
    "FILE_LIST": [
        ({"path": ".", "glob": "*.py", "recursive": True, "max_entries": MAX_LIST_ENTRIES}, ACCEPTED),  # le: its edge
        ({"path": ".", "max_entries": 1}, ACCEPTED),  # ge 1: its edge
        ({"path": ".", "recursive": None, "include_hidden": True}, ACCEPTED),
        ({}, REFUSED),  # path is required
        ({"path": ""}, REFUSED),  # path min_length 1
        ({"path": ".", "max_entries": 0}, REFUSED),  # max_entries ge 1
        ({"path": ".", "max_entries": -1}, REFUSED),
        ({"path": ".", "max_entries": MAX_LIST_ENTRIES + 1}, REFUSED),  # max_entries le MAX_LIST_ENTRIES
        ({"path": ".", "glob": ""}, REFUSED),  # glob min_length 1
        ({"path": ".", "include_hidden": 0}, REFUSED),
        ({"path": ".", "recursive": "true"}, REFUSED),
    ],
    "FILE_DELETE": [
        ({"path": "d", "recursive": True, "missing_ok": True}, ACCEPTED),
        ({"path": "d"}, ACCEPTED),
        ({}, REFUSED),  # path is required
        ({"path": ""}, REFUSED),  # path min_length 1
        ({"path": "d", "missing_ok": "no"}, REFUSED),
        ({"path": "d", "recursive": 1}, REFUSED),
    ],
    "FILE_MOVE": [
        ({"src": "a", "dst": "b", "overwrite": True}, ACCEPTED),
        ({"src": "a", "dst": "b"}, ACCEPTED),
        ({"src": "a"}, REFUSED),  # dst is required
        ({"dst": "b"}, REFUSED),  # src is required
        ({"src": "", "dst": "b"}, REFUSED),  # src min_length 1
        ({"src": "a", "dst": ""}, REFUSED),  # dst min_length 1
        ({"src": "a", "dst": 1}, REFUSED),
        ({"src": "a", "dst": "b", "overwrite": "yes"}, REFUSED),
    ],
    "EXECUTE_COMMAND": [
        ({"argv": ["ls", "-l"]}, ACCEPTED),
        ({"command": "ls | wc -l", "cwd": "sub", "timeout_seconds": 1, "env": {"A": "b"}}, ACCEPTED),
        ({"argv": ["cat"], "stream": True, "stdin": "stream", "binary": False, "pipe": True}, ACCEPTED),
        ({"argv": ["ls"], "timeout_seconds": 600.0}, ACCEPTED),  # le 600: its edge
        ({"argv": ["ls"], "timeout_seconds": 0.001}, ACCEPTED),  # gt 0
        ({"argv": ["ls"], "stdin": "null"}, ACCEPTED),
        ({}, ACCEPTED),  # argv or command: Operations checks that, not the payload (the class's docstring)
        ({"argv": []}, REFUSED),  # argv min_length 1
        ({"argv": ["ls", 1]}, REFUSED),
        ({"argv": "ls"}, REFUSED),
        ({"command": ""}, REFUSED),  # command min_length 1
        ({"command": ["ls"]}, REFUSED),
        ({"argv": ["ls"], "timeout_seconds": 0}, REFUSED),  # timeout_seconds gt 0
        ({"argv": ["ls"], "timeout_seconds": -1}, REFUSED),
        ({"argv": ["ls"], "timeout_seconds": 601}, REFUSED),  # timeout_seconds le 600
        ({"argv": ["ls"], "timeout_seconds": 600.5}, REFUSED),
        ({"argv": ["ls"], "timeout_seconds": True}, REFUSED),
        ({"argv": ["ls"], "timeout_seconds": "5"}, REFUSED),
        ({"argv": ["ls"], "cwd": 1}, REFUSED),
        ({"argv": ["ls"], "env": {"A": 1}}, REFUSED),
        ({"argv": ["ls"], "env": ["A=b"]}, REFUSED),
        ({"argv": ["ls"], "stdin": "file"}, REFUSED),
        ({"argv": ["ls"], "stream": "yes"}, REFUSED),
        ({"argv": ["ls"], "binary": 1}, REFUSED),
        ({"argv": ["ls"], "pipe": "true"}, REFUSED),
    ],
}


def shim_accepts(op: str, payload: dict[str, Any]) -> bool:
    try:
        payload_of(PAYLOADS[op], payload)
    except ShimError as error:
        assert error.code == "INVALID_REQUEST"
        return False
    return True


def platform_accepts(op: str, payload: dict[str, Any]) -> bool:
    try:
        PAYLOAD_MODELS[op].model_validate(without_nulls(payload))
    except ValidationError:
        return False
    return True


def schema_accepts(op: str, payload: dict[str, Any]) -> bool:
    schema = PAYLOAD_MODELS[op].model_json_schema()
    return Draft202012Validator(schema).is_valid(without_nulls(payload))


def test_every_operation_a_caller_may_request_has_its_samples() -> None:
    assert set(SAMPLES) == set(PAYLOADS) == set(PAYLOAD_MODELS)


@pytest.mark.parametrize(
    ("op", "payload", "expected"),
    [(op, payload, expected) for op, samples in SAMPLES.items() for payload, expected in samples],
)
def test_the_shim_the_platform_and_the_schema_accept_and_refuse_the_same_payloads(
    op: str, payload: dict[str, Any], expected: bool
) -> None:
    shim = shim_accepts(op, payload)
    assert shim == expected, (op, payload, "accepted" if shim else "refused")
    assert platform_accepts(op, payload) == shim, (op, payload, shim)
    assert schema_accepts(op, payload) == shim, (op, payload, shim)


def test_the_shim_reads_a_payload_as_its_model_with_the_defaults() -> None:
    request = payload_of(PAYLOADS["FILE_LIST"], {"path": ".", "recursive": None, "unknown": 1})
    assert dataclasses.asdict(request) == {
        "path": ".",
        "glob": None,
        "recursive": False,
        "include_hidden": False,
        "max_entries": None,
    }
    with pytest.raises(ShimError, match="'max_entries' must be an integer at least 1 and at most 100000"):
        payload_of(PAYLOADS["FILE_LIST"], {"path": ".", "max_entries": 0})
    with pytest.raises(ShimError, match="'path' is required"):
        payload_of(PAYLOADS["FILE_STAT"], {})


def test_each_operation_tool_takes_its_payload_models_fields_but_the_platforms() -> None:
    live = {field.name for field in dataclasses.fields(LiveFields)}
    for op, _summary, parameters in machine_tools.OPERATION_TOOLS.values():
        model = PAYLOAD_MODELS[op].model_json_schema()
        own = set(parameters["properties"]) - {"target_machine", "target_machines", "session_id"}
        assert own == set(model["properties"]) - live == set(CALLER_PAYLOAD_MODELS[op].model_fields), op
        assert parameters["required"] == model.get("required", []), op
        assert parameters["additionalProperties"] is False
    file_list = machine_tools.OPERATION_TOOLS["local_pc_file_list"][2]["properties"]
    assert file_list["max_entries"] == {"maximum": MAX_LIST_ENTRIES, "minimum": 1, "type": "integer"}
    command = machine_tools.OPERATION_TOOLS["local_pc_execute_command"][2]["properties"]
    assert command["timeout_seconds"]["maximum"] == 600 and command["timeout_seconds"]["exclusiveMinimum"] == 0


@pytest.mark.django_db(transaction=True)
async def test_the_route_refuses_a_bad_payload_before_any_machine_is_asked(
    shims: Any, owner: Any, owner_token: str
) -> None:
    shim = await shims.connect(owner, machine_id="m1")
    client = AsyncClient()

    async def post(payload: dict[str, Any]) -> Any:
        return await client.post(
            "/api/v1/sessions/s1/ops",
            json.dumps({"op": "FILE_READ", "payload": payload}),
            content_type="application/json",
            headers={"authorization": f"Bearer {owner_token}"},
        )

    for payload, message in [
        ({"path": "/home/alice/a.txt", "offset": "3"}, "payload.offset: A valid integer is required."),
        ({"offset": 3}, "payload.path: This field is required."),
        ({"path": "/home/alice/a.txt", "encoding": "latin-1"}, 'payload.encoding: "latin-1" is not a valid choice.'),
        ({"path": "/a", "length": -1}, "payload.length: Ensure this value is greater than or equal to 0."),
    ]:
        response = await post(payload)
        assert response.status_code == 400, response.content
        error = response.json()["error"]
        assert error["code"] == "INVALID_REQUEST" and error["message"] == message, error
    assert shim.ops("FILE_READ") == []
    shim.files["/home/alice/a.txt"] = b"hi"
    response = await post({"path": "/home/alice/a.txt", "offset": None, "unknown": 1})  # null: absent
    assert response.status_code == 200, response.content
    assert shim.ops("FILE_READ")[-1]["payload"] == {"path": "/home/alice/a.txt", "offset": None, "unknown": 1}


def test_the_copy_tool_takes_the_copy_bodys_fields_but_the_rest_routes_own() -> None:
    body = SessionCopyBody.model_json_schema()
    parameters = machine_tools.COPY_PARAMETERS
    assert set(parameters["properties"]) == set(body["properties"]) - {"stream", "request_id"} | {"session_id"}
    assert parameters["required"] == body["required"]
    assert parameters["properties"]["source_path"]["description"] == PATH_DESCRIPTION


def test_the_ops_body_schema_says_each_operations_payload_as_the_route_checks_it() -> None:
    validator = Draft202012Validator(SessionOpBody.model_json_schema())
    for body, valid in [
        ({"op": "FILE_READ", "payload": {"path": "a.txt", "offset": 2}}, True),
        ({"op": "FILE_READ", "payload": {}}, False),
        ({"op": "FILE_READ"}, False),  # payload {}: no path
        ({"op": "EXECUTE_COMMAND"}, True),  # (the shim then wants argv or command)
        ({"op": "FILE_LIST", "payload": {"path": ".", "max_entries": MAX_LIST_ENTRIES + 1}}, False),
        ({"op": "EXECUTE_COMMAND", "payload": {"argv": ["ls"], "timeout_seconds": 5}}, True),
        ({"op": "EXECUTE_COMMAND", "payload": {"argv": "ls"}}, False),
    ]:
        assert validator.is_valid(body) == valid, body
        try:
            SessionOpBody.model_validate(body)
        except ValidationError:
            accepted = False
        else:
            accepted = True
        assert accepted == valid, body
    # The platform's own fields are not a caller's: not in the schema (machine_op refuses them set).
    command = CALLER_PAYLOAD_MODELS["EXECUTE_COMMAND"].model_json_schema()["properties"]
    assert not set(command) & {field.name for field in dataclasses.fields(LiveFields)}


def test_the_pipe_tool_takes_the_pipe_bodys_fields_but_request_id() -> None:
    body = SessionPipeBody.model_json_schema()
    parameters = machine_tools.PIPE_PARAMETERS
    assert set(parameters["properties"]) == set(body["properties"]) - {"request_id"} | {"session_id"}
    assert parameters["required"] == body["required"] == ["source", "destination"]
    source = {key: value for key, value in parameters["properties"]["source"].items() if key != "description"}
    assert source == {key: value for key, value in body["properties"]["source"].items() if key != "title"}
    assert parameters["properties"]["timeout_seconds"]["maximum"] == 600  # the route's ceiling, said to the tool
