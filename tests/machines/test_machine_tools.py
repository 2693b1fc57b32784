"""The machine tools for agents and MCP (docs/mcp.md#tools)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from core.errors import InvalidRequest
from machines.tools import COMMAND_HANDLE_TOOL_NAMES, ROUTING_NOTE, machine_tools
from tests.machines.conftest import settle, snapshots_stored

pytestmark = pytest.mark.django_db(transaction=True)

TOOL_NAMES = {
    "list_machines",
    "local_pc_execute_command",
    "local_pc_file_read",
    "local_pc_file_write",
    "local_pc_file_list",
    "local_pc_file_stat",
    "local_pc_file_delete",
    "local_pc_file_move",
    "local_pc_file_copy",
    "local_pc_pipe",
    "local_pc_command_start",  # the handle tools that name machines (read, wait and cancel take an id)
}


async def tools_for(user: Any, session_id: str = "s1") -> dict[str, Any]:
    return {tool.name: tool for tool in await machine_tools(user=user, session_id=session_id, caller="agt_1")}


async def test_the_tool_set_is_list_machines_and_the_local_pc_tools(owner):
    tools = await tools_for(owner)
    assert set(tools) == TOOL_NAMES | COMMAND_HANDLE_TOOL_NAMES
    for tool in tools.values():
        assert tool.parameters["type"] == "object"
    assert "target_machine" in tools["local_pc_file_read"].parameters["properties"]
    assert tools["local_pc_file_read"].parameters["required"] == ["path"]


async def test_with_two_machines_the_descriptions_list_them_and_explain_routing(shims, owner):
    await shims.connect(owner, machine_id="m1", hostname="laptop")
    await shims.connect(owner, machine_id="m2", hostname="nas", display_name="Home NAS", capabilities=["files"])
    tools = await tools_for(owner)
    for name in TOOL_NAMES - {"list_machines"}:
        description = tools[name].description
        assert ROUTING_NOTE in description, name
        assert "laptop" in description and "Home NAS" in description, name


async def test_with_one_machine_the_descriptions_do_not_explain_routing(shims, owner):
    await shims.connect(owner, machine_id="m1", hostname="laptop")
    tools = await tools_for(owner)
    assert ROUTING_NOTE not in tools["local_pc_file_read"].description
    assert "laptop" in tools["local_pc_file_read"].description


async def test_descriptions_only_count_machines_of_the_session(shims, owner):
    await shims.connect(owner, machine_id="m1", hostname="laptop", sessions=["s1"])
    await shims.connect(owner, machine_id="m2", hostname="nas", sessions=["s2"])
    tools = await tools_for(owner, "s1")
    assert ROUTING_NOTE not in tools["local_pc_file_read"].description
    assert "nas" not in tools["local_pc_file_read"].description


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("local_pc_file_read", {}),
        ("local_pc_file_read", {"path": 3}),
        ("local_pc_file_read", {"path": "/x", "encoding": "latin-1"}),
        ("local_pc_file_read", {"path": "/x", "unexpected": True}),
        ("local_pc_file_write", {"path": "/x"}),
        ("local_pc_execute_command", {"argv": []}),
        ("local_pc_execute_command", {"argv": ["sleep"], "timeout_seconds": 601}),
        ("local_pc_execute_command", {"argv": ["env"], "env": {"A": 1}}),
        ("local_pc_file_move", {"src": "/a"}),
        ("local_pc_file_copy", {"source_machine": "a", "source_path": "/x", "destination_machine": "b"}),
        ("list_machines", {"session_id": 3}),
        ("local_pc_file_stat", {"path": "/x", "target_machine": 5}),
    ],
)
async def test_arguments_that_fail_the_schema_are_invalid_requests(shims, owner, name, arguments):
    shim = await shims.connect(owner, machine_id="m1")
    tools = await tools_for(owner)
    with pytest.raises(InvalidRequest) as failure:
        await tools[name](arguments)
    assert name in failure.value.message
    assert [r for r in shim.requests if r["type"] != "MACHINE_LIST_REQUEST"] == []


async def test_a_tool_call_returns_the_payload_and_the_machine(shims, owner):
    shim = await shims.connect(owner, machine_id="m1", hostname="laptop")
    shim.files["/home/alice/a.txt"] = b"hi"
    tools = await tools_for(owner)
    result = await tools["local_pc_file_read"]({"path": "/home/alice/a.txt", "encoding": "utf-8"})
    assert result == {
        "content": "hi",
        "encoding": "utf-8",
        "size_bytes": 2,
        "offset": 0,
        "truncated": False,
        "machine_id": "m1",
    }
    request = shim.ops("FILE_READ")[0]
    assert request["payload"] == {"path": "/home/alice/a.txt", "encoding": "utf-8"}  # no routing arguments
    assert request["session_id"] == "s1"


async def test_tool_arguments_pick_the_machine_and_the_session(shims, owner):
    await shims.connect(owner, machine_id="m1", hostname="laptop", sessions=["s1"])
    server = await shims.connect(owner, machine_id="m2", hostname="server", sessions=["*"])
    tools = await tools_for(owner)
    result = await tools["local_pc_execute_command"]({"argv": ["uname"], "target_machine": "server"})
    assert result["machine_id"] == "m2"
    result = await tools["local_pc_execute_command"]({"argv": ["uname"], "session_id": "other"})
    assert result["machine_id"] == "m2"
    assert server.ops("EXECUTE_COMMAND")[-1]["session_id"] == "other"


async def test_list_machines_returns_the_snapshots(shims, owner):
    await shims.connect(owner, machine_id="m1", hostname="laptop")
    tools = await tools_for(owner)
    machines = await tools["list_machines"]({})
    assert [m["machine_id"] for m in machines] == ["m1"]
    assert machines[0]["status"]["connection"] == "connected"
    assert machines[0]["is_default"] is False


async def test_list_machines_keeps_last_active_ts_in_epoch_seconds(shims, owner):
    # The tool's word (docs/mcp.md#tools); the REST routes say last_active_at.
    await shims.connect(owner, machine_id="m1", hostname="laptop")
    await shims.connect(owner, machine_id="m2", hostname="idle")
    await snapshots_stored(owner, 2)
    tools = await tools_for(owner)
    before = time.time()
    await tools["local_pc_file_stat"]({"path": "/home/alice/x", "target_machine": "m1"})
    await settle()
    listed = {m["machine_id"]: m for m in await tools["list_machines"]({})}
    assert all("last_active_at" not in entry for entry in listed.values())
    assert isinstance(listed["m1"]["last_active_ts"], float)
    assert before - 1 <= listed["m1"]["last_active_ts"] <= time.time()
    assert listed["m2"]["last_active_ts"] is None
    assert list(listed["m1"])[-3:] == ["last_active_ts", "status", "is_default"]  # where it always was


async def test_the_copy_tool_copies_between_machines(shims, owner):
    laptop = await shims.connect(owner, machine_id="m1", hostname="laptop", allowed_roots=["/Users/alice"])
    server = await shims.connect(owner, machine_id="m2", hostname="server", allowed_roots=["/srv"])
    laptop.files["/Users/alice/a.csv"] = b"1,2,3\n"
    tools = await tools_for(owner)
    result = await tools["local_pc_file_copy"](
        {
            "source_machine": "laptop",
            "source_path": "/Users/alice/a.csv",
            "destination_machine": "server",
            "destination_path": "/srv/a.csv",
        }
    )
    assert result["size_bytes"] == 6
    assert server.files == {"/srv/a.csv": b"1,2,3\n"}


async def test_a_huge_bad_argument_gives_a_short_error(shims, owner):
    await shims.connect(owner, machine_id="m1")
    tools = await tools_for(owner)
    with pytest.raises(InvalidRequest) as failure:
        await tools["local_pc_file_read"]({"path": "/x", "encoding": "e" * 200_000})
    assert "local_pc_file_read" in failure.value.message and "…[cut]" in failure.value.message
    assert len(failure.value.message) < 1_000


async def test_the_pipe_tool_takes_its_session_id_argument(owner, monkeypatch):
    from machines import tools as machine_tools_module

    calls: list[dict[str, Any]] = []

    async def pipe(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return {"request_id": "r", "bytes": 0, "source": {}, "destination": {}}

    monkeypatch.setattr(machine_tools_module.live, "pipe", pipe)
    tools = await tools_for(owner)
    ends = {"source": {"machine": "a", "argv": ["cat"]}, "destination": {"machine": "b", "argv": ["wc"]}}
    await tools["local_pc_pipe"]({**ends, "session_id": "s1"})
    assert calls and calls[0]["session_id"] == "s1" and calls[0]["source"]["machine"] == "a"
