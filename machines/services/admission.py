"""Machine operations in flight in this process, and the caps that bound the memory they hold.

An operation's payload (a ``FILE_WRITE``'s content: up to 16 MiB) is held by the process
that made the call until the shim answers or the operation times out (the command's timeout
plus 10 s). Without a bound, one session could start hundreds of large writes to a machine
that never answers. So every operation is admitted here first, counted by its machine
session (``session_id`` of one user), by its user and by the whole process, in operations
and in payload bytes (docs/operating.md#bounds):

- ``DISPATCH_MACHINE_OPS_PER_SESSION`` / ``DISPATCH_MACHINE_OP_BYTES_PER_SESSION`` (64, 64 MiB);
- ``DISPATCH_MACHINE_OPS_PER_USER`` / ``DISPATCH_MACHINE_OP_BYTES_PER_USER`` (256, 256 MiB),
  within one process: memory is per process;
- ``DISPATCH_MACHINE_OP_BYTES_PER_PROCESS`` (1 GiB).

An operation over a cap is refused at once (``RATE_LIMITED``, HTTP 429), nothing is queued.
A streamed command or a pipe counts as one operation for as long as it runs (its output is
bounded by flow control, not here); a copy counts each chunk it moves. The ledger is per
process and in memory on purpose: it measures this process's memory, it is no registry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from core.errors import DispatchError

MIB = 1024 * 1024
SCALAR_BYTES = 16  # what a number, boolean or null counts for in a payload's size


class OperationRefused(DispatchError):
    """A machine operation refused before it was sent: a cap on operations in flight is
    reached (``RATE_LIMITED``, HTTP 429; ``details``: ``setting``, ``limit``, ``in_flight``)."""

    def __init__(self, message: str, details: dict[str, Any]) -> None:
        super().__init__("RATE_LIMITED", message, details)


@dataclass
class _Count:
    operations: int = 0
    bytes: int = 0


def payload_size(payload: Any) -> int:
    """What ``payload`` (a JSON value) holds, in bytes, counted without encoding it: each
    string's length in UTF-8 (its characters, plus the extra bytes of non-ASCII ones, which
    an ASCII string has none of), keys included, and ``SCALAR_BYTES`` per other value."""
    if isinstance(payload, str):
        return len(payload) if payload.isascii() else len(payload.encode("utf-8", "surrogatepass"))
    if isinstance(payload, Mapping):
        return sum(payload_size(str(key)) + payload_size(value) for key, value in payload.items())
    if isinstance(payload, Sequence) and not isinstance(payload, (bytes, bytearray)):
        return SCALAR_BYTES + sum(payload_size(item) for item in payload)
    if isinstance(payload, (bytes, bytearray)):
        return len(payload)
    return SCALAR_BYTES


class OperationsInFlight:
    """Counts of the machine operations in flight by session, by user and in all (one per
    process), used through ``admit()``; an entry whose count falls to zero is removed, so
    the ledger's own size follows the operations in flight."""

    def __init__(self) -> None:
        self._sessions: dict[tuple[int, str], _Count] = {}
        self._users: dict[int, _Count] = {}
        self._process = _Count()

    @contextmanager
    def admit(self, *, user_id: int, session_id: str, size: int) -> Iterator[None]:
        """Count one operation whose payload holds ``size`` bytes (``payload_size``) for
        ``user_id``'s machine session ``session_id`` and for the user while the ``with``
        block runs.

        Raises ``OperationRefused`` (naming the cap's setting) when it would pass a cap;
        the counts are then unchanged.
        """
        session_key = (user_id, session_id)
        _check(
            self._sessions.get(session_key),
            size,
            operations=("DISPATCH_MACHINE_OPS_PER_SESSION", settings.MACHINE_OPS_PER_SESSION),
            bytes_cap=("DISPATCH_MACHINE_OP_BYTES_PER_SESSION", settings.MACHINE_OP_BYTES_PER_SESSION),
            where=f"in session '{session_id}'",
        )
        _check(
            self._users.get(user_id),
            size,
            operations=("DISPATCH_MACHINE_OPS_PER_USER", settings.MACHINE_OPS_PER_USER),
            bytes_cap=("DISPATCH_MACHINE_OP_BYTES_PER_USER", settings.MACHINE_OP_BYTES_PER_USER),
            where="for this user in this server process",
        )
        _check(
            self._process,
            size,
            operations=None,
            bytes_cap=("DISPATCH_MACHINE_OP_BYTES_PER_PROCESS", settings.MACHINE_OP_BYTES_PER_PROCESS),
            where="in this server process",
        )
        counts = [
            self._process,
            self._users.setdefault(user_id, _Count()),
            self._sessions.setdefault(session_key, _Count()),
        ]
        for count in counts:
            count.operations += 1
            count.bytes += size
        try:
            yield
        finally:
            for count in counts:
                count.operations -= 1
                count.bytes -= size
            if counts[1].operations == 0:
                self._users.pop(user_id, None)
            if counts[2].operations == 0:
                self._sessions.pop(session_key, None)

    def counts(self, *, user_id: int | None = None, session_id: str | None = None) -> tuple[int, int]:
        """``(operations, bytes)`` in flight for ``user_id``'s session ``session_id``, else
        for ``user_id``, else for the whole process."""
        if user_id is not None and session_id is not None:
            count = self._sessions.get((user_id, session_id), _Count())
        elif user_id is not None:
            count = self._users.get(user_id, _Count())
        else:
            count = self._process
        return count.operations, count.bytes


def _check(
    count: _Count | None,
    size: int,
    *,
    operations: tuple[str, int] | None,
    bytes_cap: tuple[str, int],
    where: str,
) -> None:
    """Raise ``OperationRefused`` when one more operation of ``size`` bytes would pass a cap
    (each cap a ``(setting name, value)``)."""
    in_flight = count or _Count()
    if operations is not None and in_flight.operations >= operations[1]:
        name, limit = operations
        raise OperationRefused(
            f"machine operation refused: {limit} operations already in flight {where} ({name}); "
            "retry when some have ended",
            {"setting": name, "limit": limit, "in_flight": in_flight.operations},
        )
    name, limit = bytes_cap
    if in_flight.bytes + size > limit:
        raise OperationRefused(
            f"machine operation refused: {_mib(in_flight.bytes)} of payloads already in flight {where}, "
            f"and this operation's {_mib(size)} would pass {_mib(limit)} ({name}); retry when some have ended",
            {"setting": name, "limit": limit, "in_flight": in_flight.bytes, "size": size},
        )


def _mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"


OPERATIONS_IN_FLIGHT = OperationsInFlight()
"""This process's ledger (``operations.machine_op``, ``live.operation_stream`` and
``pipe.pipe`` admit every operation through it)."""
