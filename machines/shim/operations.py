"""The operations a shim executes for the platform (docs/shim-protocol.md#operations).

:class:`Operations` turns one request (type + payload) into its response (type +
payload) or raises :class:`~machines.shim.protocol.ShimError` with a protocol error code
(docs/shim-protocol.md#errors). Blocking file work runs in worker threads and commands run as asyncio subprocesses, so
the event loop stays free for PINGs and other operations while a long one runs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import getpass
import os
import platform
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import files
from .files import cancellable, os_error
from .guardian import GUARDIAN
from .jail import PathJail
from .live import PIPE_CHUNK, CommandOptions, FrameSender, LiveCommand, kill_group
from .payloads import (
    PAYLOADS,
    ExecuteCommand,
    FileDelete,
    FileList,
    FileMove,
    FileRead,
    FileStat,
    FileWrite,
    LiveFields,
    payload_of,
)
from .protocol import (
    OPERATIONS,
    PROTOCOL_VERSION,
    Capability,
    ErrorCode,
    Limits,
    MessageType,
    ShimError,
    supports_live_operations,
)

DEFAULT_LIST_ENTRIES = 1000
"""FILE_LIST's ``max_entries`` when the request names none."""

_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class MachineIdentity:
    """Who this shim is, as sent in HELLO and MACHINE_LIST_RESPONSE.

    ``platform`` is ``linux`` or ``darwin``; ``arch`` is normalised (``x86_64``, ``arm64``…).
    """

    machine_id: str
    hostname: str
    platform: str
    arch: str
    display_name: str | None = None
    hardware_devices: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @classmethod
    def detect(cls, machine_id: str, display_name: str | None = None) -> MachineIdentity:
        """This computer's identity: ``socket.gethostname()``, the normalised platform and
        architecture, no hardware devices (not detected yet)."""
        return cls(
            machine_id=machine_id,
            hostname=socket.gethostname(),
            platform=normalized_platform(),
            arch=normalized_arch(),
            display_name=display_name,
        )


def normalized_platform(name: str | None = None) -> str:
    """``sys.platform`` (or ``name``) as the protocol names it: ``linux``, ``darwin``,
    else unchanged (Windows is not supported: HELLO refuses it)."""
    name = name or sys.platform
    return "linux" if name.startswith("linux") else name


