"""FILE_* operations and their error codes (docs/shim-protocol.md#operations), against a tmp root."""

from __future__ import annotations

import base64
import errno
import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from machines.shim import ErrorCode, Operations, ShimError
from machines.shim.files import os_error

# -- FILE_READ ----------------------------------------------------------------------------

Refusal = Callable[[Operations, str, dict[str, Any]], Awaitable[ShimError]]


async def test_it_reads_a_utf8_file_whole(ops: Operations, root: Path) -> None:
    (root / "hello.txt").write_text("grüße\n", encoding="utf-8")
    response_type, payload = await ops.perform("FILE_READ", {"path": "hello.txt", "encoding": "utf-8"})
    assert response_type == "FILE_CONTENTS"
    assert payload == {"content": "grüße\n", "encoding": "utf-8", "size_bytes": 8, "offset": 0, "truncated": False}


async def test_it_reads_binary_files_as_base64(ops: Operations, root: Path) -> None:
    data = bytes(range(256))
    (root / "blob.bin").write_bytes(data)
    _, payload = await ops.perform("FILE_READ", {"path": str(root / "blob.bin"), "encoding": "base64"})
    assert base64.b64decode(payload["content"]) == data
    assert payload["size_bytes"] == 256


async def test_it_refuses_a_utf8_read_of_bytes_that_are_not_utf8(ops: Operations, root: Path, refusal: Refusal) -> None:
    (root / "blob.bin").write_bytes(b"ok\xff\xfe")
    error = await refusal(ops, "FILE_READ", {"path": "blob.bin", "encoding": "utf-8"})
    assert error.code == ErrorCode.ENCODING_ERROR
    assert error.details is not None and error.details["byte_offset"] == 2


async def test_it_refuses_an_unranged_read_over_the_limit(ops: Operations, root: Path, refusal: Refusal) -> None:
    (root / "big.txt").write_text("x" * 1025)  # the test limit is 1024 bytes
    error = await refusal(ops, "FILE_READ", {"path": "big.txt", "encoding": "utf-8"})
    assert error.code == ErrorCode.FILE_TOO_LARGE
    assert error.details == {"path": str(root / "big.txt"), "size_bytes": 1025, "max_file_size_bytes": 1024}


async def test_it_pages_through_a_large_file_with_offset_and_length(ops: Operations, root: Path) -> None:
    data = os.urandom(3000)
    (root / "big.bin").write_bytes(data)
    pieces, offset, truncated = [], 0, True
    while truncated:
        _, payload = await ops.perform(
            "FILE_READ", {"path": "big.bin", "encoding": "base64", "offset": offset, "length": 1000}
        )
        assert payload["offset"] == offset and payload["size_bytes"] == 3000
        chunk = base64.b64decode(payload["content"])
        pieces.append(chunk)
        offset += len(chunk)
        truncated = payload["truncated"]
    assert b"".join(pieces) == data
    assert len(pieces) == 3


async def test_it_caps_a_ranged_read_at_the_limit_and_says_it_is_truncated(ops: Operations, root: Path) -> None:
    (root / "big.txt").write_text("y" * 5000)
    _, payload = await ops.perform("FILE_READ", {"path": "big.txt", "encoding": "utf-8", "offset": 10})
    assert payload["content"] == "y" * 1024
    assert payload["truncated"] is True
    _, payload = await ops.perform("FILE_READ", {"path": "big.txt", "encoding": "utf-8", "offset": 4990})
    assert payload == {"content": "y" * 10, "encoding": "utf-8", "size_bytes": 5000, "offset": 4990, "truncated": False}


async def test_it_leaves_a_character_split_by_a_page_for_the_next_page(ops: Operations, root: Path) -> None:
    (root / "text.txt").write_text("aé b", encoding="utf-8")  # é is 2 bytes: 61 c3 a9 20 62
    _, first = await ops.perform("FILE_READ", {"path": "text.txt", "encoding": "utf-8", "offset": 0, "length": 2})
    assert first["content"] == "a" and first["truncated"] is True
    _, second = await ops.perform("FILE_READ", {"path": "text.txt", "encoding": "utf-8", "offset": 1, "length": 10})
    assert second["content"] == "é b" and second["truncated"] is False


