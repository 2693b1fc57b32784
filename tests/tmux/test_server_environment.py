"""A tmux server started by Dispatch gets a clean global environment, without Dispatch's
own settings (database URL, secret key…) in it (docs/agents.md#the-private-tmux-server)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

LEAKY = {
    "DATABASE_URL": "postgres://dispatch:secret@db/dispatch",
    "REDIS_URL": "redis://:secret@redis:6379/0",
    "SECRET_KEY_FILE": "/run/secrets/dispatch-key",
    "SECRET_KEY": "not-for-agents",
    "DISPATCH_ENCRYPTION_KEYS": "k1",
}


def test_it_starts_the_tmux_server_without_dispatch_settings_in_its_global_environment(
    private_tmux: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in LEAKY.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DISPATCH_TEST_MARKER_KEPT_OUT", "1")
    monkeypatch.setenv("AGENT_CLI_OWN_SETTING", "kept")

    private_tmux.start(
        session_name="dispatch_envcheck", instance_id="inst_test", argv=["sleep", "30"], cwd=str(tmp_path), env={}
    )

    shown = subprocess.run(
        ["tmux", "-L", private_tmux.socket_name, "show-environment", "-g"], capture_output=True, text=True, check=True
    ).stdout
    names = {line.split("=", 1)[0] for line in shown.splitlines()}
    leaked = sorted(name for name in names if name in LEAKY or name.startswith("DISPATCH_"))
    assert leaked == []
    # The user's own environment still reaches the server (the CLIs need their settings).
    assert "AGENT_CLI_OWN_SETTING" in names
    assert "PATH" in names


def test_an_agent_gets_the_launching_processs_environment_not_the_older_tmux_servers(
    private_tmux: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tmux server keeps the environment it was started with: a key exported before the
    # next `serve` must still reach the next agent while an older agent keeps the server up
    # (and HOME must be the one Dispatch prepared the CLI's config in).
    monkeypatch.setenv("AGENT_CLI_API_KEY", "old")
    private_tmux.start(
        session_name="dispatch_first", instance_id="inst_test", argv=["sleep", "30"], cwd=str(tmp_path), env={}
    )
    monkeypatch.setenv("AGENT_CLI_API_KEY", "new")
    monkeypatch.setenv("AGENT_CLI_BASE_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("HOME", str(tmp_path))
    private_tmux.start(
        session_name="dispatch_second",
        instance_id="inst_test",
        argv=["sh", "-c", 'echo "key=$AGENT_CLI_API_KEY url=$AGENT_CLI_BASE_URL home=$HOME"; sleep 30'],
        cwd=str(tmp_path),
        env={},
    )

    def shown() -> str:
        return private_tmux.capture("dispatch_second", lines=20)

    import time

    for _ in range(100):
        if "key=" in shown():
            break
        time.sleep(0.05)
    assert f"key=new url=http://127.0.0.1:9/ home={tmp_path}" in shown()
