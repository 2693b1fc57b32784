"""Cross-machine copy through the platform, in constant memory (machines.md §6).

``FILE_READ`` in 1 MiB chunks (base64, ``offset``/``length``) on the source, ``FILE_WRITE``
with ``append`` into ``<destination>.dispatch-partial`` on the destination (the first
chunk without), then ``FILE_STAT {hash: true}`` on both ends; only when size and SHA-256
match is the partial file moved into place (``FILE_MOVE``, replacing an existing
destination only with ``overwrite``). A failed copy removes the partial file.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from django.contrib.auth.models import User

from machines.services.operations import MachineError, machine_op

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
PARTIAL_SUFFIX = ".dispatch-partial"
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
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Copy a file from one machine to another; returns ``{"size_bytes", "sha256"}``.

    ``progress(copied_bytes, total_bytes)`` is called after each chunk (it may be async).
    Raises ``MachineError``: the source's or destination's own errors (``PATH_NOT_FOUND``,
    ``PATH_EXISTS`` when the destination exists without ``overwrite``, …), routing errors,
    or ``COPY_VERIFICATION_FAILED`` when sizes or hashes differ.
    """

    async def op(machine: str, name: str, payload: dict[str, Any]) -> dict[str, Any]:
        response = await machine_op(
            user=user, session_id=session_id, op=name, payload=payload, target_machine=machine, caller=caller
        )
        result: dict[str, Any] = response["payload"]
        return result

    source = await op(source_machine, "FILE_STAT", {"path": source_path})
    if not source.get("exists"):
        raise MachineError("PATH_NOT_FOUND", f"{source_path} does not exist on '{source_machine}'")
    if not source.get("is_file"):
        raise MachineError("IS_A_DIRECTORY", f"{source_path} is not a regular file")
    total = int(source.get("size_bytes") or 0)
    if not overwrite:
        existing = await op(destination_machine, "FILE_STAT", {"path": destination_path})
        if existing.get("exists"):
            raise MachineError("PATH_EXISTS", f"{destination_path} exists on '{destination_machine}' (pass overwrite)")
    partial = destination_path + PARTIAL_SUFFIX
    try:
        offset = 0
        first = True
        while first or offset < total:
            chunk = await op(
                source_machine,
                "FILE_READ",
                {"path": source_path, "encoding": "base64", "offset": offset, "length": CHUNK_BYTES},
            )
            await op(
                destination_machine,
                "FILE_WRITE",
                {
                    "path": partial,
                    "content": chunk["content"],
                    "encoding": "base64",
                    "append": not first,
                    "create_parents": first,
                },
            )
            read = _chunk_length(chunk)
            first = False
            offset += read
            if progress is not None:
                outcome = progress(offset, total)
                if outcome is not None:
                    await outcome
            if read == 0:
                break
        source_final = await op(source_machine, "FILE_STAT", {"path": source_path, "hash": True})
        copied = await op(destination_machine, "FILE_STAT", {"path": partial, "hash": True})
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
        await op(destination_machine, "FILE_MOVE", {"src": partial, "dst": destination_path, "overwrite": overwrite})
    except BaseException:
        try:
            await op(destination_machine, "FILE_DELETE", {"path": partial, "missing_ok": True})
        except Exception:
            logger.warning("could not remove %s on %s after a failed copy", partial, destination_machine)
        raise
    return {"size_bytes": source_final.get("size_bytes"), "sha256": source_final.get("sha256")}


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
