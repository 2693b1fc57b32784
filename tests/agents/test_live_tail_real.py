"""The built-in agent's live operations on a real shim (docs/live-operations.md#the-built-in-agent): a
real ``manage.py serve`` runs the expert's run in its background services, a real shim
(protocol 2.1) runs the command; only the model is a double.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agents.llm_double import LlmDouble, answer, tool_calls
from tests.infra import Instance, Server, ShimProcess, instance, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_SETUP = """
import json
from django.contrib.auth import get_user_model
from agents import services
from core.services import api_token_create
dana = get_user_model().objects.create_user("dana", password="pw-secret-123")
agent = services.agent_create(owner=dana, type="expert", name="builder", cwd={cwd!r})
print(json.dumps({{"token": api_token_create(user=dana).raw, "agent": agent.pk}}))
"""
COMMAND = "local_pc_execute_command"


@dataclass
class Live:
    instance: Instance
    server: Server
    llm: LlmDouble
    shim: ShimProcess
    root: Path  # the shim's allowed root, where its commands run
    token: str
    agent: str

    def api(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.request(method, f"{self.server.url}{path}", headers=headers, timeout=10, **kwargs)

    def prompt(self, instruction: str) -> str:
        response = self.api("POST", f"/api/v1/agents/{self.agent}/prompt", json={"instruction": instruction})
        assert response.status_code == 202, response.text
        return str(response.json()["run_id"])

    def run(self, run_id: str) -> dict[str, Any]:
        return dict(self.api("GET", f"/api/v1/runs/{run_id}").json())

    def finished(self, run_id: str, timeout: float = 30) -> dict[str, Any]:
        def done() -> Any:
            run = self.run(run_id)
            return run if run["status"] in ("succeeded", "failed", "cancelled") else None

        return dict(wait_until(done, timeout=timeout, what=f"run {run_id} to finish", details=self.server.log))

    def events(self, run_id: str) -> list[dict[str, Any]]:
        """The run's events, oldest first."""
        answer = self.api("GET", f"/api/v1/agents/{self.agent}/events", params={"limit": 200}).json()
        return [event for event in reversed(answer["events"]) if event.get("run_id") == run_id]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    llm = LlmDouble().start()
    root = tmp_path_factory.mktemp("root")
    try:
        with instance() as inst:
            created = json.loads(inst.manage("shell", "-c", _SETUP.format(cwd=str(root))).stdout.splitlines()[-1])
            server = inst.serve(DISPATCH_LLM_BASE_URL=llm.url, DISPATCH_LLM_MODEL="double-1")
            shim = inst.shim("workbench", root, "--session", created["agent"], token=created["token"])
            yield Live(instance=inst, server=server, llm=llm, shim=shim, root=root, **created)
    finally:
        llm.stop()


@pytest.fixture
def llm(live: Live) -> LlmDouble:
    live.llm.requests.clear()
    live.llm.script = []
    return live.llm


def sleeping(cwd: Path) -> list[int]:
    """The pids of the processes running exactly ``sleep 30`` in ``cwd`` (this test's
    commands: other tests on the machine may be sleeping too; Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and (entry / "cmdline").read_bytes() == b"sleep\x0030\x00"
                and Path(os.readlink(entry / "cwd")) == cwd.resolve()
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def tails(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if (event.get("metadata") or {}).get("tail")]


def test_a_long_commands_tail_reaches_the_timeline_while_it_runs(live: Live, llm: LlmDouble) -> None:
    command = "for i in $(seq 1 25); do echo line$i; sleep 0.2; done"
    llm.script = [tool_calls((COMMAND, {"command": command})), answer("built")]
    run_id = live.prompt("Build it.")

    seen_while_running = wait_until(
        lambda: live.run(run_id)["status"] == "running" and tails(live.events(run_id)),
        timeout=15,
        what="a tail event while the run is running",
        details=live.server.log,
    )
    run = live.finished(run_id)

    assert run["status"] == "succeeded", run
    assert "line" in seen_while_running[0]["message"]
    events = live.events(run_id)
    reported = tails(events)
    assert 2 <= len(reported) <= 4  # 5 s of output, at most one tail every 2 s
    for event in reported:
        lines = event["message"].splitlines()[1:]
        assert 1 <= len(lines) <= 20 and len("\n".join(lines).encode()) <= 2048
        assert all(line.startswith("line") for line in lines), lines
    messages = [event["message"] for event in events]
    assert messages.index(reported[-1]["message"]) < messages.index(f"tool result {COMMAND}")
    [result] = llm.tool_results(1)
    assert json.loads(result)["stdout"].splitlines()[-1] == "line25"  # the model still gets the whole output


def test_cancelling_the_run_stops_its_command_on_the_machine(live: Live, llm: LlmDouble) -> None:
    llm.script = [tool_calls((COMMAND, {"command": "echo started; sleep 30"})), answer("never")]
    run_id = live.prompt("Wait a while.")
    wait_until(
        lambda: any("started" in event["message"] for event in tails(live.events(run_id))),
        timeout=15,
        what="the command's first output on the timeline",
        details=live.server.log,
    )
    assert sleeping(live.root), "the command is not running"

    cancelled_at = time.monotonic()
    response = live.api("POST", f"/api/v1/runs/{run_id}/cancel")
    assert response.status_code in (200, 202), response.text
    wait_until(lambda: not sleeping(live.root), timeout=8, what="the command to be stopped", details=live.shim.log)

    assert time.monotonic() - cancelled_at < 8
    assert live.finished(run_id)["status"] == "cancelled"
    wait_until(
        lambda: any(event["message"].startswith("run cancelled") for event in live.events(run_id)),
        timeout=5,
        what="the run's cancel event",
    )
    assert len(llm.requests) == 1  # the model was not asked again
    [record] = [record for record in live.shim.audit() if record.get("op") == "EXECUTE_COMMAND"][-1:]
    assert record["result"].get("cancelled") is True, record  # the shim's one record of it
