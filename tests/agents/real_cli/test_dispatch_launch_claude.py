"""Dispatch launches the REAL Claude Code (tests/clients) through ``POST /api/v1/agents`` on a
real ``manage.py serve``, against the fake model, with a fresh HOME and a never-seen folder
(docs/agents.md#folder-trust, docs/agents.md#what-dispatch-writes): with ``trust_folder`` the CLI
starts with no dialog and the first prompt reaches the model; in a folder nobody trusted
the launch is refused and nothing is written; a full-access launch as root works.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.types import DEFAULT_AGENT_TYPES
from tests.agents.fake_model import FakeModel, say
from tests.agents.real_cli.conftest import API_KEY, Run, cli_or_skip
from tests.agents.real_cli.dispatch_fixtures import Dispatch, dispatch_serve  # noqa: F401 - a fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def claude_dispatch(
    fake_model: FakeModel,
    run: Run,
    dispatch_serve: Callable[[dict[str, Any]], Dispatch],  # noqa: F811 - the fixture imported above
) -> Iterator[Dispatch]:
    """Dispatch serving with one ``claude`` type: the pinned CLI, the default argv (its MCP
    config), the fake model and a fresh HOME in its environment."""
    claude = cli_or_skip("claude")
    default = DEFAULT_AGENT_TYPES["claude"]
    spec = {
        **default,
        "argv": [claude, *default["argv"][1:]],
        "full_access_argv": [claude, *default["full_access_argv"][1:]],
        "env": {"HOME": str(run.home), "ANTHROPIC_BASE_URL": fake_model.url, "ANTHROPIC_API_KEY": API_KEY},
    }
    yield dispatch_serve({"claude": spec})


def _first_prompt_reaches_the_model(dispatch: Dispatch, fake_model: FakeModel, run: Run, **launch: Any) -> str:
    prompt = f"hello from dispatch marker-{run.workdir.name}"
    fake_model.queue(say("pong"))
    launched = dispatch.launch(type="claude", name="cc", cwd=str(run.workdir), prompt=prompt, **launch)
    assert launched.status_code == 201, launched.text
    agent_id = launched.json()["id"]
    dispatch.wait_running(agent_id)
    try:
        fake_model.wait_for(lambda: fake_model.prompts_containing(prompt), timeout=25)
    except TimeoutError:
        log = dispatch.server.log()[-3000:]
        pytest.fail(f"the prompt never reached the model; {dispatch.agent(agent_id)}\n{dispatch.pane(agent_id)}\n{log}")
    return str(agent_id)


def test_dispatch_launches_claude_in_a_never_seen_folder_it_trusts_and_the_prompt_reaches_the_model(
    claude_dispatch: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    _first_prompt_reaches_the_model(claude_dispatch, fake_model, run, trust_folder=True)

    config = json.loads((run.home / ".claude.json").read_text())
    assert config["projects"][str(run.workdir)]["hasTrustDialogAccepted"] is True
    assert API_KEY[-20:] in config["customApiKeyResponses"]["approved"]
    assert "bypassPermissionsModeAccepted" not in config


def test_claude_in_a_folder_nobody_trusted_is_refused_and_nothing_is_written(
    claude_dispatch: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    refused = claude_dispatch.launch(type="claude", name="cc", cwd=str(run.workdir), prompt="hi")

    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "FOLDER_NOT_TRUSTED"
    assert str(run.workdir) in refused.json()["error"]["message"]
    assert list(run.home.iterdir()) == []  # no .claude.json, nothing else
    assert claude_dispatch.server.get("/api/v1/agents", claude_dispatch.token).json()["agents"] == []
    assert fake_model.received("/v1/messages") == []


def test_a_full_access_claude_launch_works_as_root(claude_dispatch: Dispatch, fake_model: FakeModel, run: Run) -> None:
    # As root, --dangerously-skip-permissions exits at once without IS_SANDBOX=1; the
    # bypass-mode warning is answered by the agent's own --settings file.
    agent_id = _first_prompt_reaches_the_model(claude_dispatch, fake_model, run, trust_folder=True, full_access=True)

    assert "bypass permissions on" in claude_dispatch.pane(agent_id)
    config = json.loads((run.home / ".claude.json").read_text())
    assert "bypassPermissionsModeAccepted" not in config  # nothing global
    settings_file = Path(claude_dispatch.inst.env["DISPATCH_DATA_DIR"]) / "agents" / agent_id / "claude-settings.json"
    assert json.loads(settings_file.read_text())["skipDangerousModePermissionPrompt"] is True