async def test_it_answers_a_read_past_the_end_with_nothing(ops: Operations, root: Path) -> None:
    (root / "small.txt").write_text("abc")
    _, payload = await ops.perform("FILE_READ", {"path": "small.txt", "encoding": "utf-8", "offset": 99})
    assert payload["content"] == "" and payload["truncated"] is False


async def test_it_refuses_to_read_a_directory_or_a_missing_file(ops: Operations, root: Path, refusal: Refusal) -> None:
    (root / "dir").mkdir()
    assert (await refusal(ops, "FILE_READ", {"path": "dir", "encoding": "utf-8"})).code == ErrorCode.IS_A_DIRECTORY
    missing = await refusal(ops, "FILE_READ", {"path": "nope.txt", "encoding": "utf-8"})
    assert missing.code == ErrorCode.PATH_NOT_FOUND


async def test_it_refuses_to_read_something_that_is_not_a_regular_file(
    ops: Operations, root: Path, refusal: Refusal
) -> None:
    os.mkfifo(root / "pipe")  # opening a FIFO for reading would block forever
    error = await refusal(ops, "FILE_READ", {"path": "pipe", "encoding": "utf-8"})
    assert error.code == ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    "payload",
    [
        {"path": "f.txt", "encoding": "latin-1"},
        {"path": "f.txt", "encoding": "utf-8", "offset": -1},
        {"path": "f.txt", "encoding": "utf-8", "length": "10"},
        {"path": "f.txt", "encoding": "utf-8", "offset": True},
        {"encoding": "utf-8"},
    ],
)
async def test_it_refuses_read_payloads_that_do_not_fit(
    ops: Operations, root: Path, payload: dict, refusal: Refusal
) -> None:
    (root / "f.txt").write_text("x")
    assert (await refusal(ops, "FILE_READ", payload)).code == ErrorCode.INVALID_REQUEST


async def test_it_refuses_to_read_through_a_symlink_out_of_the_root(
    ops: Operations, root: Path, outside: Path, refusal: Refusal
) -> None:
    (root / "escape").symlink_to(outside / "secret.txt")
    error = await refusal(ops, "FILE_READ", {"path": "escape", "encoding": "utf-8"})
    assert error.code == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert "outside secret" not in error.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
async def test_it_reports_a_read_the_os_refuses(ops: Operations, root: Path, refusal: Refusal) -> None:
    (root / "private.txt").write_text("x")
    (root / "private.txt").chmod(0)
    assert (await refusal(ops, "FILE_READ", {"path": "private.txt"})).code == ErrorCode.PERMISSION_DENIED


@pytest.mark.parametrize(
    ("number", "code"),
    [
        (errno.EACCES, ErrorCode.PERMISSION_DENIED),
        (errno.EPERM, ErrorCode.PERMISSION_DENIED),
        (errno.ENOSPC, ErrorCode.PERMISSION_DENIED),
        (errno.ENOENT, ErrorCode.PATH_NOT_FOUND),
        (errno.EEXIST, ErrorCode.PATH_EXISTS),
        (errno.ENOTEMPTY, ErrorCode.PATH_NOT_EMPTY),
        (errno.EISDIR, ErrorCode.IS_A_DIRECTORY),
        (errno.ENAMETOOLONG, ErrorCode.INVALID_REQUEST),
    ],
)
def test_it_maps_os_errors_to_protocol_codes(number: int, code: ErrorCode) -> None:
    error = os_error(OSError(number, os.strerror(number)), "/some/path")
    assert error.code == code
    assert error.details == {"errno": errno.errorcode[number], "path": "/some/path"}


# -- FILE_WRITE ---------------------------------------------------------------------------


async def test_it_writes_a_file_and_reports_the_bytes_written(ops: Operations, root: Path) -> None:
    response_type, payload = await ops.perform(
        "FILE_WRITE", {"path": "out.txt", "content": "grüße", "encoding": "utf-8"}
    )
    assert (response_type, payload) == ("ACK", {"size_bytes_written": 7})
    assert (root / "out.txt").read_text(encoding="utf-8") == "grüße"


