"""Where a peer may launch (docs/peers.md#launch): a ``cwd`` whose realpath lies inside
one of ``DISPATCH_REPO_ROOTS``, compared segment by segment (peers.services.launch_cwd_resolve)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from agents.models import Agent
from core.errors import DispatchError
from peers.services.incoming import launch_cwd_resolve
from tests.peers.conftest import FakePeer
from tests.peers.signing import peer_post


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``repos/`` (the root) with ``project/src``, a sibling ``repos-old/`` and ``elsewhere/``."""
    (tmp_path / "repos" / "project" / "src").mkdir(parents=True)
    (tmp_path / "repos-old").mkdir()
    (tmp_path / "elsewhere").mkdir()
    return Path(os.path.realpath(tmp_path))


def root_of(tree: Path) -> list[str]:
    return [str(tree / "repos")]


def refusal(cwd: str, roots: list[str]) -> DispatchError:
    with pytest.raises(DispatchError) as caught:
        launch_cwd_resolve(cwd, roots=roots)
    return caught.value


def test_the_root_and_its_subdirectories_are_accepted(tree):
    roots = root_of(tree)

    assert launch_cwd_resolve(str(tree / "repos"), roots=roots) == str(tree / "repos")
    assert launch_cwd_resolve(str(tree / "repos" / "project" / "src"), roots=roots) == str(
        tree / "repos" / "project" / "src"
    )


def test_a_directory_outside_every_root_is_refused_naming_the_roots(tree):
    roots = [*root_of(tree), str(tree / "repos-old")]

    error = refusal(str(tree / "elsewhere"), roots)

    assert error.code == "PATH_OUTSIDE_ALLOWED_ROOT" and error.http_status == 400
    assert str(tree / "repos") in error.message and str(tree / "repos-old") in error.message
    assert error.details["roots"] == roots


def test_dot_dot_traversal_out_of_a_root_is_refused(tree):
    error = refusal(str(tree / "repos" / "project" / ".." / ".." / "elsewhere"), root_of(tree))

    assert error.code == "PATH_OUTSIDE_ALLOWED_ROOT"


def test_dot_dot_that_stays_inside_the_root_is_accepted(tree):
    cwd = str(tree / "repos" / "project" / "src" / "..")

    assert launch_cwd_resolve(cwd, roots=root_of(tree)) == str(tree / "repos" / "project")


def test_a_symlink_leaving_the_root_is_refused(tree):
    (tree / "repos" / "escape").symlink_to(tree / "elsewhere")

    error = refusal(str(tree / "repos" / "escape"), root_of(tree))

    assert error.code == "PATH_OUTSIDE_ALLOWED_ROOT"


def test_a_symlink_into_the_root_is_judged_by_where_it_leads(tree):
    (tree / "elsewhere" / "shortcut").symlink_to(tree / "repos" / "project")

    assert launch_cwd_resolve(str(tree / "elsewhere" / "shortcut"), roots=root_of(tree)) == str(
        tree / "repos" / "project"
    )


def test_a_sibling_sharing_the_roots_prefix_is_not_inside_it(tree):
    error = refusal(str(tree / "repos-old"), root_of(tree))

    assert error.code == "PATH_OUTSIDE_ALLOWED_ROOT"


def test_a_leading_tilde_is_this_instances_home(tree, monkeypatch):
    monkeypatch.setenv("HOME", str(tree / "repos"))

    assert launch_cwd_resolve("~/project", roots=root_of(tree)) == str(tree / "repos" / "project")
    assert launch_cwd_resolve("~", roots=root_of(tree)) == str(tree / "repos")


@pytest.mark.parametrize("cwd", ["project", "", "~someone/project", 42, None])
def test_a_relative_or_malformed_cwd_is_refused(tree, cwd):
    error = refusal(cwd, root_of(tree))

    assert error.code == "INVALID_REQUEST"
    assert str(tree / "repos") in error.message


def test_a_missing_directory_inside_the_root_is_refused(tree):
    error = refusal(str(tree / "repos" / "nothing-here"), root_of(tree))

    assert error.code == "INVALID_REQUEST"
    assert "not an existing directory" in error.message


def test_without_roots_incoming_launches_are_disabled(tree):
    error = refusal(str(tree / "repos"), [])

    assert error.code == "INVALID_REQUEST"
    assert error.message == "incoming launches are disabled on this instance: DISPATCH_REPO_ROOTS is empty"


@pytest.mark.django_db
def test_the_launch_route_refuses_a_symlink_out_of_the_root_and_launches_nothing(
    tree, settings: Any, make_peer: Callable[..., FakePeer], owner: Any
):
    settings.REPO_ROOTS = root_of(tree)
    (tree / "repos" / "escape").symlink_to(tree / "elsewhere")
    cloud = make_peer(owner, label="Cloud")
    body = {
        "name": "x",
        "prompt": "",
        "type": "expert",
        "cwd": str(tree / "repos" / "escape"),
        "launched_by": {"instance_id": cloud.instance_id, "agent_id": None, "name": "dana"},
    }

    response = peer_post(Client(), cloud, "/api/v1/peers/launch", body)

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "PATH_OUTSIDE_ALLOWED_ROOT"
    assert error["details"]["roots"] == root_of(tree)
    assert not Agent.objects.exists()
