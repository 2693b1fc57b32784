"""The path jail (docs/shim-protocol.md#operations): realpath, segment-wise, writes checked on the
parent and the nearest existing ancestor too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from machines.shim import ErrorCode, PathJail, ShimError


def code_of(call: object, *args: object) -> ErrorCode:
    with pytest.raises(ShimError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value.code


def test_it_resolves_relative_paths_against_the_first_root(root: Path, tmp_path: Path) -> None:
    second = tmp_path / "second"
    second.mkdir()
    jail = PathJail([root, second])
    assert jail.check("notes/today.txt").real == str(root / "notes" / "today.txt")
    assert jail.check(str(second / "x")).real == str(second / "x")


def test_it_refuses_dot_dot_out_of_the_root(root: Path, outside: Path) -> None:
    jail = PathJail([root])
    assert code_of(jail.check, "../outside/secret.txt") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert code_of(jail.check, f"{root}/a/../../outside") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert code_of(jail.check_write, "../outside/new.txt") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT


def test_it_allows_dot_dot_that_stays_inside(root: Path) -> None:
    (root / "a").mkdir()
    assert PathJail([root]).check("a/../b.txt").real == str(root / "b.txt")


def test_it_refuses_absolute_paths_outside_every_root(root: Path, outside: Path) -> None:
    jail = PathJail([root])
    assert code_of(jail.check, str(outside / "secret.txt")) == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert code_of(jail.check, "/etc/passwd") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT


def test_it_refuses_a_symlink_that_points_out_of_the_root(root: Path, outside: Path) -> None:
    (root / "escape").symlink_to(outside / "secret.txt")
    (root / "escape_dir").symlink_to(outside)
    jail = PathJail([root])
    assert code_of(jail.check, "escape") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert code_of(jail.check, "escape_dir/secret.txt") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert code_of(jail.check, "escape_dir/../outside") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT


def test_it_allows_a_symlink_that_stays_inside(root: Path) -> None:
    (root / "real.txt").write_text("x")
    (root / "alias").symlink_to(root / "real.txt")
    jailed = PathJail([root]).check("alias")
    assert jailed.real == str(root / "real.txt")
    assert jailed.entry == str(root / "alias")


def test_it_compares_roots_by_segment_not_by_prefix(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "bc").mkdir()
    jail = PathJail([tmp_path / "a" / "b"])
    assert code_of(jail.check, str(tmp_path / "a" / "bc" / "file")) == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert code_of(jail.check_write, str(tmp_path / "a" / "bc")) == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert jail.check(str(tmp_path / "a" / "b" / "c")).real == str(tmp_path / "a" / "b" / "c")


def test_it_refuses_writes_through_a_symlinked_parent_pointing_outside(root: Path, outside: Path) -> None:
    (root / "linked").symlink_to(outside)
    jail = PathJail([root])
    assert code_of(jail.check_write, "linked/new.txt") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert code_of(jail.check_write, "linked/deeper/new.txt") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT


def test_it_refuses_writes_below_a_dangling_link_whose_target_is_outside(root: Path, outside: Path) -> None:
    # The nearest existing ancestor of root/dangling/sub is the dangling link itself,
    # which resolves outside: nothing may be created through it.
    (root / "dangling").symlink_to(outside / "not-yet")
    jail = PathJail([root])
    assert code_of(jail.check_write, "dangling/sub/new.txt") == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert not (outside / "not-yet").exists()


def test_it_allows_writes_below_directories_that_do_not_exist_yet(root: Path) -> None:
    jailed = PathJail([root]).check_write("new/dir/file.txt")
    assert jailed.real == str(root / "new" / "dir" / "file.txt")
    assert jailed.entry == jailed.real


def test_it_refuses_to_write_or_delete_a_root_itself(root: Path) -> None:
    # The lexical parent of a root is outside it.
    assert code_of(PathJail([root]).check_write, str(root)) == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT


@pytest.mark.parametrize("bad", [None, 42, "", "a\x00b", ["a"]])
def test_it_refuses_paths_that_are_not_non_empty_strings_without_nul(root: Path, bad: object) -> None:
    assert code_of(PathJail([root]).check, bad) == ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize("bad", [".", "sub/..", "sub/."])
def test_it_refuses_writes_that_do_not_end_in_a_name(root: Path, bad: str) -> None:
    assert code_of(PathJail([root]).check_write, bad) == ErrorCode.INVALID_REQUEST


def test_it_keeps_roots_as_realpaths(tmp_path: Path, root: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    jail = PathJail([alias, root])
    assert jail.roots == (str(root),)
    assert jail.check(str(alias / "x")).real == str(root / "x")


def test_it_refuses_a_root_that_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not an existing directory"):
        PathJail([tmp_path / "missing"])
    with pytest.raises(ValueError, match="not an existing directory"):
        PathJail([tmp_path / "file"])
    with pytest.raises(ValueError, match="at least one"):
        PathJail([])


def test_it_names_the_path_and_roots_in_the_refusal(root: Path) -> None:
    with pytest.raises(ShimError) as caught:
        PathJail([root]).check("/etc/passwd")
    assert caught.value.details == {"path": "/etc/passwd", "allowed_roots": [str(root)]}
    assert os.sep in caught.value.message