async def test_it_replaces_then_appends(ops: Operations, root: Path) -> None:
    (root / "log.txt").write_text("old content")
    await ops.perform("FILE_WRITE", {"path": "log.txt", "content": "one\n", "encoding": "utf-8"})
    await ops.perform("FILE_WRITE", {"path": "log.txt", "content": "two\n", "encoding": "utf-8", "append": True})
    assert (root / "log.txt").read_text() == "one\ntwo\n"


async def test_it_writes_base64_content_as_bytes(ops: Operations, root: Path) -> None:
    data = b"\x00\xff\x10binary"
    await ops.perform("FILE_WRITE", {"path": "b.bin", "content": base64.b64encode(data).decode(), "encoding": "base64"})
    assert (root / "b.bin").read_bytes() == data


async def test_it_creates_parents_only_when_asked(ops: Operations, root: Path, refusal: Refusal) -> None:
    missing = await refusal(ops, "FILE_WRITE", {"path": "a/b/c.txt", "content": "x", "encoding": "utf-8"})
    assert missing.code == ErrorCode.PATH_NOT_FOUND
    assert not (root / "a").exists()
    await ops.perform("FILE_WRITE", {"path": "a/b/c.txt", "content": "x", "encoding": "utf-8", "create_parents": True})
    assert (root / "a" / "b" / "c.txt").read_text() == "x"


async def test_it_refuses_to_write_over_a_directory(ops: Operations, root: Path, refusal: Refusal) -> None:
    (root / "dir").mkdir()
    error = await refusal(ops, "FILE_WRITE", {"path": "dir", "content": "x", "encoding": "utf-8"})
    assert error.code == ErrorCode.IS_A_DIRECTORY


async def test_it_refuses_content_over_the_limit(ops: Operations, root: Path, refusal: Refusal) -> None:
    error = await refusal(ops, "FILE_WRITE", {"path": "big.txt", "content": "x" * 1025, "encoding": "utf-8"})
    assert error.code == ErrorCode.FILE_TOO_LARGE
    assert not (root / "big.txt").exists()


@pytest.mark.parametrize(
    "payload",
    [
        {"path": "f.txt", "content": "not base64!", "encoding": "base64"},
        {"path": "f.txt", "content": 12, "encoding": "utf-8"},
        {"path": "f.txt", "encoding": "utf-8"},
        {"path": "f.txt", "content": "x", "encoding": "utf-8", "append": "yes"},
    ],
)
async def test_it_refuses_write_payloads_that_do_not_fit(
    ops: Operations, root: Path, payload: dict, refusal: Refusal
) -> None:
    assert (await refusal(ops, "FILE_WRITE", payload)).code == ErrorCode.INVALID_REQUEST
    assert not (root / "f.txt").exists()


async def test_it_refuses_to_write_through_a_symlinked_parent_pointing_outside(
    ops: Operations, root: Path, outside: Path, refusal: Refusal
) -> None:
    (root / "linked").symlink_to(outside)
    for path in ("linked/new.txt", "linked/secret.txt"):
        error = await refusal(
            ops, "FILE_WRITE", {"path": path, "content": "pwned", "encoding": "utf-8", "create_parents": True}
        )
        assert error.code == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "outside secret"


# -- FILE_STAT ----------------------------------------------------------------------------


async def test_it_stats_a_file_with_its_hash(ops: Operations, root: Path) -> None:
    (root / "f.txt").write_bytes(b"hash me")
    (root / "f.txt").chmod(0o640)
    response_type, payload = await ops.perform("FILE_STAT", {"path": "f.txt", "hash": True})
    assert response_type == "FILE_STAT_RESPONSE"
    assert payload == {
        "exists": True,
        "is_file": True,
        "is_dir": False,
        "is_symlink": False,
        "size_bytes": 7,
        "mtime": (root / "f.txt").stat().st_mtime,
        "mode": 0o640,
        "sha256": hashlib.sha256(b"hash me").hexdigest(),
    }


async def test_it_leaves_the_hash_out_unless_asked(ops: Operations, root: Path) -> None:
    (root / "f.txt").write_bytes(b"x")
    _, payload = await ops.perform("FILE_STAT", {"path": "f.txt"})
    assert "sha256" not in payload


async def test_it_answers_exists_false_for_a_missing_path(ops: Operations) -> None:
    _, payload = await ops.perform("FILE_STAT", {"path": "nothing/here"})
    assert payload["exists"] is False and payload["is_file"] is False and payload["size_bytes"] is None


