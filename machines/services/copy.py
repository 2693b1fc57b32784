"""Cross-machine copy through the platform, in constant memory (docs/shim-protocol.md#cross-machine-copy).

``FILE_READ`` in 1 MiB chunks (base64, ``offset``/``length``) on the source, ``FILE_WRITE``
with ``append`` into ``<destination>.dispatch-partial`` on the destination (the first
chunk without) — pipelined: chunk n+1 is read while chunk n is written, at most two
chunks held — then ``FILE_STAT {hash: true}`` on both ends; only when size and SHA-256
match is the partial file moved into place (``FILE_MOVE``, replacing an existing
destination only with ``overwrite``). A failed copy removes the partial file.

A copy is an operation in flight (an ``OperationInFlight`` row of kind ``copy``,
under its ``request_id``), reports progress after each chunk, and can be cancelled from
any process (``machines.services.live.cancel_operation`` sends ``OperationCancelMessage``
to the copy's own channel): it stops between chunks, removes the partial file and fails
``CANCELLED``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.models import User

from core.errors import DispatchError
from core.realtime import Subscription
from machines.models import OperationInFlight
from machines.protocol import OperationCancelMessage
from machines.services import router
from machines.services.arguments import check_request_id, check_session_id
from machines.services.errors import MachineError
from machines.services.inflight import current_call_key, inflight_create, inflight_delete
from machines.services.operations import machine_op
from machines.services.router import Candidate

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
PARTIAL_SUFFIX = ".dispatch-partial"
BUSY_PATIENCE = 60.0  # seconds a copy waits for a busy machine (MACHINE_BUSY) before it fails
BUSY_RETRY_SECONDS = 0.2  # between two tries of a step refused busy
Progress = Callable[[int, int], Awaitable[None] | None]


async def copy_between_machines(
    *,
    user: User,
    session_id: str,
    source_machine: str,
    source_path: str,
    destination_machine: str,
    destination_path: str,
    overwrite: bool = False,
    caller: str,
    request_id: str | None = None,
    on_progress: Progress | None = None,
    progress: Progress | None = None,
    on_started: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Copy a file from one machine to another; returns ``{"size_bytes", "sha256"}``.

    ``on_progress(bytes_done, bytes_total)`` (bytes; it may be async) is called after each
    chunk; ``progress`` is its older name; ``on_started()`` once both machines are chosen and
    the copy is in flight (errors before it are the request's own). ``request_id`` (a UUID; a fresh one unless
    given) names the copy in flight: ``cancel_operation`` stops it between chunks.
    Raises ``InvalidRequest`` (a malformed ``request_id`` or session id) and
    ``MachineError``: routing errors (``MACHINE_NOT_ATTACHED``, …), ``OPERATION_EXISTS``
    (``request_id`` in flight), the source's or destination's own errors
    (``PATH_NOT_FOUND``, ``PATH_EXISTS`` when the destination exists without ``overwrite``,
    …), ``MACHINE_BUSY`` when a machine has not read what it was sent for ``BUSY_PATIENCE``
    seconds (until then the copy pauses, reading no more), ``COPY_VERIFICATION_FAILED``
    when sizes or hashes differ, ``CANCELLED`` (the partial file removed).
    """
    check_session_id(session_id)
    request_id = check_request_id(request_id)
    source_candidate, destination_candidate = await _route(
        user=user, session_id=session_id, source_machine=source_machine, destination_machine=destination_machine
    )
    async with Subscription(receives=[OperationCancelMessage]) as cancels:
        copy = _Copy(
            user=user,
            session_id=session_id,
            caller=caller,
            request_id=request_id,
            cancels=cancels,
            source_machine=source_candidate.machine_id,
            source_path=source_path,
            destination_machine=destination_candidate.machine_id,
            destination_path=destination_path,
            overwrite=overwrite,
            progress=on_progress or progress,
        )
        row_id = await copy.register(source_candidate, destination_candidate)
        try:
            if on_started is not None:
                on_started()
            return await copy.run()
        finally:
            await database_sync_to_async(inflight_delete)(row_id=row_id)


