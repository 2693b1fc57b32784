"""The shim's blocking file work (docs/shim-protocol.md#operations): reads, writes, stat and
hash, listings, deletes and moves inside the jail, each run in a worker thread by
:class:`~machines.shim.operations.Operations`, and ``os_error``, the protocol error code of
an ``OSError`` (docs/shim-protocol.md#errors)."""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import errno
import fnmatch
import hashlib
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from .jail import JailedPath, PathJail
from .protocol import ErrorCode, ShimError

_ERRNO_CODES: Mapping[int, ErrorCode] = {
    errno.ENOENT: ErrorCode.PATH_NOT_FOUND,
    errno.ENOTDIR: ErrorCode.PATH_NOT_FOUND,
    errno.EEXIST: ErrorCode.PATH_EXISTS,
    errno.ENOTEMPTY: ErrorCode.PATH_NOT_EMPTY,
    errno.EISDIR: ErrorCode.IS_A_DIRECTORY,
    errno.EACCES: ErrorCode.PERMISSION_DENIED,
    errno.EPERM: ErrorCode.PERMISSION_DENIED,
    errno.EROFS: ErrorCode.PERMISSION_DENIED,
    errno.ENAMETOOLONG: ErrorCode.INVALID_REQUEST,
    errno.ELOOP: ErrorCode.INVALID_REQUEST,
    errno.EINVAL: ErrorCode.INVALID_REQUEST,
}


_T = TypeVar("_T")


def os_error(error: OSError, path: str | None = None) -> ShimError:
    """Translate an ``OSError`` into the protocol's error code for it.

    ENOENT/ENOTDIR → ``PATH_NOT_FOUND``, EEXIST → ``PATH_EXISTS``, ENOTEMPTY →
    ``PATH_NOT_EMPTY``, EISDIR → ``IS_A_DIRECTORY``, ENAMETOOLONG/ELOOP/EINVAL →
    ``INVALID_REQUEST``; EACCES, EPERM and anything else the OS refused (EROFS, ENOSPC…)
    → ``PERMISSION_DENIED``. ``details`` carries the path and the errno name.
    """
    code = _ERRNO_CODES.get(error.errno or 0, ErrorCode.PERMISSION_DENIED)
    reason = error.strerror or type(error).__name__
    details: dict[str, Any] = {"errno": errno.errorcode.get(error.errno or 0, str(error.errno))}
    if path is not None:
        details["path"] = path
    return ShimError(code, f"{path}: {reason}" if path else reason, details)


_READ_CHUNK = 1024 * 1024


async def cancellable(function: Callable[..., _T], *args: Any) -> _T:
    """Run ``function(*args, cancelled)`` in a thread; set ``cancelled`` (a
    ``threading.Event``) when the calling task is cancelled, so long walks stop early."""
    cancelled = threading.Event()
    try:
        return await asyncio.to_thread(function, *args, cancelled)
    except asyncio.CancelledError:
        cancelled.set()
        raise


