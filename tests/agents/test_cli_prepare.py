"""What Dispatch writes before a Claude Code or codex session (agents/cli_prepare.py,
docs/agents.md#what-dispatch-writes): the merge keeps the user's keys, a corrupt file is
refused and left as it was, concurrent launches all land, codex's TOML keeps its comments,
a codex with no way to reach a model is refused, and every launch gets its hooks.

The launch tests run a stand-in program (a few lines of Python that record their argv and
environment) as a ``claude``/``codex`` type in a private tmux server; the real CLIs are in
tests/agents/real_cli/.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomlkit
from django.utils import timezone

from agents import cli, cli_prepare
from agents.cli_hooks import hook_command
from agents.models import Agent, TrustedFolder
from agents.types import parse_agent_types
from core.errors import InvalidRequest
from tests.infra import REPO

KEY = "sk-ant-api03-unit-test-key-0123456789abcdefghij"

# Records its argv and environment as JSON in the file named by its first argument, then
# stays up like a CLI waiting for input.
STAND_IN = """import json, os, sys, time
with open(sys.argv[1], "w") as out:
    json.dump({"argv": sys.argv[2:], "env": dict(os.environ), "cwd": os.getcwd()}, out)
time.sleep(300)
"""


# --- Claude Code: ~/.claude.json ----------------------------------------------------------------


def test_the_merge_keeps_every_key_of_the_user_and_adds_only_its_own(tmp_path: Path) -> None:
    config = tmp_path / ".claude.json"
    mine: dict[str, Any] = {
        "oauthAccount": {"emailAddress": "me@example.org"},
        "theme": "dark",
        "numStartups": 41,
        "projects": {"/home/me/other": {"hasTrustDialogAccepted": True, "allowedTools": ["Bash"]}},
        "customApiKeyResponses": {"approved": ["my-own-approved-key1"], "rejected": ["a-rejected-key-00000"]},
    }
    config.write_text(json.dumps(mine))
    config.chmod(0o640)

    assert cli_prepare.claude_config_merge(path=config, cwd="/srv/work", api_key=KEY) is True

    merged = json.loads(config.read_text())
    assert merged["oauthAccount"] == mine["oauthAccount"]
    assert (merged["theme"], merged["numStartups"]) == ("dark", 41)
    assert merged["projects"]["/home/me/other"] == mine["projects"]["/home/me/other"]
    assert merged["projects"]["/srv/work"] == {"hasTrustDialogAccepted": True}
    assert merged["customApiKeyResponses"] == {
        "approved": ["my-own-approved-key1", KEY[-20:]],
        "rejected": ["a-rejected-key-00000"],
    }
    assert merged["hasCompletedOnboarding"] is True and merged["hasSeenAutoDefaultNotice"] is True
    assert stat.S_IMODE(config.stat().st_mode) == 0o640  # the file's mode kept
    # Said once: a second launch changes nothing and does not rewrite the file.
    before = config.stat().st_mtime_ns, config.read_bytes()
    assert cli_prepare.claude_config_merge(path=config, cwd="/srv/work", api_key=KEY) is False
    assert (config.stat().st_mtime_ns, config.read_bytes()) == before


def test_a_new_claude_json_is_private_and_holds_only_what_is_needed(tmp_path: Path) -> None:
    config = tmp_path / "home" / ".claude.json"

    cli_prepare.claude_config_merge(path=config, cwd="/srv/work", api_key=None)

    assert json.loads(config.read_text()) == {
        "hasCompletedOnboarding": True,
        "hasSeenAutoDefaultNotice": True,
        "projects": {"/srv/work": {"hasTrustDialogAccepted": True}},
    }
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert [p.name for p in config.parent.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize(
    "content",
    [
        b'{"oauthAccount": {"emailAddress": "me@example.org"',  # cut short
        b"[1, 2, 3]",
        b'{"projects": ["/srv/work"]}',
        b'{"projects": {"/srv/work": true}}',
        b'{"customApiKeyResponses": {"approved": "one"}}',
        b"\xff\xfe not utf-8",
    ],
)
def test_a_corrupt_claude_json_refuses_the_launch_naming_it_and_is_left_untouched(
    tmp_path: Path, content: bytes
) -> None:
    config = tmp_path / ".claude.json"
    config.write_bytes(content)
    before = config.stat().st_mtime_ns

    with pytest.raises(InvalidRequest) as refused:
        cli_prepare.claude_config_merge(path=config, cwd="/srv/work", api_key=KEY)

    assert str(config) in refused.value.message
    assert refused.value.details == {"file": str(config)}
    assert config.read_bytes() == content and config.stat().st_mtime_ns == before


def _merge_many(path: str, worker: int, rounds: int) -> None:
    for index in range(rounds):
        cli_prepare.claude_config_merge(path=Path(path), cwd=f"/srv/w{worker}-{index}", api_key=None)


def test_concurrent_launches_all_land_in_claude_json(tmp_path: Path) -> None:
    config = tmp_path / ".claude.json"
    config.write_text(json.dumps({"oauthAccount": {"emailAddress": "me@example.org"}}))
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_merge_many, args=(str(config), worker, 25)) for worker in range(6)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(60)
        assert process.exitcode == 0

    merged = json.loads(config.read_text())
    assert len(merged["projects"]) == 6 * 25  # no read-modify-write lost another's key
    assert merged["oauthAccount"] == {"emailAddress": "me@example.org"}


def test_claude_config_dir_moves_the_file_there() -> None:
    assert cli_prepare.claude_config_file({"HOME": "/home/me"}) == Path("/home/me/.claude.json")
    assert cli_prepare.claude_config_file({"HOME": "/home/me", "CLAUDE_CONFIG_DIR": "/cfg/claude"}) == Path(
        "/cfg/claude/.claude.json"
    )


def test_the_claude_settings_wire_every_hook_and_skip_the_bypass_prompt_only_for_full_access() -> None:
    body = cli_prepare.claude_settings(full_access=False)

    assert set(body) == {"hooks"}
    events = set(body["hooks"])
    assert events == {
        "SessionStart",
        "UserPromptSubmit",
        "PreToolUse",
        "PostToolUse",
        "PermissionRequest",
        "Notification",
        "Stop",
        "SessionEnd",
    }
    for event, groups in body["hooks"].items():
        # The PermissionRequest hook waits for an approval: the CLI lets it run past its timeout.
        waits = {"timeout": 300 + cli_prepare.APPROVAL_HOOK_MARGIN} if event == "PermissionRequest" else {}
        assert groups[0]["hooks"] == [{"type": "command", "command": hook_command(event), **waits}]
        if event in ("PreToolUse", "PostToolUse", "PermissionRequest"):
            assert groups[0]["matcher"] == "*"
    assert cli_prepare.claude_settings(full_access=True)["skipDangerousModePermissionPrompt"] is True


# --- codex: config.toml ---------------------------------------------------------------------------

USER_TOML = """# my codex setup
model = "o9"  # the one I like
model_provider = "mine"

