"""Folder trust for Claude Code and codex agents (agents/trust.py, docs/agents.md#folder-trust):
a launch in a folder nobody trusted is refused with nothing written; a person
(a user's token or session) trusts it with ``trust_folder``; agents, the MCP launch tool
and linked instances launch only in folders already trusted; DISPATCH_TRUSTED_ROOTS.

The ``claude`` type here is a stand-in program (``sleep``) with a HOME of the test's own,
so what a launch writes is seen there; the real CLIs are in tests/agents/real_cli/.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.test import Client

from agents import cli, tokens, trust
from agents.models import Agent, TrustedFolder
from agents.tools import agent_tools
from agents.types import parse_agent_types
from core.errors import DispatchError, InvalidRequest
from tests.agents.conftest import Api, error_of
from tests.infra import base_env, manage
from tests.peers.conftest import FakePeer, make_peer  # noqa: F401 - a fixture used below
from tests.peers.signing import peer_post

pytestmark = [pytest.mark.django_db, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def folder(tmp_path: Path) -> str:
    path = tmp_path / "never-seen"
    path.mkdir()
    return str(path)


@pytest.fixture(autouse=True)
def types(settings: Any, home: Path, private_tmux: Any) -> None:
    """A claude type (a stand-in that stays up) and a shell, on the test's tmux server."""
    stand_in = [sys.executable, "-c", "import time; time.sleep(300)"]
    settings.AGENT_TYPES = parse_agent_types(
        {
            "claude": {
                "argv": stand_in,
                "env": {"HOME": str(home), "ANTHROPIC_API_KEY": "sk-ant-0123456789abcdefghijKLMN"},
            },
            "shell": {"argv": ["bash", "--norc", "-i"], "kind": "shell"},
        }
    )
    settings.TRUSTED_ROOTS = []


def launch(api: Api, folder: str, **body: Any) -> Any:
    return api.post("/api/v1/agents", {"type": "claude", "name": "c", "cwd": folder, "prompt": "hi", **body})


def nothing_written(home: Path) -> None:
    assert not Agent.objects.exists()
    assert not TrustedFolder.objects.exists()
    assert list(home.iterdir()) == []  # no .claude.json, no lock file


# --- the rules ------------------------------------------------------------------------------------


def test_a_folder_is_trusted_by_its_exact_path_or_under_a_root(
    owner: Any, outsider: Any, tmp_path: Path, settings: Any
) -> None:
    trust.folder_trust(owner=owner, path=str(tmp_path / "app") + "/")

    assert trust.folder_is_trusted(owner=owner, path=str(tmp_path / "app"))
    assert trust.folder_is_trusted(owner=owner, path=str(tmp_path / "x" / ".." / "app"))
    assert not trust.folder_is_trusted(owner=owner, path=str(tmp_path / "app" / "sub"))  # exact, not below
    assert not trust.folder_is_trusted(owner=outsider, path=str(tmp_path / "app"))  # a person's own decision

    root = tmp_path / "repos"
    (root / "one").mkdir(parents=True)
    (tmp_path / "repos2").mkdir()
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    settings.TRUSTED_ROOTS = [str(root)]
    assert trust.folder_is_trusted(owner=outsider, path=str(root))
    assert trust.folder_is_trusted(owner=outsider, path=str(root / "one"))
    assert not trust.folder_is_trusted(owner=outsider, path=str(tmp_path / "repos2"))  # a prefix is not inside
    assert not trust.folder_is_trusted(owner=outsider, path=str(root / "link"))  # a symlink out of the root
    with pytest.raises(InvalidRequest):
        trust.folder_is_trusted(owner=owner, path="relative/dir")


# --- REST -------------------------------------------------------------------------------------------


def test_a_launch_in_a_folder_nobody_trusted_is_refused_and_writes_nothing(api: Api, folder: str, home: Path) -> None:
    refused = launch(api, folder)

    assert refused.status_code == 400
    assert error_of(refused) == {
        "code": "FOLDER_NOT_TRUSTED",
        "message": f"Claude Code will be told to trust {folder}; launch again with trust_folder set to trust it "
        "(a person's decision)",
        "details": {"path": folder, "type": "claude"},
    }
    nothing_written(home)


