"""The real Claude Code CLI (``@anthropic-ai/claude-code``, tests/clients) in a private
tmux server against the fake model: no Dispatch yet, only what a launch must prepare
(FINDINGS.md beside this file): it starts with no dialog in a never-seen folder, a pasted
prompt reaches the model, and its SessionStart / UserPromptSubmit hooks get the payloads
recorded in FINDINGS.md, 3b."""

from __future__ import annotations

from typing import Any

import pytest

from tests.agents.fake_model import FakeModel, say
from tests.agents.real_cli.conftest import API_KEY, Pane, Run, claude_home, cli_or_skip

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

READY = "bypass permissions on"


def start_claude(fake_model: FakeModel, run: Run, tmux_pane: Any) -> Pane:
    claude = cli_or_skip("claude")
    settings = claude_home(run)
    env = {
        "HOME": str(run.home),
        "ANTHROPIC_BASE_URL": fake_model.url,
        "ANTHROPIC_API_KEY": API_KEY,
        # Root may only bypass permissions in a declared sandbox; no self-update from npm
        # (FINDINGS.md, 3a).
        "IS_SANDBOX": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    pane: Pane = tmux_pane(run, [claude, "--settings", str(settings), "--dangerously-skip-permissions"], env)
    pane.wait_for(lambda screen: READY in screen)
    return pane


def test_claude_starts_without_dialogs_takes_a_pasted_prompt_and_fires_its_hooks(
    fake_model: FakeModel, run: Run, tmux_pane: Any
) -> None:
    pane = start_claude(fake_model, run, tmux_pane)

    start = run.wait_hook("SessionStart", pane)
    assert start["source"] == "startup"
    assert start["cwd"] == str(run.workdir)
    assert start["session_id"] and start["transcript_path"].endswith(f"{start['session_id']}.jsonl")

    fake_model.queue(say("pong from the fake model"))
    prompt = "ping marker-7f3a from the test"
    pane.paste(prompt)
    fake_model.wait_for(lambda: fake_model.prompts_containing(prompt), timeout=60)
    pane.wait_for(lambda screen: "pong from the fake model" in screen)

    submit = run.wait_hook("UserPromptSubmit", pane)
    assert submit["prompt"] == prompt
    assert submit["session_id"] == start["session_id"]
    assert submit["cwd"] == str(run.workdir)
    assert submit["permission_mode"] == "bypassPermissions"
    stop = run.wait_hook("Stop", pane)
    assert stop["last_assistant_message"] == "pong from the fake model"


def test_claude_takes_a_leading_space_bang_message_as_text_not_a_shell_command(
    fake_model: FakeModel, run: Run, tmux_pane: Any
) -> None:
    pane = start_claude(fake_model, run, tmux_pane)
    marker = run.workdir / "bang-ran"

    pane.paste(f" !touch {marker}")

    # Claude keeps the space (FINDINGS.md, 3c).
    fake_model.wait_for(lambda: fake_model.prompts_containing(f" !touch {marker}"), timeout=60)
    assert not marker.exists()