async def test_it_reports_symlinks_and_directories(ops: Operations, root: Path) -> None:
    (root / "dir").mkdir()
    (root / "link").symlink_to(root / "dir")
    _, payload = await ops.perform("FILE_STAT", {"path": "link", "hash": True})
    assert payload["is_symlink"] is True and payload["is_dir"] is True and payload["sha256"] is None


async def test_it_refuses_to_stat_outside_the_root(ops: Operations, outside: Path, refusal: Refusal) -> None:
    error = await refusal(ops, "FILE_STAT", {"path": str(outside / "secret.txt")})
    assert error.code == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT


# -- FILE_LIST ----------------------------------------------------------------------------


def tree(root: Path) -> None:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print()")
    (root / "src" / "pkg" / "mod.py").write_text("x = 1")
    (root / "src" / "pkg" / "data.json").write_text("{}")
    (root / "README.md").write_text("# hi")
    (root / ".hidden").write_text("h")


async def test_it_lists_a_directory_sorted_without_hidden_entries(ops: Operations, root: Path) -> None:
    tree(root)
    response_type, payload = await ops.perform("FILE_LIST", {"path": "."})
    assert response_type == "FILE_LIST_RESPONSE"
    assert [entry["name"] for entry in payload["entries"]] == ["README.md", "src"]
    readme = payload["entries"][0]
    assert readme == {
        "name": "README.md",
        "path": str(root / "README.md"),
        "is_dir": False,
        "size_bytes": 4,
        "mtime": (root / "README.md").stat().st_mtime,
    }
    assert payload["entries"][1]["is_dir"] is True
    assert payload["truncated"] is False


async def test_it_lists_hidden_entries_when_asked(ops: Operations, root: Path) -> None:
    tree(root)
    _, payload = await ops.perform("FILE_LIST", {"path": str(root), "include_hidden": True})
    assert [entry["name"] for entry in payload["entries"]] == [".hidden", "README.md", "src"]


async def test_it_lists_recursively_with_a_glob(ops: Operations, root: Path) -> None:
    tree(root)
    _, payload = await ops.perform("FILE_LIST", {"path": ".", "recursive": True, "glob": "*.py"})
    assert [entry["path"] for entry in payload["entries"]] == [
        str(root / "src" / "main.py"),
        str(root / "src" / "pkg" / "mod.py"),
    ]
    _, payload = await ops.perform("FILE_LIST", {"path": ".", "recursive": True, "glob": "src/pkg/*"})
    assert [entry["name"] for entry in payload["entries"]] == ["data.json", "mod.py"]


async def test_it_stops_at_max_entries_and_says_so(ops: Operations, root: Path) -> None:
    for number in range(5):
        (root / f"f{number}").write_text("")
    _, payload = await ops.perform("FILE_LIST", {"path": ".", "max_entries": 3})
    assert [entry["name"] for entry in payload["entries"]] == ["f0", "f1", "f2"]
    assert payload["truncated"] is True
    _, exact = await ops.perform("FILE_LIST", {"path": ".", "max_entries": 5})
    assert len(exact["entries"]) == 5 and exact["truncated"] is False


async def test_it_defaults_to_a_thousand_entries(ops: Operations, root: Path) -> None:
    for number in range(1001):
        (root / f"f{number:04}").write_text("")
    _, payload = await ops.perform("FILE_LIST", {"path": "."})
    assert len(payload["entries"]) == 1000 and payload["truncated"] is True


async def test_it_never_follows_a_symlink_out_of_the_roots_when_listing(
    ops: Operations, root: Path, outside: Path
) -> None:
    (root / "inside.txt").write_text("i")
    (root / "escape_dir").symlink_to(outside)
    (root / "escape_file").symlink_to(outside / "secret.txt")
    (root / "alias.txt").symlink_to(root / "inside.txt")
    _, payload = await ops.perform("FILE_LIST", {"path": ".", "recursive": True})
    assert [entry["name"] for entry in payload["entries"]] == ["alias.txt", "inside.txt"]
    assert all(str(outside) not in entry["path"] for entry in payload["entries"])


