"""The real codex CLI (``@openai/codex``, tests/clients) in a private tmux server against
the fake model (a custom Responses provider): no Dispatch yet, only what a launch must
prepare (FINDINGS.md beside this file): it starts with no dialog in a never-seen folder,
a pasted prompt reaches the model, and its SessionStart / UserPromptSubmit hooks get the
payloads recorded in FINDINGS.md, 3b."""

from __future__ import annotations

from typing import Any

import pytest

from tests.agents.fake_model import FakeModel, say
from tests.agents.real_cli.conftest import Pane, Run, cli_or_skip, codex_home

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

READY = "? for shortcuts"


def start_codex(fake_model: FakeModel, run: Run, tmux_pane: Any) -> Pane:
    codex = cli_or_skip("codex")
    home = codex_home(run, fake_model)
    env = {"HOME": str(run.home), "CODEX_HOME": str(home), "FAKE_MODEL_API_KEY": "fake-key"}
    # --no-daemon: no background app-server that outlives the pane; the hooks are ours,
    # so they run without the trust review (FINDINGS.md, 3a and 3b).
    argv = [codex, "--no-daemon", "--dangerously-bypass-hook-trust"]
    pane: Pane = tmux_pane(run, argv, env)
    pane.wait_for(lambda screen: READY in screen)
    return pane


def test_codex_starts_without_dialogs_takes_a_pasted_prompt_and_fires_its_hooks(
    fake_model: FakeModel, run: Run, tmux_pane: Any
) -> None:
    pane = start_codex(fake_model, run, tmux_pane)

    fake_model.queue(say("pong from the fake model"))
    prompt = "ping marker-c0d3 from the test"
    pane.paste(prompt)
    request = fake_model.wait_for(lambda: fake_model.prompts_containing(prompt), timeout=60)[0]
    assert request.path == "/v1/responses"
    assert request.headers["authorization"] == "Bearer fake-key"
    pane.wait_for(lambda screen: "pong from the fake model" in screen)

    # codex runs SessionStart lazily, with the first prompt (FINDINGS.md, 3b).
    start = run.wait_hook("SessionStart", pane)
    assert start["source"] == "startup"
    assert start["cwd"] == str(run.workdir)
    assert start["model"] == "gpt-fake"
    submit = run.wait_hook("UserPromptSubmit", pane)
    assert submit["prompt"] == prompt
    assert submit["session_id"] == start["session_id"]
    assert submit["turn_id"]
    assert submit["cwd"] == str(run.workdir)
    stop = run.wait_hook("Stop", pane)
    assert stop["last_assistant_message"] == "pong from the fake model"


def test_codex_takes_a_leading_space_bang_message_as_text_not_a_shell_command(
    fake_model: FakeModel, run: Run, tmux_pane: Any
) -> None:
    pane = start_codex(fake_model, run, tmux_pane)
    marker = run.workdir / "bang-ran"

    pane.paste(f" !touch {marker}")

    # codex trims the space: the model gets the text from the bang on.
    fake_model.wait_for(lambda: fake_model.prompts_containing(f"!touch {marker}"), timeout=60)
    assert not marker.exists()