def normalized_arch(machine: str | None = None) -> str:
    """``platform.machine()`` (or ``machine``) normalised: ``amd64``/``x86_64`` → ``x86_64``,
    ``aarch64``/``arm64`` → ``arm64``, anything else lower-cased."""
    name = (machine if machine is not None else platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(name, name)


class Operations:
    """Executes the protocol's operations inside a path jail, with negotiated limits and capabilities.

    ``capabilities`` are the granted ones (``HELLO_ACK.granted_capabilities`` ∩ the
    shim's own); ``limits`` are the lower of both sides'. ``shell`` is the program
    that runs ``command`` strings with ``-c`` (default ``$SHELL``, else ``/bin/sh``).
    ``protocol_version`` is the connection's negotiated ``"major.minor"``: below 2.1
    the live fields of ``EXECUTE_COMMAND`` are refused ``UNSUPPORTED_OPERATION``.
    """

    def __init__(
        self,
        *,
        jail: PathJail,
        limits: Limits,
        capabilities: Iterable[str],
        identity: MachineIdentity,
        shell: str | None = None,
        protocol_version: str = PROTOCOL_VERSION,
    ) -> None:
        self.jail = jail
        self.protocol_version = protocol_version
        self.limits = limits
        self.capabilities = frozenset(capabilities)
        self.identity = identity
        self.shell = shell or os.environ.get("SHELL") or "/bin/sh"
        # Each handler takes its operation's payload model (``PAYLOADS``), or the raw
        # payload for the two operations that carry none.
        self._handlers: Mapping[str, Callable[[Any], Awaitable[dict[str, Any]]]] = {
            MessageType.MACHINE_LIST_REQUEST: self.machine_list,
            MessageType.FILE_READ: self.file_read,
            MessageType.FILE_WRITE: self.file_write,
            MessageType.FILE_STAT: self.file_stat,
            MessageType.FILE_LIST: self.file_list,
            MessageType.FILE_DELETE: self.file_delete,
            MessageType.FILE_MOVE: self.file_move,
            MessageType.EXECUTE_COMMAND: self.execute_command,
            MessageType.PING: self.ping,
        }

    def check_allowed(self, op: str) -> None:
        """Raise ``UNSUPPORTED_OPERATION`` for an unknown op, ``CAPABILITY_NOT_GRANTED``
        for one whose capability (``files``/``shell``) was not granted."""
        if op not in OPERATIONS:
            raise ShimError(ErrorCode.UNSUPPORTED_OPERATION, f"this shim does not support {op!r}", {"op": op})
        capability = OPERATIONS[op][1]
        if capability is not None and capability not in self.capabilities:
            raise ShimError(
                ErrorCode.CAPABILITY_NOT_GRANTED,
                f"{op} needs the {capability!s} capability, which this connection was not granted",
                {"op": op, "capability": str(capability), "granted": sorted(self.capabilities)},
            )

    async def perform(
        self, op: str, payload: Mapping[str, Any], *, live: LiveCommand | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Run one operation; return ``(response type, response payload)`` per the table of
        docs/shim-protocol.md#operations.

        ``live`` is the command's :class:`LiveCommand` when ``op`` is ``EXECUTE_COMMAND``
        and the caller wants to cancel it or feed it (see :meth:`live_command`).
        The payload is checked once, here, against the operation's model
        (``payloads.payload_of``). Raises ``ShimError`` with a protocol error code for every
        refusal and failure.
        """
        self.check_allowed(op)
        response_type = OPERATIONS[op][0]
        if op == MessageType.EXECUTE_COMMAND:
            return response_type, await self.execute_command(payload_of(ExecuteCommand, payload), live=live)
        model = PAYLOADS.get(op)
        return response_type, await self._handlers[op](payload if model is None else payload_of(model, payload))

    def live_command(self, payload: Mapping[str, Any] | LiveFields, send: FrameSender | None = None) -> LiveCommand:
        """The :class:`LiveCommand` of an ``EXECUTE_COMMAND`` with this ``payload``, for
        ``CANCEL``/``FLOW``/``COMMAND_INPUT`` to reach it while it runs.

        Checks the 2.1 fields: ``stream``, ``binary``, ``pipe`` booleans, ``stdin``
        ``"null"`` or ``"stream"`` (else ``INVALID_REQUEST``); asking any of them on a
        connection negotiated below 2.1 is ``UNSUPPORTED_OPERATION`` (details:
        ``protocol_version``, ``required_version``, ``fields``). ``send`` sends its
        ``COMMAND_OUTPUT`` and stdin ``FLOW`` frames.
        """
        fields = payload if isinstance(payload, LiveFields) else payload_of(LiveFields, payload)
        options = CommandOptions(
            stream=fields.stream, binary=fields.binary, stdin_stream=fields.stdin == "stream", pipe=fields.pipe
        )
        asked = options.live_fields
        if asked and not supports_live_operations(self.protocol_version):
            raise ShimError(
                ErrorCode.UNSUPPORTED_OPERATION,
                f"this connection negotiated shim protocol {self.protocol_version}; "
                f"{', '.join(asked)} need{'s' if len(asked) == 1 else ''} protocol 2.1 "
                f"(this shim speaks {PROTOCOL_VERSION})",
                {"protocol_version": self.protocol_version, "required_version": "2.1", "fields": asked},
            )
        limits = self.limits
        return LiveCommand(
            options, window=limits.stream_window_bytes, max_stream_bytes=limits.max_stream_bytes, send=send
        )

    # -- operations ---------------------------------------------------------------------

    async def ping(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """PING → PONG ``{}``."""
        return {}

    async def machine_list(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """MACHINE_LIST_REQUEST → ``{machine_id, hostname, display_name, platform, arch,
        capabilities (granted, sorted), hardware_devices}``."""
        identity = self.identity
        return {
            "machine_id": identity.machine_id,
            "hostname": identity.hostname,
            "display_name": identity.display_name,
            "platform": identity.platform,
            "arch": identity.arch,
            "capabilities": sorted(self.capabilities),
            "hardware_devices": list(identity.hardware_devices),
        }

    async def file_read(self, request: FileRead) -> dict[str, Any]:
        """FILE_READ ``{path, encoding, offset?, length?}`` → FILE_CONTENTS ``{content,
        encoding, size_bytes (the whole file), offset, truncated}``.

        At most ``max_file_size_bytes`` are returned. A read without ``offset`` and
        ``length`` of a larger file fails ``FILE_TOO_LARGE``; ranged reads page through
        any size. ``truncated`` is true when bytes remain after the returned content. A
        utf-8 read ending inside a multi-byte character leaves that character for the next
        page (so the bytes returned are ``len(content.encode())``); bytes that are not
        UTF-8 fail ``ENCODING_ERROR``. Also ``IS_A_DIRECTORY``, ``PATH_NOT_FOUND``,
        ``INVALID_REQUEST`` (not a regular file, bad fields).
        """
        jailed = self.jail.check(request.path)
        return await asyncio.to_thread(
            files.read_file, jailed, request.encoding, request.offset, request.length, self.limits.max_file_size_bytes
        )

    async def file_write(self, request: FileWrite) -> dict[str, Any]:
        """FILE_WRITE ``{path, content, encoding, create_parents?, append?}`` → ACK
        ``{size_bytes_written}``.

        Errors: ``FILE_TOO_LARGE`` (decoded content over ``max_file_size_bytes``),
        ``INVALID_REQUEST`` (bad base64, bad fields), ``PATH_NOT_FOUND`` (no parent
        directory and no ``create_parents``), ``IS_A_DIRECTORY``, ``PERMISSION_DENIED``.
        """
        content = request.content
        if request.encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError):
                raise ShimError(ErrorCode.INVALID_REQUEST, "'content' is not valid base64") from None
        else:
            data = content.encode("utf-8", "surrogatepass")
        limit = self.limits.max_file_size_bytes
        if len(data) > limit:
            raise ShimError(
                ErrorCode.FILE_TOO_LARGE,
                f"{len(data)} bytes exceed the {limit}-byte limit; write in appended chunks",
                {"size_bytes": len(data), "max_file_size_bytes": limit},
            )
        jailed = self.jail.check_write(request.path)
        return await asyncio.to_thread(files.write_file, jailed, data, request.create_parents, request.append)

    async def file_stat(self, request: FileStat) -> dict[str, Any]:
        """FILE_STAT ``{path, hash?}`` → FILE_STAT_RESPONSE ``{exists, is_file, is_dir,
        is_symlink, size_bytes, mtime, mode, sha256?}``.

        A missing path is ``exists: false`` (``size_bytes``, ``mtime``, ``mode`` null), not
        an error. ``mtime`` is seconds since the epoch; ``mode`` the permission bits as an
        int (0o644 → 420). ``sha256`` (hex; null for a non-file) only when ``hash: true``,
        computed streaming.
        """
        jailed = self.jail.check(request.path)
        return await cancellable(files.stat_path, jailed, request.hash)

    async def file_list(self, request: FileList) -> dict[str, Any]:
        """FILE_LIST ``{path, glob?, recursive?, include_hidden?, max_entries? (1000)}`` →
        FILE_LIST_RESPONSE ``{entries: [{name, path, is_dir, size_bytes, mtime}], truncated}``.

        Entries are sorted by name within each directory, depth first; ``path`` is
        absolute (resolved). ``glob`` matches the name, or the path relative to the listed
        directory when it contains ``/``. Hidden names (leading ``.``) are skipped unless
        ``include_hidden``. Symlinks that resolve outside the allowed roots are left out,
        and symlinked directories are listed but not descended into. ``truncated`` is true
        when more than ``max_entries`` (1…100000) matched. Errors: ``PATH_NOT_FOUND``,
        ``INVALID_REQUEST`` (not a directory, bad fields), ``PERMISSION_DENIED``.
        """
        jailed = self.jail.check(request.path)
        listing = files.Listing(
            jail=self.jail,
            pattern=request.glob,
            recursive=request.recursive,
            include_hidden=request.include_hidden,
            max_entries=request.max_entries or DEFAULT_LIST_ENTRIES,
        )
        return await cancellable(listing.run, jailed)

    async def file_delete(self, request: FileDelete) -> dict[str, Any]:
        """FILE_DELETE ``{path, recursive?, missing_ok?}`` → ACK ``{}``.

        A symlink is removed, never its target. Errors: ``PATH_NOT_FOUND`` (unless
        ``missing_ok``), ``PATH_NOT_EMPTY`` (a non-empty directory without
        ``recursive``), ``PERMISSION_DENIED``. An allowed root itself cannot be deleted
        (its parent is outside the roots: ``PATH_OUTSIDE_ALLOWED_ROOT``).
        """
        jailed = self.jail.check_write(request.path)
        await asyncio.to_thread(files.delete_path, jailed, request.recursive, request.missing_ok)
        return {}

    async def file_move(self, request: FileMove) -> dict[str, Any]:
        """FILE_MOVE ``{src, dst, overwrite?}`` → ACK ``{}``.

        Both ends follow the write rules of the jail. ``dst`` is the new path (not a
        directory to move into). Errors: ``PATH_NOT_FOUND`` (no ``src``, or no parent
        directory of ``dst``), ``PATH_EXISTS`` (``dst`` exists and not ``overwrite``),
        ``IS_A_DIRECTORY`` / ``PATH_NOT_EMPTY`` (what ``rename`` refuses with
        ``overwrite``), ``INVALID_REQUEST`` (a directory into itself), ``PERMISSION_DENIED``.
        """
        source = self.jail.check_write(request.src, "src")
        destination = self.jail.check_write(request.dst, "dst")
        await asyncio.to_thread(files.move_path, source, destination, request.overwrite)
        return {}

    async def execute_command(self, request: ExecuteCommand, live: LiveCommand | None = None) -> dict[str, Any]:
        """EXECUTE_COMMAND ``{argv | command, cwd?, timeout_seconds?, env?, stream?, binary?,
        stdin?, pipe?}`` → COMMAND_RESULT ``{stdout, stderr, exit_code, timed_out,
        duration_seconds, output_truncated, cancelled}`` (``cancelled`` and the streaming fields: 2.1).

        ``argv`` runs without a shell, ``command`` through ``<shell> -c``. The process
        starts in its own session (so its own process group) in ``cwd`` (default: the
        first root; must be inside a root), with stdin from /dev/null (a pipe fed by
        ``COMMAND_INPUT`` with ``stdin: "stream"``) and ``env`` merged over
        :func:`safe_environment`. ``timeout_seconds`` defaults to
        ``command_timeout_seconds`` and may be up to ``max_command_timeout_seconds``; when
        it runs out (or the operation is cancelled) the whole group gets SIGKILL and the
        result is ``timed_out: true, exit_code: -1``. stdout + stderr together keep at
        most ``max_file_size_bytes`` (``output_truncated``), decoded as UTF-8 with
        replacement. A process killed by a signal has ``exit_code`` −signal.
        With ``stream: true`` the output goes out as ``COMMAND_OUTPUT`` frames instead (see
        :mod:`machines.shim.live`) and the result has ``stdout``/``stderr`` ``""`` plus
        ``stdout_bytes``, ``stderr_bytes`` and ``stream_truncated``. ``cancelled`` says a
        ``CANCEL`` stopped it (``exit_code`` then −SIGTERM, or −SIGKILL after the grace).
        ``live`` carries the command's cancel/credit/stdin state (default: a fresh one
        from :meth:`live_command`, whose frames go nowhere).
        Errors: ``INVALID_REQUEST``, ``UNSUPPORTED_OPERATION`` (a 2.1 field on a 2.0
        connection), ``PATH_NOT_FOUND`` (no such program or cwd), ``PERMISSION_DENIED``,
        ``PATH_OUTSIDE_ALLOWED_ROOT`` (cwd), ``CANCELLED`` (cancelled before its process
        started: nothing ran).
        """
        args = self._command_args(request)
        timeout = self._command_timeout(request)
        environment = safe_environment(self.shell) | _environment(request.env)
        if live is None:
            live = self.live_command(request)
        cwd = self.jail.check(request.cwd or self.jail.roots[0], "cwd")
        await asyncio.to_thread(files.require_directory, cwd)
        if live.cancelled:
            raise ShimError(ErrorCode.CANCELLED, "the command was cancelled before it started; nothing ran")
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        # What create_subprocess_exec does, keeping the transport so that it can be closed
        # even when a process that left the group still holds the pipes.
        spawn = asyncio.ensure_future(
            loop.subprocess_exec(
                lambda: asyncio.subprocess.SubprocessStreamProtocol(limit=PIPE_CHUNK, loop=loop),
                *args,
                cwd=cwd.real,
                env=environment,
                stdin=asyncio.subprocess.PIPE if live.options.stdin_stream else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        )
        try:
            transport, protocol = await asyncio.shield(spawn)
        except OSError as error:
            raise os_error(error, args[0]) from None
        except asyncio.CancelledError:
            # Cancelled (the connection went away) while the process was starting: asyncio
            # would kill only its leader, and wait for children that hold the pipes. Let
            # it start, then kill its whole group.
            with contextlib.suppress(OSError):
                started_transport, _ = await spawn
                kill_group(started_transport.get_pid())
                started_transport.close()
            raise
        process = asyncio.subprocess.Process(transport, protocol, loop)
        GUARDIAN.watch(process.pid)  # killed by the guardian if this shim dies without cleanup
        try:
            return await live.run(
                process, transport, timeout=timeout, output_limit=self.limits.max_file_size_bytes, started=started
            )
        finally:
            GUARDIAN.forget(process.pid)

    def _command_args(self, request: ExecuteCommand) -> list[str]:
        # payload_of checked the types; what a schema cannot say is checked here.
        argv, command = request.argv, request.command
        if argv is not None and command is None:
            if not all("\x00" not in part for part in argv) or not argv[0]:
                raise ShimError(
                    ErrorCode.INVALID_REQUEST,
                    "'argv' must be a non-empty list of strings without NUL bytes",
                )
            return list(argv)
        if command is None or argv is not None:
            raise ShimError(ErrorCode.INVALID_REQUEST, "give exactly one of 'argv' and 'command'")
        if not command.strip() or "\x00" in command:
            raise ShimError(ErrorCode.INVALID_REQUEST, "'command' must be a non-empty string without NUL bytes")
        return [self.shell, "-c", command]

    def _command_timeout(self, request: ExecuteCommand) -> float:
        timeout = request.timeout_seconds
        if timeout is None:
            return float(self.limits.command_timeout_seconds)
        ceiling = self.limits.max_command_timeout_seconds  # this shim's, maybe below the model's
        if not timeout <= ceiling:
            raise ShimError(
                ErrorCode.INVALID_REQUEST,
                f"'timeout_seconds' must be a number above 0 and at most {ceiling}",
                {"max_command_timeout_seconds": ceiling},
            )
        return float(timeout)


def safe_environment(shell: str) -> dict[str, str]:
    """The minimal environment commands start from: ``PATH`` (the shim's, else the
    system default), ``HOME``, ``LANG`` (else ``C.UTF-8``), ``USER``, ``SHELL`` and
    ``TERM=dumb``. Nothing else of the shim's environment (tokens!) is passed on."""
    try:
        user = os.environ.get("USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        user = ""
    return {
        "PATH": os.environ.get("PATH") or _DEFAULT_PATH,
        "HOME": os.environ.get("HOME") or os.path.expanduser("~"),
        "LANG": os.environ.get("LANG") or "C.UTF-8",
        "USER": user,
        "SHELL": shell,
        "TERM": "dumb",
    }


# -- payload fields -------------------------------------------------------------------------


def _environment(env: dict[str, str] | None) -> dict[str, str]:
    if env is None:
        return {}
    if not all(
        isinstance(key, str) and key and "=" not in key and "\x00" not in key and "\x00" not in value
        for key, value in env.items()
    ):
        raise ShimError(
            ErrorCode.INVALID_REQUEST,
            "'env' must map names (no '=' or NUL) to strings (no NUL)",
        )
    return dict(env)


__all__ = [
    "Capability",
    "MachineIdentity",
    "Operations",
    "normalized_arch",
    "normalized_platform",
    "os_error",
    "safe_environment",
]