async def test_it_does_not_descend_into_symlinked_directories(ops: Operations, root: Path) -> None:
    (root / "dir").mkdir()
    (root / "dir" / "loop").symlink_to(root)  # a cycle, inside the root
    _, payload = await ops.perform("FILE_LIST", {"path": ".", "recursive": True})
    assert [entry["path"] for entry in payload["entries"]] == [str(root / "dir"), str(root / "dir" / "loop")]
    assert payload["entries"][1]["is_dir"] is True


async def test_it_refuses_to_list_a_file_or_a_missing_directory(ops: Operations, root: Path, refusal: Refusal) -> None:
    (root / "f.txt").write_text("")
    assert (await refusal(ops, "FILE_LIST", {"path": "f.txt"})).code == ErrorCode.INVALID_REQUEST
    assert (await refusal(ops, "FILE_LIST", {"path": "nope"})).code == ErrorCode.PATH_NOT_FOUND
    assert (await refusal(ops, "FILE_LIST", {"path": ".", "max_entries": 0})).code == ErrorCode.INVALID_REQUEST
    assert (await refusal(ops, "FILE_LIST", {"path": "..", "recursive": True})).code == (
        ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    )


# -- FILE_DELETE --------------------------------------------------------------------------


async def test_it_deletes_a_file(ops: Operations, root: Path) -> None:
    (root / "f.txt").write_text("")
    assert await ops.perform("FILE_DELETE", {"path": "f.txt"}) == ("ACK", {})
    assert not (root / "f.txt").exists()


async def test_it_refuses_to_delete_a_non_empty_directory_unless_recursive(
    ops: Operations, root: Path, refusal: Refusal
) -> None:
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "sub" / "f.txt").write_text("")
    assert (await refusal(ops, "FILE_DELETE", {"path": "dir"})).code == ErrorCode.PATH_NOT_EMPTY
    assert (root / "dir" / "sub" / "f.txt").exists()
    await ops.perform("FILE_DELETE", {"path": "dir", "recursive": True})
    assert not (root / "dir").exists()


async def test_it_deletes_an_empty_directory(ops: Operations, root: Path) -> None:
    (root / "empty").mkdir()
    await ops.perform("FILE_DELETE", {"path": "empty"})
    assert not (root / "empty").exists()


async def test_it_refuses_to_delete_what_is_missing_unless_missing_ok(ops: Operations, refusal: Refusal) -> None:
    assert (await refusal(ops, "FILE_DELETE", {"path": "gone"})).code == ErrorCode.PATH_NOT_FOUND
    assert await ops.perform("FILE_DELETE", {"path": "gone", "missing_ok": True}) == ("ACK", {})


async def test_it_deletes_a_symlink_and_not_its_target(ops: Operations, root: Path) -> None:
    (root / "dir").mkdir()
    (root / "dir" / "keep.txt").write_text("keep")
    (root / "link").symlink_to(root / "dir")
    await ops.perform("FILE_DELETE", {"path": "link", "recursive": True})
    assert not (root / "link").exists()
    assert (root / "dir" / "keep.txt").read_text() == "keep"


async def test_it_refuses_to_delete_the_root_or_outside_it(
    ops: Operations, root: Path, outside: Path, refusal: Refusal
) -> None:
    error = await refusal(ops, "FILE_DELETE", {"path": str(root), "recursive": True})
    assert error.code == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    error = await refusal(ops, "FILE_DELETE", {"path": "../outside/secret.txt"})
    assert error.code == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert root.is_dir() and (outside / "secret.txt").exists()


# -- FILE_MOVE ----------------------------------------------------------------------------


async def test_it_moves_a_file(ops: Operations, root: Path) -> None:
    (root / "a.txt").write_text("a")
    assert await ops.perform("FILE_MOVE", {"src": "a.txt", "dst": "b.txt"}) == ("ACK", {})
    assert not (root / "a.txt").exists() and (root / "b.txt").read_text() == "a"


async def test_it_refuses_to_replace_an_existing_destination_without_overwrite(
    ops: Operations, root: Path, refusal: Refusal
) -> None:
    (root / "a.txt").write_text("a")
    (root / "b.txt").write_text("b")
    assert (await refusal(ops, "FILE_MOVE", {"src": "a.txt", "dst": "b.txt"})).code == ErrorCode.PATH_EXISTS
    assert (root / "b.txt").read_text() == "b"
    await ops.perform("FILE_MOVE", {"src": "a.txt", "dst": "b.txt", "overwrite": True})
    assert (root / "b.txt").read_text() == "a" and not (root / "a.txt").exists()