def test_a_person_trusts_the_folder_with_trust_folder_and_later_launches_need_not(
    api: Api, owner: Any, folder: str, home: Path
) -> None:
    launched = launch(api, folder, trust_folder=True)

    assert launched.status_code == 201, launched.content
    assert launched.json()["status"] == "running"
    assert list(TrustedFolder.objects.values_list("owner", "path")) == [(owner.pk, folder)]
    config = json.loads((home / ".claude.json").read_text())
    assert config["projects"][folder] == {"hasTrustDialogAccepted": True}
    again = launch(api, folder)
    assert again.status_code == 201, again.content


def test_trust_folder_must_be_a_json_boolean(api: Api, folder: str, home: Path) -> None:
    refused = launch(api, folder, trust_folder="yes")

    assert refused.status_code == 400
    nothing_written(home)


def test_an_agent_token_cannot_trust_a_folder_and_launches_only_in_trusted_ones(
    owner: Any, folder: str, home: Path, tmp_path: Path
) -> None:
    launcher = Agent.objects.create(owner=owner, type="expert", name="planner", cwd=str(tmp_path), status="running")
    as_agent = Api(tokens.agent_token_mint(agent=launcher))

    asked = launch(as_agent, folder, trust_folder=True)
    untrusted = launch(as_agent, folder)

    assert asked.status_code == 403
    assert error_of(asked)["code"] == "PERMISSION_DENIED"
    assert "a person's decision" in error_of(asked)["message"]
    assert untrusted.status_code == 400
    error = error_of(untrusted)
    assert error["code"] == "FOLDER_NOT_TRUSTED" and "only a person can decide that" in error["message"]
    assert Agent.objects.count() == 1 and not TrustedFolder.objects.exists()
    assert list(home.iterdir()) == []

    TrustedFolder.objects.create(owner=owner, path=folder)
    launched = launch(as_agent, folder)
    assert launched.status_code == 201, launched.content
    assert launched.json()["launched_by"] == launcher.pk


def test_trust_folder_is_refused_with_a_location(api: Api, folder: str, home: Path) -> None:
    refused = launch(api, folder, trust_folder=True, location="elsewhere")

    assert refused.status_code == 400
    assert "a folder on a linked instance is trusted by a person there" in error_of(refused)["message"]
    nothing_written(home)


def test_a_trusted_root_needs_no_trust_folder(api: Api, folder: str, settings: Any) -> None:
    settings.TRUSTED_ROOTS = [os.path.dirname(folder)]

    launched = launch(api, folder)

    assert launched.status_code == 201, launched.content
    assert not TrustedFolder.objects.exists()


def test_a_shell_agent_needs_no_trust(api: Api, folder: str, home: Path) -> None:
    launched = api.post("/api/v1/agents", {"type": "shell", "name": "s", "cwd": folder})

    assert launched.status_code == 201, launched.content
    assert not TrustedFolder.objects.exists() and list(home.iterdir()) == []


def test_the_api_schema_documents_trust_folder(api: Api) -> None:
    schema = api.get("/api/schema/?format=json")

    if schema.status_code == 404:
        schema = api.get("/api/v1/schema?format=json")
    assert schema.status_code == 200, schema.status_code
    text = schema.content.decode()
    assert '"trust_folder"' in text and "FOLDER_NOT_TRUSTED" in text


def test_a_start_checks_the_trust_again(api: Api, owner: Any, folder: str) -> None:
    body = launch(api, folder, trust_folder=True).json()
    agent = Agent.objects.get(pk=body["id"])
    cli.agent_stop(agent=agent)
    cli.agent_ended(agent=agent, status="stopped", note="gone")
    TrustedFolder.objects.all().delete()

    started = api.post(f"/api/v1/agents/{agent.pk}/start")

    assert started.status_code == 200
    assert started.json()["status"] == "error"
    assert "will be told to trust" in started.json()["last_error"]


