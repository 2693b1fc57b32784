"""DISPATCH_AGENT_TYPES parsing and the launch entry point's type checks (docs/agents.md#agent-types)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from agents.launching import launchable_types
from agents.lifecycle import agent_launch_any
from agents.models import Agent, Run
from agents.types import DEFAULT_AGENT_TYPES, parse_agent_types
from core.errors import InvalidRequest


def test_the_defaults_are_claude_codex_opencode_and_an_interactive_shell() -> None:
    types = parse_agent_types("")
    assert list(types) == ["claude", "codex", "opencode", "shell"]
    assert types["shell"].kind == "shell" and types["shell"].argv == ("bash", "--norc", "-i")
    assert {types[name].kind for name in ("claude", "codex", "opencode")} == {"llm"}
    assert parse_agent_types(None) == types


def test_default_llm_types_wire_the_mcp_endpoint_without_putting_a_secret_in_argv() -> None:
    types = parse_agent_types("")
    for name in ("claude", "codex"):
        argv = types[name].command(full_access=False, mcp_url="http://h:1/mcp", agent_id="agt_0123456789ab")
        joined = " ".join(argv)
        assert "http://h:1/mcp" in joined and "{mcp_url}" not in joined
        assert "DISPATCH_MCP_TOKEN" in joined  # named, never its value
    claude_config = json.loads(types["claude"].command(full_access=False, mcp_url="u", agent_id="a")[2])
    assert claude_config["mcpServers"]["dispatch"]["url"] == "u"
    opencode_env = types["opencode"].environment(mcp_url="http://h:1/mcp", agent_id="a")
    assert json.loads(opencode_env["OPENCODE_CONFIG_CONTENT"])["mcp"]["dispatch"]["url"] == "http://h:1/mcp"


def test_full_access_uses_the_full_access_argv() -> None:
    claude = parse_agent_types("")["claude"]
    assert "--dangerously-skip-permissions" in claude.command(full_access=True, mcp_url="u", agent_id="a")
    assert "--dangerously-skip-permissions" not in claude.command(full_access=False, mcp_url="u", agent_id="a")


def test_a_given_value_replaces_the_defaults_and_fills_only_the_two_placeholders() -> None:
    types = parse_agent_types(json.dumps({"mine": {"argv": ["prog", "{agent_id}", "{x}", '{"a": 1}'], "kind": "llm"}}))
    assert list(types) == ["mine"]
    assert types["mine"].command(full_access=True, mcp_url="u", agent_id="agt_1") == [
        "prog",
        "agt_1",
        "{x}",
        '{"a": 1}',
    ]


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "non-empty JSON object"),
        ("{}", "non-empty JSON object"),
        ('{"expert": {"argv": ["x"]}}', "not 'expert'"),
        ('{"Bad Name": {"argv": ["x"]}}', "type name"),
        ('{"t": ["x"]}', "must be an object"),
        ('{"t": {"argv": []}}', "non-empty list"),
        ('{"t": {"argv": "bash -i"}}', "non-empty list"),
        ('{"t": {"argv": ["x", 3]}}', "list of strings"),
        ('{"t": {"argv": [""]}}', "first one a program"),
        ('{"t": {"argv": ["x"], "kind": "robot"}}', "kind must be"),
        ('{"t": {"argv": ["x"], "env": {"1BAD": "v"}}}', "env must be"),
        ('{"t": {"argv": ["x"], "env": {"OK": 1}}}', "env must be"),
        ('{"t": {"argv": ["x"], "shell": true}}', "unknown key 'shell'"),
        ('{"t": {"argv": ["x"], "full_access_argv": []}}', "full_access_argv"),
        ('{"t": {"argv": ["x"], "stop": []}}', "stop must be a list of 1-10 steps"),
        ('{"t": {"argv": ["x"], "stop": "C-c"}}', "stop must be a list"),
        ('{"t": {"argv": ["x"], "stop": ["C-c ; kill-server"]}}', "stop[0] must be a tmux key name"),
        ('{"t": {"argv": ["x"], "stop": ["C-c", "#{pane_pid}"]}}', "stop[1] must be a tmux key name"),
        ('{"t": {"argv": ["x"], "stop": [{"text": "exit\\u001b"}]}}', "without control characters"),
        ('{"t": {"argv": ["x"], "stop": [{"text": ""}]}}', "stop[0]"),
        ('{"t": {"argv": ["x"], "stop": [{"keys": "C-c"}]}}', "stop[0]"),
        ('{"t": {"argv": ["x"], "neutralise_prefix": ""}}', "neutralise_prefix must be"),
        ('{"t": {"argv": ["x"], "neutralise_prefix": " /"}}', "neutralise_prefix must be"),
        ('{"t": {"argv": ["x"], "neutralise_prefix": "\\u001b"}}', "neutralise_prefix must be"),
    ],
)
def test_a_bad_value_is_refused_with_what_is_wrong(raw: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_agent_types(raw)


def test_the_default_stop_sequences_ask_each_cli_to_exit_its_own_way() -> None:
    types = parse_agent_types("")
    assert types["claude"].stop == (("key", "C-c"), ("key", "C-c"))  # Claude Code ignores one C-c
    assert types["codex"].stop == (("key", "C-c"),)
    assert types["shell"].stop == (("key", "C-c"), ("text", "exit"), ("key", "Enter"))
    mine = parse_agent_types({"mine": {"argv": ["x"], "stop": [{"text": "/exit"}, "Enter"]}, "plain": {"argv": ["y"]}})
    assert mine["mine"].stop == (("text", "/exit"), ("key", "Enter"))
    assert mine["plain"].stop == (("key", "C-c"),)


@pytest.mark.parametrize(
    ("text", "pasted"),
    [
        ("/exit", " /exit"),
        ("!rm -rf ~", " !rm -rf ~"),
        ("  \t/compact\nthen this", "   \t/compact\nthen this"),
        ("\n/exit", " \n/exit"),
        ("please run /exit later", "please run /exit later"),
        ("hello\n/exit", "hello\n/exit"),  # only the start of the message is read as a command
        ("a!b", "a!b"),
    ],
)
def test_an_llm_type_neutralises_a_message_that_starts_like_a_command(text: str, pasted: str) -> None:
    types = parse_agent_types("")
    for name in ("codex", "opencode"):
        assert types[name].neutralise(text) == pasted
    # Claude Code trims leading whitespace before reading a command: its prefix is a quote mark.
    assert types["claude"].neutralise(text) == (pasted if pasted == text else "> " + pasted[1:])
    assert types["shell"].neutralise(text) == text  # a shell agent's message is the command


def test_a_type_may_set_its_own_neutralise_prefix() -> None:
    types = parse_agent_types({"mine": {"argv": ["x"], "neutralise_prefix": "Message: "}})
    assert types["mine"].neutralise("/exit") == "Message: /exit"
    assert types["mine"].neutralise("hi") == "hi"


def test_a_bad_setting_stops_the_process_at_start(tmp_path: Path) -> None:
    env = {**os.environ, "DISPATCH_AGENT_TYPES": '{"t": {"argv": []}}', "DISPATCH_DATA_DIR": str(tmp_path)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "manage.py", "check"], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.returncode != 0
    assert "Configuration error" in done.stderr and "argv must be a non-empty list" in done.stderr


def _program(directory: Path, name: str) -> str:
    path = directory / name
    path.write_text("#!/bin/sh\nexec sleep 60\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_type_whose_program_is_missing_is_listed_unavailable_and_refused(
    owner: Any, tmp_path: Path, workdir: str
) -> None:
    types = parse_agent_types({"ghost": {"argv": ["dispatch-no-such-program-xyz"]}, **DEFAULT_AGENT_TYPES})
    with override_settings(AGENT_TYPES=types):
        assert launchable_types()["ghost"] is False
        assert launchable_types()["expert"] is True
        with pytest.raises(InvalidRequest, match="unavailable here") as refused:
            agent_launch_any(owner=owner, type="ghost", name="g", prompt="", cwd=workdir)
        assert "ghost" not in refused.value.details["available_types"]
    assert not Agent.objects.filter(type="ghost").exists()


def test_an_absolute_program_path_counts_as_available(tmp_path: Path) -> None:
    types = parse_agent_types({"mine": {"argv": [_program(tmp_path, "fake-cli")]}})
    assert types["mine"].available()


def test_an_unknown_type_is_refused_with_the_known_ones(owner: Any, workdir: str) -> None:
    with pytest.raises(InvalidRequest, match="unknown agent type 'robot'"):
        agent_launch_any(owner=owner, type="robot", name="r", prompt="", cwd=workdir)


def test_an_expert_launch_queues_the_prompt_and_records_the_launcher_as_parent_when_child(
    owner: Any, make_agent: Any, workdir: str
) -> None:
    launcher = make_agent(owner, name="boss")
    child = agent_launch_any(owner=owner, type="expert", name="kid", prompt="do it", launched_by=launcher, child=True)
    assert child.parent_id == launcher.pk and child.launched_by_id == launcher.pk
    assert child.cwd == launcher.cwd  # the launcher's cwd by default
    assert list(Run.objects.filter(agent=child).values_list("input__instruction", flat=True)) == ["do it"]
    sibling = agent_launch_any(owner=owner, type="expert", name="sib", launched_by=launcher, child=False)
    assert sibling.parent_id is None and sibling.launched_by_id == launcher.pk
    assert not Run.objects.filter(agent=sibling).exists()


def test_a_user_launch_without_cwd_uses_the_default_cwd(owner: Any, tmp_path: Path) -> None:
    with override_settings(DEFAULT_CWD=str(tmp_path)):
        agent = agent_launch_any(owner=owner, type="expert", name="home")
    assert agent.cwd == str(tmp_path)