async def test_it_refuses_to_move_what_is_missing_or_into_a_missing_directory(
    ops: Operations, root: Path, refusal: Refusal
) -> None:
    assert (await refusal(ops, "FILE_MOVE", {"src": "gone", "dst": "x"})).code == ErrorCode.PATH_NOT_FOUND
    (root / "a.txt").write_text("a")
    assert (await refusal(ops, "FILE_MOVE", {"src": "a.txt", "dst": "no/dir/x"})).code == ErrorCode.PATH_NOT_FOUND


async def test_it_refuses_to_move_a_file_over_a_directory(ops: Operations, root: Path, refusal: Refusal) -> None:
    (root / "a.txt").write_text("a")
    (root / "dir").mkdir()
    error = await refusal(ops, "FILE_MOVE", {"src": "a.txt", "dst": "dir", "overwrite": True})
    assert error.code == ErrorCode.IS_A_DIRECTORY


async def test_it_refuses_to_move_a_directory_over_a_non_empty_one(
    ops: Operations, root: Path, refusal: Refusal
) -> None:
    (root / "a").mkdir()
    (root / "b").mkdir()
    (root / "b" / "f").write_text("")
    error = await refusal(ops, "FILE_MOVE", {"src": "a", "dst": "b", "overwrite": True})
    assert error.code == ErrorCode.PATH_NOT_EMPTY


async def test_it_refuses_to_move_a_directory_into_itself(ops: Operations, root: Path, refusal: Refusal) -> None:
    (root / "dir").mkdir()
    error = await refusal(ops, "FILE_MOVE", {"src": "dir", "dst": "dir/inner"})
    assert error.code == ErrorCode.INVALID_REQUEST
    assert (root / "dir").is_dir()


async def test_it_refuses_to_move_out_of_or_into_places_outside_the_root(
    ops: Operations, root: Path, outside: Path, refusal: Refusal
) -> None:
    (root / "a.txt").write_text("a")
    out = await refusal(ops, "FILE_MOVE", {"src": "a.txt", "dst": str(outside / "a.txt")})
    assert out.code == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    into = await refusal(ops, "FILE_MOVE", {"src": str(outside / "secret.txt"), "dst": "stolen.txt"})
    assert into.code == ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT
    assert (root / "a.txt").exists() and (outside / "secret.txt").exists()


# -- capabilities and unknown operations ---------------------------------------------------


async def test_it_refuses_operations_whose_capability_was_not_granted(
    make_operations: Callable[..., Operations], root: Path, refusal: Refusal
) -> None:
    shell_only = make_operations(capabilities=("shell",))
    error = await refusal(shell_only, "FILE_WRITE", {"path": "f.txt", "content": "x", "encoding": "utf-8"})
    assert error.code == ErrorCode.CAPABILITY_NOT_GRANTED
    assert not (root / "f.txt").exists()
    files_only = make_operations(capabilities=("files",))
    error = await refusal(files_only, "EXECUTE_COMMAND", {"argv": ["touch", str(root / "ran")]})
    assert error.code == ErrorCode.CAPABILITY_NOT_GRANTED
    assert not (root / "ran").exists()


async def test_it_refuses_operations_it_does_not_know(ops: Operations, refusal: Refusal) -> None:
    assert (await refusal(ops, "FILE_COPY", {})).code == ErrorCode.UNSUPPORTED_OPERATION


async def test_it_describes_itself_for_machine_list(ops: Operations, identity: object) -> None:
    response_type, payload = await ops.perform("MACHINE_LIST_REQUEST", {})
    assert response_type == "MACHINE_LIST_RESPONSE"
    assert set(payload) == {
        "machine_id",
        "hostname",
        "display_name",
        "platform",
        "arch",
        "capabilities",
        "hardware_devices",
    }
    assert payload["display_name"] == "testbox"
    assert payload["capabilities"] == ["files", "shell"]
    assert await ops.perform("PING", {}) == ("PONG", {})