def read_file(jailed: JailedPath, encoding: str, offset: int | None, length: int | None, limit: int) -> dict[str, Any]:
    try:
        descriptor = os.open(jailed.real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise os_error(error, jailed.requested) from None
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        os.close(descriptor)
        if stat.S_ISDIR(status.st_mode):
            raise ShimError(ErrorCode.IS_A_DIRECTORY, f"{jailed.requested} is a directory", {"path": jailed.requested})
        raise ShimError(
            ErrorCode.INVALID_REQUEST, f"{jailed.requested} is not a regular file", {"path": jailed.requested}
        )
    with os.fdopen(descriptor, "rb") as file:
        if offset is None and length is None and status.st_size > limit:
            raise ShimError(
                ErrorCode.FILE_TOO_LARGE,
                f"{jailed.requested} has {status.st_size} bytes, over the {limit}-byte limit; "
                "read it in ranges with offset/length",
                {"path": jailed.requested, "size_bytes": status.st_size, "max_file_size_bytes": limit},
            )
        start = offset or 0
        file.seek(start)
        try:
            data = file.read(limit if length is None else min(length, limit))
        except OSError as error:
            raise os_error(error, jailed.requested) from None
        size = os.fstat(file.fileno()).st_size
    more = start + len(data) < size
    if encoding == "base64":
        content = base64.b64encode(data).decode("ascii")
    else:
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        try:
            content = decoder.decode(data, final=not more)
        except UnicodeDecodeError as error:
            raise ShimError(
                ErrorCode.ENCODING_ERROR,
                f"{jailed.requested} is not UTF-8 at byte {start + error.start}; read it as base64",
                {"path": jailed.requested, "byte_offset": start + error.start},
            ) from None
        more = more or bool(decoder.getstate()[0])  # a split character waits for the next page
    return {"content": content, "encoding": encoding, "size_bytes": size, "offset": start, "truncated": more}


def write_file(jailed: JailedPath, data: bytes, create_parents: bool, append: bool) -> dict[str, Any]:
    parent = os.path.dirname(jailed.entry)
    try:
        if create_parents:
            os.makedirs(parent, exist_ok=True)
        elif not os.path.isdir(parent):
            raise ShimError(
                ErrorCode.PATH_NOT_FOUND,
                f"the directory of {jailed.requested} does not exist (create_parents creates it)",
                {"path": jailed.requested},
            )
        if os.path.isdir(jailed.real):
            raise ShimError(ErrorCode.IS_A_DIRECTORY, f"{jailed.requested} is a directory", {"path": jailed.requested})
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
        descriptor = os.open(jailed.real, flags, 0o666)
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
    except OSError as error:
        raise os_error(error, jailed.requested) from None
    return {"size_bytes_written": len(data)}


def stat_path(jailed: JailedPath, want_hash: bool, cancelled: threading.Event) -> dict[str, Any]:
    result: dict[str, Any] = {
        "exists": False,
        "is_file": False,
        "is_dir": False,
        "is_symlink": False,
        "size_bytes": None,
        "mtime": None,
        "mode": None,
    }
    if want_hash:
        result["sha256"] = None
    try:
        link_status = os.lstat(jailed.entry)
    except (FileNotFoundError, NotADirectoryError):
        return result
    except OSError as error:
        raise os_error(error, jailed.requested) from None
    result["is_symlink"] = stat.S_ISLNK(link_status.st_mode)
    try:
        status = os.stat(jailed.real)
    except (FileNotFoundError, NotADirectoryError):
        return result  # a dangling symlink
    except OSError as error:
        raise os_error(error, jailed.requested) from None
    result.update(
        exists=True,
        is_file=stat.S_ISREG(status.st_mode),
        is_dir=stat.S_ISDIR(status.st_mode),
        size_bytes=status.st_size,
        mtime=status.st_mtime,
        mode=stat.S_IMODE(status.st_mode),
    )
    if want_hash and result["is_file"]:
        result["sha256"] = sha256_of(jailed, cancelled)
    return result


def sha256_of(jailed: JailedPath, cancelled: threading.Event) -> str:
    digest = hashlib.sha256()
    try:
        with open(jailed.real, "rb") as file:
            while chunk := file.read(_READ_CHUNK):
                if cancelled.is_set():
                    raise asyncio.CancelledError
                digest.update(chunk)
    except OSError as error:
        raise os_error(error, jailed.requested) from None
    return digest.hexdigest()


def require_directory(jailed: JailedPath) -> None:
    try:
        status = os.stat(jailed.real)
    except OSError as error:
        raise os_error(error, jailed.requested) from None
    if not stat.S_ISDIR(status.st_mode):
        raise ShimError(ErrorCode.INVALID_REQUEST, f"{jailed.requested} is not a directory", {"path": jailed.requested})


@dataclass
class Listing:
    """One FILE_LIST walk (see :meth:`Operations.file_list`)."""

    jail: PathJail
    pattern: str | None
    recursive: bool
    include_hidden: bool
    max_entries: int

    def run(self, jailed: JailedPath, cancelled: threading.Event) -> dict[str, Any]:
        require_directory(jailed)
        entries: list[dict[str, Any]] = []
        try:
            top = self._children(jailed.real)
        except OSError as error:
            raise os_error(error, jailed.requested) from None
        stack: list[tuple[str, Iterator[os.DirEntry[str]]]] = [("", top)]
        while stack:
            if cancelled.is_set():
                raise asyncio.CancelledError
            prefix, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                continue
            entry = self._entry(child)
            if entry is None:
                continue
            relative = prefix + child.name
            if self._matches(child.name, relative):
                if len(entries) == self.max_entries:
                    return {"entries": entries, "truncated": True}
                entries.append(entry)
            if self.recursive and entry["is_dir"] and not child.is_symlink():
                with contextlib.suppress(OSError):  # an unreadable subdirectory is skipped
                    stack.append((relative + "/", self._children(child.path)))
        return {"entries": entries, "truncated": False}

    def _children(self, directory: str) -> Iterator[os.DirEntry[str]]:
        with os.scandir(directory) as scan:
            children = sorted(scan, key=lambda child: child.name)
        return iter(child for child in children if self.include_hidden or not child.name.startswith("."))

    def _entry(self, child: os.DirEntry[str]) -> dict[str, Any] | None:
        try:
            if child.is_symlink():
                if not self.jail.contains(os.path.realpath(child.path)):
                    return None  # never follow a link out of the roots
                try:
                    status = os.stat(child.path)
                except OSError:
                    status = child.stat(follow_symlinks=False)  # dangling inside the roots
            else:
                status = child.stat(follow_symlinks=False)
        except OSError:
            return None  # vanished while listing
        return {
            "name": child.name,
            "path": child.path,
            "is_dir": stat.S_ISDIR(status.st_mode),
            "size_bytes": status.st_size,
            "mtime": status.st_mtime,
        }

    def _matches(self, name: str, relative: str) -> bool:
        if self.pattern is None:
            return True
        return fnmatch.fnmatchcase(relative if "/" in self.pattern else name, self.pattern)


def delete_path(jailed: JailedPath, recursive: bool, missing_ok: bool) -> None:
    try:
        status = os.lstat(jailed.entry)
    except (FileNotFoundError, NotADirectoryError):
        if missing_ok:
            return
        raise ShimError(ErrorCode.PATH_NOT_FOUND, f"{jailed.requested} does not exist", {"path": jailed.requested})
    except OSError as error:
        raise os_error(error, jailed.requested) from None
    try:
        if not stat.S_ISDIR(status.st_mode):
            os.unlink(jailed.entry)
        elif recursive:
            shutil.rmtree(jailed.entry)
        else:
            os.rmdir(jailed.entry)
    except OSError as error:
        if error.errno == errno.EEXIST:  # some systems report a non-empty rmdir as EEXIST
            error.errno = errno.ENOTEMPTY
        raise os_error(error, jailed.requested) from None


def move_path(source: JailedPath, destination: JailedPath, overwrite: bool) -> None:
    if not os.path.lexists(source.entry):
        raise ShimError(ErrorCode.PATH_NOT_FOUND, f"{source.requested} does not exist", {"path": source.requested})
    if not os.path.isdir(os.path.dirname(destination.entry)):
        raise ShimError(
            ErrorCode.PATH_NOT_FOUND,
            f"the directory of {destination.requested} does not exist",
            {"path": destination.requested},
        )
    if source.entry == destination.entry:
        return
    if os.path.lexists(destination.entry) and not overwrite:
        raise ShimError(
            ErrorCode.PATH_EXISTS,
            f"{destination.requested} exists (pass overwrite to replace it)",
            {"path": destination.requested},
        )
    try:
        os.replace(source.entry, destination.entry)
    except OSError as error:
        if error.errno != errno.EXDEV:
            raise os_error(error, destination.requested) from None
        _move_across_devices(source, destination)


def _move_across_devices(source: JailedPath, destination: JailedPath) -> None:
    """``rename`` cannot cross filesystems: copy, then remove (what ``mv`` does)."""
    try:
        if os.path.lexists(destination.entry):
            if os.path.isdir(destination.entry) and not os.path.islink(destination.entry):
                os.rmdir(destination.entry)  # only an empty directory, as rename would
            else:
                os.unlink(destination.entry)
        shutil.move(source.entry, destination.entry)
    except OSError as error:
        raise os_error(error, destination.requested) from None
