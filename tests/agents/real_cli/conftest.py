"""Fixtures to run the REAL coding-agent CLIs (Claude Code, codex; pinned in
tests/clients/package.json) against ``tests.agents.fake_model`` in a private tmux server,
with a fresh HOME and a never-seen working folder, configured as FINDINGS.md (beside this
file) found they need to start with no dialog.

``make test`` installs the CLIs with ``npm ci`` (once, a stamp file). Without them the
tests are skipped locally with the install command, and fail under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.agents.fake_model import FakeModel
from tests.backends import unavailable
from tests.infra import REPO

CLIENTS = REPO / "tests" / "clients"
BIN = CLIENTS / "node_modules" / ".bin"
INSTALL = "apt-get install nodejs npm tmux && make tests/clients/node_modules/.installed"
# A fake key: the CLI sends it to the fake model only. Claude approves a key by its last 20
# characters (FINDINGS.md, 3a).
API_KEY = "sk-ant-api03-dispatch-tests-fake-key-0123456789abcdefghij"
HOOK_SCRIPT = """#!/bin/sh
# Append the event's stdin JSON as one line to $1 (the hooks log).
{ cat; printf '\\n'; } >> "$1"
"""


def cli_or_skip(name: str) -> str:
    """The path of ``name`` (``claude``/``codex``) in tests/clients; else skip (fail on CI)."""
    if shutil.which("tmux") is None:
        unavailable(f"tmux is not installed: {INSTALL}")
    path = BIN / name
    if not path.exists():
        unavailable(f"the {name} CLI is not installed in tests/clients: {INSTALL}")
    return str(path)


@dataclass
class Pane:
    """One tmux session on a private server (``tmux -L <socket>``) running a CLI."""

    socket: str
    target: str = "cli"

    def tmux(self, *args: str, input: str | None = None) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args], input=input, capture_output=True, text=True, check=True, timeout=10
        )
        return done.stdout

    def capture(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.target)

    def paste(self, text: str) -> None:
        """Paste ``text`` bracketed (as Dispatch does) and press Enter."""
        buffer = f"b{uuid.uuid4().hex[:8]}"
        self.tmux("load-buffer", "-b", buffer, "-", input=text)
        self.tmux("paste-buffer", "-p", "-d", "-b", buffer, "-t", self.target)
        self.tmux("send-keys", "-t", self.target, "Enter")

    def wait_for(self, check: Callable[[str], bool], timeout: float = 60) -> str:
        """Poll the pane until ``check(screen)``; the screen, or a failure showing it."""
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.capture()
            if check(screen):
                return screen
            time.sleep(0.2)
        pytest.fail(f"the pane never showed what the test waited for; last screen:\n{screen}")


@dataclass
class Run:
    """A prepared run: the fresh HOME, the never-seen working folder, the hooks log."""

    home: Path
    workdir: Path
    hooks_log: Path
    hook: Path

    def hook_events(self) -> list[dict[str, Any]]:
        if not self.hooks_log.exists():
            return []
        return [json.loads(line) for line in self.hooks_log.read_text().splitlines() if line.strip()]

    def wait_hook(self, event: str, pane: Pane, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for payload in self.hook_events():
                if payload.get("hook_event_name") == event:
                    return payload
            time.sleep(0.2)
        pytest.fail(f"no {event} hook in {self.hook_events()}; screen:\n{pane.capture()}")


@pytest.fixture
def fake_model() -> Iterator[FakeModel]:
    with FakeModel() as model:
        yield model


@pytest.fixture
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    # Not under /tmp/pytest-of-*/…/ names reused across runs: a uuid makes the folder one
    # the CLIs have never seen (they remember folders by absolute path).
    base = tmp_path_factory.mktemp("real-cli")
    workdir = base / f"work-{uuid.uuid4().hex[:10]}"
    home = base / "home"
    workdir.mkdir()
    home.mkdir()
    hook = base / "hook.sh"
    hook.write_text(HOOK_SCRIPT)
    hook.chmod(0o755)
    return Run(home=home, workdir=workdir, hooks_log=base / "hooks.jsonl", hook=hook)


@pytest.fixture
def tmux_pane() -> Iterator[Callable[[Run, list[str], dict[str, str]], Pane]]:
    """``start(run, argv, env)``: the CLI in a new private tmux server, cwd the run's
    folder, with ONLY ``env`` (plus PATH/TERM) in its environment; the server is killed
    (and its socket removed) afterwards."""
    sockets: list[str] = []

    def start(run: Run, argv: list[str], env: dict[str, str]) -> Pane:
        socket = f"dispatch-realcli-{uuid.uuid4().hex[:12]}"
        sockets.append(socket)
        environment = ["env", "-i", f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}", "TERM=xterm-256color"]
        environment += [f"{key}={value}" for key, value in env.items()]
        pane = Pane(socket)
        pane.tmux(
            "-f", "/dev/null", "new-session", "-d", "-s", pane.target, "-x", "200", "-y", "50",
            "-c", str(run.workdir), *environment, *argv,
        )  # fmt: skip
        return pane

    yield start
    for socket in sockets:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)
        (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / socket).unlink(missing_ok=True)


def hook_command(run: Run) -> str:
    return f"{run.hook} {run.hooks_log}"


def claude_home(run: Run, *, api_key: str = API_KEY) -> Path:
    """Write ``~/.claude.json`` (skips onboarding, the API-key and folder-trust dialogs and
    the bypass-permissions warning) and a settings file with a command hook for each
    event; return the settings file's path. FINDINGS.md, 3a and 3b."""
    (run.home / ".claude.json").write_text(
        json.dumps(
            {
                "hasCompletedOnboarding": True,
                "customApiKeyResponses": {"approved": [api_key[-20:]], "rejected": []},
                "projects": {str(run.workdir): {"hasTrustDialogAccepted": True}},
                "bypassPermissionsModeAccepted": True,
            }
        )
    )
    command = [{"type": "command", "command": hook_command(run)}]
    events = ["SessionStart", "UserPromptSubmit", "Notification", "Stop", "SessionEnd"]
    tool_events = ["PreToolUse", "PostToolUse", "PermissionRequest"]
    hooks: dict[str, Any] = {event: [{"hooks": command}] for event in events}
    hooks.update({event: [{"matcher": "*", "hooks": command}] for event in tool_events})
    settings = run.home / "claude-settings.json"
    settings.write_text(json.dumps({"hooks": hooks}))
    return settings


def codex_home(run: Run, model: FakeModel) -> Path:
    """Write ``$CODEX_HOME/config.toml`` (the fake model as a custom provider, the folder
    trusted) and ``hooks.json``; return CODEX_HOME. FINDINGS.md, 3a and 3b."""
    codex = run.home / ".codex"
    codex.mkdir()
    (codex / "config.toml").write_text(
        f'model = "gpt-fake"\n'
        f'model_provider = "fake"\n\n'
        f"[model_providers.fake]\n"
        f'name = "fake"\n'
        f'base_url = "{model.url}/v1"\n'
        f'wire_api = "responses"\n'
        f'env_key = "FAKE_MODEL_API_KEY"\n\n'
        f"[projects.{json.dumps(str(run.workdir))}]\n"
        f'trust_level = "trusted"\n'
    )
    command = [{"type": "command", "command": hook_command(run)}]
    events = ["SessionStart", "UserPromptSubmit", "PreToolUse", "PermissionRequest", "PostToolUse", "Stop"]
    (codex / "hooks.json").write_text(json.dumps({"hooks": {event: [{"hooks": command}] for event in events}}))
    return codex