async def _route(
    *, user: User, session_id: str, source_machine: str, destination_machine: str
) -> tuple[Candidate, Candidate]:
    """The source machine (one that may ``FILE_READ``) and the destination (``FILE_WRITE``);
    a routing error as a ``MachineError``."""
    try:
        source_candidate = await database_sync_to_async(router.choose)(
            user=user, session_id=session_id, op="FILE_READ", payload={}, target_machine=source_machine
        )
        destination_candidate = await database_sync_to_async(router.choose)(
            user=user, session_id=session_id, op="FILE_WRITE", payload={}, target_machine=destination_machine
        )
    except DispatchError as exc:
        raise MachineError(exc.code, exc.message, exc.details) from None
    return source_candidate, destination_candidate


@dataclass
class _Copy:
    """The copy itself (see ``copy_between_machines``), between two chosen machines; each
    step is audited under the copy's ``request_id`` (one row on the Machines page)."""

    user: User
    session_id: str
    caller: str
    request_id: str
    cancels: Subscription
    source_machine: str
    source_path: str
    destination_machine: str
    destination_path: str
    overwrite: bool
    progress: Progress | None
    reading: asyncio.Task[dict[str, Any]] | None = None  # the next chunk's read, while one is written

    @property
    def partial(self) -> str:
        return self.destination_path + PARTIAL_SUFFIX

    async def run(self) -> dict[str, Any]:
        """Check both ends, move the chunks into the partial file, verify it and move it in
        place; on any failure the partial file is removed."""
        total = await self.checked()
        try:
            await self.transfer(total)
            source_final = await self.verified()
            await self.op(
                self.destination_machine,
                "FILE_MOVE",
                {"src": self.partial, "dst": self.destination_path, "overwrite": self.overwrite},
            )
        except BaseException:
            await self.clean_up()
            raise
        return {"size_bytes": source_final.get("size_bytes"), "sha256": source_final.get("sha256")}

    async def register(self, source: Candidate, destination: Candidate) -> int:
        """The copy's in-flight row (kind ``copy``), which ``cancel_operation`` takes; its id."""
        return await database_sync_to_async(inflight_create)(
            user=self.user,
            session_id=self.session_id,
            request_id=self.request_id,
            kind=OperationInFlight.Kind.COPY,
            op="COPY",
            candidates=[source, destination],
            caller=self.caller,
            summary=f"{source.name}:{self.source_path} → {destination.name}:{self.destination_path}",
            call_key=current_call_key(),
            caller_channel=self.cancels.channel or "",
        )

    async def check_cancelled(self) -> None:
        message = await self.cancels.wait(0)
        if isinstance(message, OperationCancelMessage):
            raise MachineError("CANCELLED", f"the copy was cancelled ({message.reason}); the partial file was removed")

    async def op(self, machine: str, name: str, payload: dict[str, Any]) -> dict[str, Any]:
        """One step (``machine_op``), tried again while the machine is busy, up to ``BUSY_PATIENCE``."""
        loop = asyncio.get_running_loop()
        patience = loop.time() + BUSY_PATIENCE
        while True:
            try:
                response = await machine_op(
                    user=self.user,
                    session_id=self.session_id,
                    op=name,
                    payload=payload,
                    target_machine=machine,
                    caller=self.caller,
                    operation_id=self.request_id,
                )
                break
            except MachineError as exc:
                # Not sent: the machine has not read what it was sent. The copy waits here,
                # reading no more of the source, until it drains (docs/live-operations.md#back-pressure).
                if exc.code != "MACHINE_BUSY" or loop.time() >= patience:
                    raise
            await asyncio.sleep(BUSY_RETRY_SECONDS)
            await self.check_cancelled()
        result: dict[str, Any] = response["payload"]
        return result

    async def checked(self) -> int:
        """The source's size; the source a regular file, the destination absent unless ``overwrite``."""
        source = await self.op(self.source_machine, "FILE_STAT", {"path": self.source_path})
        if not source.get("exists"):
            raise MachineError("PATH_NOT_FOUND", f"{self.source_path} does not exist on '{self.source_machine}'")
        if not source.get("is_file"):
            raise MachineError("IS_A_DIRECTORY", f"{self.source_path} is not a regular file")
        total = int(source.get("size_bytes") or 0)
        if not self.overwrite:
            existing = await self.op(self.destination_machine, "FILE_STAT", {"path": self.destination_path})
            if existing.get("exists"):
                raise MachineError(
                    "PATH_EXISTS", f"{self.destination_path} exists on '{self.destination_machine}' (pass overwrite)"
                )
        return total

    def read(self, offset: int) -> asyncio.Task[dict[str, Any]]:
        return asyncio.ensure_future(
            self.op(
                self.source_machine,
                "FILE_READ",
                {"path": self.source_path, "encoding": "base64", "offset": offset, "length": CHUNK_BYTES},
            )
        )

    async def transfer(self, total: int) -> None:
        """The chunks, read from the source and written to the partial file."""
        # Pipelined (bench B5, bench/README.md): chunk n+1 is read while chunk n is written, so the source's
        # read and the destination's write overlap; at most two chunks are held (the one being
        # written and the one being read), whatever the file's size.
        offset = 0
        first = True
        self.reading = self.read(0)
        while self.reading is not None:
            chunk = await self.reading
            self.reading = None
            read_bytes = _chunk_length(chunk)
            if read_bytes > 0 and offset + read_bytes < total:
                self.reading = self.read(offset + read_bytes)  # the next chunk, while this one is written
            await self.op(
                self.destination_machine,
                "FILE_WRITE",
                {
                    "path": self.partial,
                    "content": chunk["content"],
                    "encoding": "base64",
                    "append": not first,
                    "create_parents": first,
                },
            )
            del chunk
            first = False
            offset += read_bytes
            await self.report(offset, total)
            if read_bytes > 0:
                await self.check_cancelled()

    async def report(self, done: int, total: int) -> None:
        if self.progress is not None:
            outcome = self.progress(done, total)
            if outcome is not None:
                await outcome

    async def verified(self) -> dict[str, Any]:
        """The source's final ``FILE_STAT`` (with its hash), once the copy matches it."""
        source_final = await self.op(self.source_machine, "FILE_STAT", {"path": self.source_path, "hash": True})
        copied = await self.op(self.destination_machine, "FILE_STAT", {"path": self.partial, "hash": True})
        if (copied.get("size_bytes"), copied.get("sha256")) != (
            source_final.get("size_bytes"),
            source_final.get("sha256"),
        ):
            raise MachineError(
                "COPY_VERIFICATION_FAILED",
                "the copy does not match the source (size or SHA-256 differ); the source may have changed",
                {
                    "source": {"size_bytes": source_final.get("size_bytes"), "sha256": source_final.get("sha256")},
                    "copy": {"size_bytes": copied.get("size_bytes"), "sha256": copied.get("sha256")},
                },
            )
        return source_final

    async def clean_up(self) -> None:
        """After a failure: the read in flight stopped, the partial file removed (a failure logged)."""
        if self.reading is not None:  # a read in flight when the write (or the cancel) failed
            self.reading.cancel()
            await asyncio.gather(self.reading, return_exceptions=True)
        try:
            await self.op(self.destination_machine, "FILE_DELETE", {"path": self.partial, "missing_ok": True})
        except Exception:
            logger.warning("could not remove %s on %s after a failed copy", self.partial, self.destination_machine)


def _chunk_length(chunk: dict[str, Any]) -> int:
    """The number of bytes a base64 ``FILE_CONTENTS`` chunk holds.

    Counted from the content itself: ``size_bytes`` is the whole file's size (the shim
    reports it so), and a shim with a lower ``max_file_size_bytes`` returns less than asked.
    """
    content = chunk.get("content")
    try:
        if not isinstance(content, str):
            raise ValueError("no content")
        return len(base64.b64decode(content, validate=True))
    except (binascii.Error, ValueError):
        raise MachineError("INVALID_RESPONSE", "the source machine sent a chunk that is not base64") from None
