"""The expert agent using real machines (docs/agents.md#the-expert-agent: the machine
tools with the agent's id as the session; docs/mcp.md#tools).

A real ``manage.py serve`` runs the expert's runs in its background services; a real shim
subprocess is attached to the agent's session; only the model is a double
(``tests/agents/llm_double.py``, in this process, scripted per test).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agents.llm_double import LlmDouble, answer, tool_calls
from tests.infra import Instance, Server, instance, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_SETUP = """
import json
from django.contrib.auth import get_user_model
from agents import services
from core.services import api_token_create
bob = get_user_model().objects.create_user("bob", password="pw-secret-123")
agents = [services.agent_create(owner=bob, type="expert", name=name, cwd={cwd!r}).pk for name in ("hands", "idle")]
print(json.dumps({{"token": api_token_create(user=bob).raw, "hands": agents[0], "idle": agents[1]}}))
"""


@dataclass
class Live:
    instance: Instance
    server: Server
    llm: LlmDouble
    token: str
    hands: str  # an expert agent with a shim attached to its session (in the tests that start one)
    idle: str  # an expert agent with no machine

    def prompt(self, agent_id: str, instruction: str) -> dict[str, Any]:
        """Prompt ``agent_id`` over REST and wait for its run to finish; the run."""
        response = httpx.post(
            f"{self.server.url}/api/v1/agents/{agent_id}/prompt",
            json={"instruction": instruction},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )
        assert response.status_code == 202, response.text
        run_id = response.json()["run_id"]

        def finished() -> Any:
            run = self.server.get(f"/api/v1/runs/{run_id}", self.token).json()
            return run if run["status"] in ("succeeded", "failed", "cancelled") else None

        return dict(wait_until(finished, timeout=30, what=f"run {run_id} to finish", details=self.server.log))


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    llm = LlmDouble().start()
    try:
        with instance() as inst:
            cwd = inst.env["DISPATCH_DATA_DIR"]
            created = json.loads(inst.manage("shell", "-c", _SETUP.format(cwd=cwd)).stdout.strip().splitlines()[-1])
            server = inst.serve(DISPATCH_LLM_BASE_URL=llm.url, DISPATCH_LLM_MODEL="double-1")
            yield Live(instance=inst, server=server, llm=llm, **created)
    finally:
        llm.stop()


@pytest.fixture
def llm(live: Live) -> LlmDouble:
    live.llm.requests.clear()
    live.llm.script = []
    return live.llm


def test_the_expert_runs_a_command_and_reads_a_file_on_a_real_shim(live: Live, llm: LlmDouble, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "notes.txt").write_text("remember the milk\n")
    shim = live.instance.shim("workbench", root, "--session", live.hands, token=live.token, state_dir=tmp_path / "s")
    llm.script = [
        tool_calls(
            ("local_pc_execute_command", {"argv": ["sh", "-c", "echo hi-from-$((40+2)); pwd"]}),
            ("local_pc_file_read", {"path": "notes.txt"}),
        ),
        answer("The note says to remember the milk."),
    ]
    try:
        run = live.prompt(live.hands, "What does my note say? Check where you are too.")
    finally:
        shim.stop()

    assert (run["status"], run["output"]) == ("succeeded", "The note says to remember the milk."), run
    offered = llm.tool_names(0)
    assert offered[0] == "list_machines" and "local_pc_execute_command" in offered
    executed, read = (json.loads(text) for text in llm.tool_results(1))
    assert executed["exit_code"] == 0
    assert executed["stdout"].splitlines() == ["hi-from-42", str(root.resolve())]
    assert executed["machine_id"] == shim.machine_id
    assert read["content"] == "remember the milk\n"
    assert read["machine_id"] == shim.machine_id
    assert sorted(shim.audited_ops()) == ["EXECUTE_COMMAND", "FILE_READ"]
    described = next(t for t in llm.requests[0]["tools"] if t["function"]["name"] == "local_pc_execute_command")
    assert "Attached machine: workbench." in described["function"]["description"]


def test_without_a_machine_the_tool_result_is_an_error_string_and_the_run_goes_on(live: Live, llm: LlmDouble) -> None:
    llm.script = [
        tool_calls(("local_pc_execute_command", {"argv": ["true"]})),
        answer("No machine is attached, so I could not run it."),
    ]

    run = live.prompt(live.idle, "Run true on my machine.")

    assert (run["status"], run["output"]) == ("succeeded", "No machine is attached, so I could not run it."), run
    [result] = llm.tool_results(1)
    assert result.startswith("error: MACHINE_NOT_ATTACHED: "), result
    assert len(llm.requests) == 2
    events = live.server.get(f"/api/v1/agents/{live.idle}/events", live.token).json()["events"]
    assert any(event["message"] == "tool result local_pc_execute_command" for event in events)