# --- the page ---------------------------------------------------------------------------------------


def test_the_launch_form_names_the_folder_to_trust_and_trusts_it_when_ticked(
    owner: Any, folder: str, home: Path, client: Client
) -> None:
    client.force_login(owner)
    form = {"type": "claude", "name": "c", "cwd": folder + "/", "prompt": ""}

    refused = client.post("/", form)

    assert refused.status_code == 400
    page = refused.content.decode()
    assert "FOLDER_NOT_TRUSTED" not in page and "will be told to trust" in page
    assert f'<code id="trust-folder-path">{folder}</code>' in page  # the folder, normalised
    assert 'name="trust_folder"' in page
    nothing_written(home)

    launched = client.post("/", {**form, "trust_folder": "on"})

    assert launched.status_code == 302
    assert TrustedFolder.objects.filter(owner=owner, path=folder).exists()


# --- agents through MCP, linked instances -------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # the tool launches on a thread of its own
def test_the_launch_tool_launches_only_in_trusted_folders(owner: Any, folder: str, home: Path) -> None:
    tools = {tool.name: tool for tool in async_to_sync(agent_tools)(user=owner, caller_agent=None)}
    arguments = {"name": "c", "prompt": "hi", "type": "claude", "cwd": folder}

    with pytest.raises(DispatchError) as refused:
        async_to_sync(tools["dispatch_launch_agent"])(arguments)
    assert refused.value.code == "FOLDER_NOT_TRUSTED"
    assert "only a person can decide that" in refused.value.message  # not "launch again with trust_folder"
    with pytest.raises(DispatchError) as extra:  # the tool has no way to trust a folder
        async_to_sync(tools["dispatch_launch_agent"])({**arguments, "trust_folder": True})
    assert extra.value.code == "INVALID_REQUEST"
    nothing_written(home)

    TrustedFolder.objects.create(owner=owner, path=folder)
    launched = async_to_sync(tools["dispatch_launch_agent"])(arguments)
    assert launched["status"] == "running"


def test_a_linked_instance_launches_only_in_trusted_folders(
    owner: Any,
    folder: str,
    home: Path,
    settings: Any,
    make_peer: Callable[..., FakePeer],  # noqa: F811 - the fixture imported above
) -> None:
    settings.REPO_ROOTS = [os.path.dirname(folder)]
    cloud = make_peer(owner, label="Cloud")
    body = {
        "name": "reviewer",
        "prompt": "review the diff",
        "type": "claude",
        "cwd": folder,
        "launched_by": {"instance_id": cloud.instance_id, "agent_id": None, "name": "dana"},
    }

    refused = peer_post(Client(), cloud, "/api/v1/peers/launch", body)

    assert refused.status_code == 400
    assert error_of(refused)["code"] == "FOLDER_NOT_TRUSTED"
    assert "only a person can decide that" in error_of(refused)["message"]
    nothing_written(home)

    TrustedFolder.objects.create(owner=owner, path=folder)
    launched = peer_post(Client(), cloud, "/api/v1/peers/launch", {**body, "name": "reviewer2"})
    assert launched.status_code == 201, launched.content


# --- DISPATCH_TRUSTED_ROOTS --------------------------------------------------------------------------


def test_dispatch_trusted_roots_is_a_list_of_absolute_folders(tmp_path: Path) -> None:
    env = base_env(DISPATCH_DATA_DIR=str(tmp_path), DISPATCH_TRUSTED_ROOTS=f" {tmp_path}/repos/ , ~/work,")

    shown = manage(env, "shell", "-c", "from django.conf import settings; print(settings.TRUSTED_ROOTS)")

    assert shown.stdout.strip().splitlines()[-1] == repr([f"{tmp_path}/repos", os.path.expanduser("~/work")])
    refused = manage({**env, "DISPATCH_TRUSTED_ROOTS": "/srv/ok,relative/dir"}, "check", check=False)
    assert refused.returncode != 0
    assert "DISPATCH_TRUSTED_ROOTS: 'relative/dir' is not an absolute folder" in refused.stderr
