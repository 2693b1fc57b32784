"""One shim protocol (docs/shim-protocol.md): ``machines.shim.protocol`` defines it, the
platform (``machines.protocol``, the shim consumer) imports it, and what must stay on
each side — the shim's ``HELLO`` builder and the platform's ``Hello`` model, the shim's
``encode`` and the server's ``core.wire.encode`` — is held to the same definitions here."""

from __future__ import annotations

import ast
import sys
import uuid
from pathlib import Path
from typing import Any, get_args

import pytest

from core import wire
from machines import protocol as platform
from machines.shim import protocol as shim
from machines.shim.connection import Shim
from machines.shim.jail import PathJail
from machines.shim.operations import MachineIdentity


def test_the_shim_protocol_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(shim.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} <= set(sys.stdlib_module_names) | {"__future__"}
    # The package as a whole: tests/machines/shim/test_shim_cli.py (no Django, no server module).


def _top_level_names(module: Any) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_the_platform_defines_no_frame_type_limit_or_envelope_of_its_own() -> None:
    own = _top_level_names(platform)
    shared = _top_level_names(shim)
    # What the platform adds on top; everything else it uses is the shim protocol's.
    assert own & shared == {"OPERATIONS"}  # a view of the shim's table, derived below
    for name in ("envelope", "encode", "PROTOCOL_VERSION", "MAX_FRAME_BYTES", "SESSION_ID_PATTERN", "parse_version"):
        assert name not in own
    assert platform.SESSION_ID_PATTERN is shim.SESSION_ID_PATTERN


def test_the_platforms_tables_are_views_of_the_shim_protocols() -> None:
    assert platform.OPERATIONS == {
        str(op): (None if capability is None else str(capability), str(response))
        for op, (response, capability) in shim.OPERATIONS.items()
    }
    assert platform.OPERATIONS["FILE_READ"] == ("files", "FILE_CONTENTS")
    assert platform.DEFAULT_LIMITS == shim.Limits().as_payload()
    assert platform.DEFAULT_LIMITS["max_file_size_bytes"] == 10 * 1024 * 1024
    assert platform.CAPABILITIES == {str(capability) for capability in shim.Capability}
    assert set(get_args(get_args(platform.Hello.model_fields["capabilities"].annotation)[0])) == platform.CAPABILITIES
    assert platform.CALLER_OPERATIONS == set(platform.OPERATIONS) - {"MACHINE_LIST_REQUEST", "PING"}


def test_the_hello_the_shim_sends_is_the_hello_the_platform_accepts(tmp_path: Path) -> None:
    shim_side = Shim(
        server="http://127.0.0.1:1",
        token="t",
        identity=MachineIdentity.detect(str(uuid.uuid4()), "laptop"),
        jail=PathJail([tmp_path]),
        capabilities=["shell", "files"],
    )
    frame = shim_side.hello_frame()
    assert frame["type"] == shim.MessageType.HELLO
    hello = platform.Hello.model_validate(frame["payload"])
    assert set(frame["payload"]) == set(platform.Hello.model_fields)
    assert platform.negotiate(hello.protocol_version) == shim.PROTOCOL_VERSION


SAMPLES: list[Any] = [
    {"type": "PING", "id": "1", "payload": {}},
    {"text": "Grüße, 東京 ✓", "n": [1, 2.5, None, True]},
    {"name": "bad\udcff.txt", "nested": {"deeper": ["\ud800"]}},
    {"empty": "", "quote": '"\\', "control": "\x00\x1f"},
]


@pytest.mark.parametrize("value", SAMPLES)
def test_the_server_and_the_shim_write_a_frame_alike(value: Any) -> None:
    assert wire.encode(value) == shim.encode(value)


def test_the_error_payload_is_built_once_for_both_sides() -> None:
    error = shim.ShimError(shim.ErrorCode.PATH_NOT_FOUND, "no such file", {"path": "/x"})
    assert error.payload() == shim.error_payload("PATH_NOT_FOUND", "no such file", details={"path": "/x"})
    assert shim.error_payload("AUTH_FAILED", "bad token", fatal=True) == {
        "code": "AUTH_FAILED",
        "message": "bad token",
        "fatal": True,
    }


def test_the_version_rule_is_the_shim_protocols() -> None:
    assert shim.parse_version("2.7") == (2, 7)
    assert shim.major_version("3.0") == 3 and shim.major_version("x") is None
    with pytest.raises(ValueError, match=r"must look like '2\.0'"):
        shim.parse_version("2")
    assert platform.negotiate("2.9") == "2.1" and platform.negotiate("2.0") == "2.0"
    assert platform.negotiate("3.0") is None


def test_the_platform_redacts_with_the_shims_one_redaction() -> None:
    from machines.services import audit, inflight
    from machines.shim import redaction

    assert audit.redact is redaction.redact and inflight.redact is redaction.redact
    assert audit.redact_argv is redaction.redact_argv and inflight.redact_argv is redaction.redact_argv