[model_providers.mine]
name = "mine"
base_url = "https://models.example.org/v1"

[projects."/home/me/repo"]
trust_level = "trusted"
"""


def test_codex_trust_is_added_and_the_users_toml_kept_as_it_was(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(USER_TOML)

    assert cli_prepare.codex_config_trust(path=config, cwd="/srv/work dir") is True

    text = config.read_text()
    assert text.startswith(USER_TOML)  # comments, order, spacing: all the user's
    assert tomlkit.parse(text)["projects"]["/srv/work dir"]["trust_level"] == "trusted"
    assert cli_prepare.codex_config_trust(path=config, cwd="/srv/work dir") is False


def test_a_corrupt_codex_config_is_refused_naming_it_and_left_untouched(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('model = "o9\n[projects\n')

    with pytest.raises(InvalidRequest) as refused:
        cli_prepare.codex_config_trust(path=config, cwd="/srv/work")

    assert str(config) in refused.value.message
    assert config.read_text() == 'model = "o9\n[projects\n'


def test_codex_without_a_way_to_reach_a_model_is_refused_saying_what_would_do(tmp_path: Path) -> None:
    home = tmp_path / ".codex"
    home.mkdir()
    env = {"HOME": str(tmp_path), "CODEX_HOME": str(home)}

    with pytest.raises(InvalidRequest) as refused:
        cli_prepare.codex_login_check(env=env)

    message = refused.value.message
    assert "codex login" in message and "OPENAI_API_KEY" in message and "model_provider" in message
    assert str(home / "auth.json") in message and os.uname().nodename.split(".")[0] in message
    # Each way out is accepted.
    cli_prepare.codex_login_check(env={**env, "OPENAI_API_KEY": "sk-x"})
    cli_prepare.codex_login_check(env=env, argv=["codex", "-c", 'model_provider="fake"'])
    (home / "config.toml").write_text(USER_TOML)
    cli_prepare.codex_login_check(env=env)
    (home / "config.toml").unlink()
    (home / "auth.json").write_text("{}")
    cli_prepare.codex_login_check(env=env)


def test_codex_gets_no_daemon_hook_trust_and_its_hooks_on_the_command_line_once(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "OPENAI_API_KEY": "sk-x"}
    argv = ("codex", "--no-daemon")

    prepared = cli_prepare.prepare_codex(env=env, cwd="/srv/work", argv=argv)

    assert prepared.argv.count("--no-daemon") == 0  # the type already has it
    assert "--dangerously-bypass-hook-trust" in prepared.argv
    overrides = [prepared.argv[i + 1] for i, part in enumerate(prepared.argv) if part == "-c"]
    for event in ("SessionStart", "UserPromptSubmit", "PreToolUse", "PermissionRequest", "PostToolUse", "Stop"):
        (override,) = [o for o in overrides if o.startswith(f"hooks.{event}=")]
        value = tomlkit.parse(f"x = {override.split('=', 1)[1]}")["x"]
        waits = {"timeout": 300 + cli_prepare.APPROVAL_HOOK_MARGIN} if event == "PermissionRequest" else {}
        assert value == [{"hooks": [{"type": "command", "command": hook_command(event), **waits}]}]
    config = tomlkit.parse((tmp_path / ".codex" / "config.toml").read_text())
    assert config["projects"]["/srv/work"]["trust_level"] == "trusted"


# --- agent types ---------------------------------------------------------------------------------


def test_the_hooks_family_defaults_by_type_name_and_can_be_set() -> None:
    types = parse_agent_types("")
    assert (types["claude"].hooks, types["codex"].hooks, types["opencode"].hooks, types["shell"].hooks) == (
        "claude",
        "codex",
        None,
        None,
    )
    custom = parse_agent_types(
        {"work-claude": {"argv": ["claude"], "hooks": "claude"}, "claude": {"argv": ["x"], "hooks": None}}
    )
    assert (custom["work-claude"].hooks, custom["claude"].hooks) == ("claude", None)
    with pytest.raises(ValueError, match="hooks must be 'claude', 'codex' or null"):
        parse_agent_types({"x": {"argv": ["x"], "hooks": "gemini"}})


# --- a launch, end to end with a stand-in ---------------------------------------------------------


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return script


def _recorded(path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            try:
                return dict(json.loads(path.read_text()))
            except ValueError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"the stand-in never wrote {path}")


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@needs_tmux
@pytest.mark.django_db
def test_a_claude_launch_prepares_its_home_and_gets_its_settings_file_and_environment(
    owner: Any, private_tmux: Any, stand_in: Path, tmp_path: Path, settings: Any
) -> None:
    home, work, out = tmp_path / "home", tmp_path / "work", tmp_path / "seen.json"
    home.mkdir()
    work.mkdir()
    settings.AGENT_TYPES = parse_agent_types(
        {
            "claude": {
                "argv": [sys.executable, str(stand_in), str(out)],
                "full_access_argv": [sys.executable, str(stand_in), str(out), "--dangerously-skip-permissions"],
                "env": {"HOME": str(home), "ANTHROPIC_API_KEY": KEY},
            }
        }
    )
    TrustedFolder.objects.create(owner=owner, path=str(work))

    agent = cli.agent_launch(owner=owner, type="claude", name="c", prompt="", cwd=str(work), full_access=True)

    assert agent.status == "running", agent.last_error
    seen = _recorded(out)
    config = json.loads((home / ".claude.json").read_text())
    assert config["projects"][str(work)] == {"hasTrustDialogAccepted": True}
    assert config["customApiKeyResponses"]["approved"] == [KEY[-20:]]
    assert seen["argv"][-2] == "--settings"
    settings_path = Path(seen["argv"][-1])
    assert settings_path == Path(settings.DATA_DIR) / "agents" / agent.pk / "claude-settings.json"
    assert stat.S_IMODE(settings_path.stat().st_mode) == 0o600
    body = json.loads(settings_path.read_text())
    assert body["skipDangerousModePermissionPrompt"] is True
    assert body["hooks"]["SessionStart"][0]["hooks"][0]["command"] == hook_command("SessionStart")
    assert seen["env"]["DISABLE_AUTOUPDATER"] == "1"
    assert seen["env"].get("IS_SANDBOX") == ("1" if os.geteuid() == 0 else None)
    assert seen["env"]["DISPATCH_AGENT_ID"] == agent.pk and seen["env"]["DISPATCH_MCP_TOKEN"]

    cli.agent_archive(agent=agent)
    assert not settings_path.exists()  # removed with the agent


@needs_tmux
@pytest.mark.django_db
def test_a_corrupt_claude_json_refuses_the_launch_before_the_agent_exists(
    owner: Any, private_tmux: Any, stand_in: Path, tmp_path: Path, settings: Any
) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".claude.json").write_text("{oops")
    settings.AGENT_TYPES = parse_agent_types(
        {"claude": {"argv": [sys.executable, str(stand_in), str(tmp_path / "o")], "env": {"HOME": str(home)}}}
    )

    with pytest.raises(InvalidRequest) as refused:
        cli.agent_launch(owner=owner, type="claude", name="c", prompt="hi", cwd=str(work), trust_folder=True)

    assert str(home / ".claude.json") in refused.value.message
    assert (home / ".claude.json").read_text() == "{oops"
    assert not Agent.objects.exists() and not TrustedFolder.objects.exists()


@needs_tmux
@pytest.mark.django_db
def test_a_start_prepares_again_and_a_codex_that_lost_its_login_ends_in_error(
    owner: Any, private_tmux: Any, stand_in: Path, tmp_path: Path, settings: Any
) -> None:
    home, work, out = tmp_path / "home", tmp_path / "work", tmp_path / "seen.json"
    home.mkdir()
    work.mkdir()
    codex = {"argv": [sys.executable, str(stand_in), str(out)], "env": {"HOME": str(home), "OPENAI_API_KEY": "sk-x"}}
    settings.AGENT_TYPES = parse_agent_types({"codex": codex})
    agent = cli.agent_launch(owner=owner, type="codex", name="x", prompt="", cwd=str(work), trust_folder=True)
    assert agent.status == "running", agent.last_error
    argv = _recorded(out)["argv"]
    assert "--no-daemon" in argv and "--dangerously-bypass-hook-trust" in argv
    private_tmux.kill(cli.session_name(agent))
    cli.agent_ended(agent=agent, status=Agent.Status.STOPPED, note="gone")

    settings.AGENT_TYPES = parse_agent_types({"codex": {**codex, "env": {"HOME": str(home), "OPENAI_API_KEY": ""}}})
    agent = cli.agent_start(agent=agent)

    assert agent.status == "error"
    assert "codex cannot reach a model" in agent.last_error


def test_docs_say_what_dispatch_writes_and_how_to_undo_it() -> None:
    docs = (REPO / "docs" / "agents.md").read_text()
    section = docs.split("## What Dispatch writes", 1)[1].split("\n## ", 1)[0]
    for written in (
        ".claude.json",
        "hasCompletedOnboarding",
        "hasSeenAutoDefaultNotice",
        "hasTrustDialogAccepted",
        "customApiKeyResponses",
        "claude-settings.json",
        "skipDangerousModePermissionPrompt",
        "DISABLE_AUTOUPDATER",
        "IS_SANDBOX",
        "config.toml",
        "trust_level",
        "--no-daemon",
        "--dangerously-bypass-hook-trust",
        ".dispatch-lock",
    ):
        assert written in section, written
    assert "undo" in section.lower()


@needs_tmux
@pytest.mark.django_db
def test_each_start_forgets_the_previous_sessions_ready_at(
    owner: Any, private_tmux: Any, stand_in: Path, tmp_path: Path, settings: Any
) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    settings.AGENT_TYPES = parse_agent_types(
        {"claude": {"argv": [sys.executable, str(stand_in), str(tmp_path / "o")], "env": {"HOME": str(home)}}}
    )
    agent = cli.agent_launch(owner=owner, type="claude", name="c", prompt="", cwd=str(work), trust_folder=True)
    Agent.objects.filter(pk=agent.pk).update(ready_at=timezone.now())  # its SessionStart came
    private_tmux.kill(cli.session_name(agent))
    cli.agent_ended(agent=agent, status=Agent.Status.STOPPED, note="gone")

    agent = cli.agent_start(agent=agent)

    assert agent.status == "running", agent.last_error
    assert agent.ready_at is None  # the new session is not ready until its own SessionStart


def test_the_permission_request_hook_outlives_the_types_own_approval_timeout(tmp_path: Path) -> None:
    spec = parse_agent_types({"slow": {"argv": ["claude"], "hooks": "claude", "approval_timeout": 900}})["slow"]
    hook = cli_prepare.claude_settings(full_access=False, spec=spec)["hooks"]["PermissionRequest"][0]["hooks"][0]
    assert hook["timeout"] == 900 + cli_prepare.APPROVAL_HOOK_MARGIN
    (override,) = [o for o in cli_prepare.codex_hook_overrides(spec) if o.startswith("hooks.PermissionRequest=")]
    assert tomlkit.parse(f"x = {override.split('=', 1)[1]}")["x"][0]["hooks"][0]["timeout"] == 960
