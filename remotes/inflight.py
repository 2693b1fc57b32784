"""Remote calls in flight in this process, and the caps that bound the memory they hold.

A call's arguments stay in the caller's process until the remote answers or the call times
out (up to 300 s). Without a bound, one session could make hundreds of 1 MB calls to a
remote that never answers and hold hundreds of MB. So every call is admitted here first,
counted by the caller's session (a ``/ws`` session), by its user and by the whole process,
in calls and in bytes (docs/operating.md#bounds):

- ``DISPATCH_REMOTE_CALLS_PER_SESSION`` / ``DISPATCH_REMOTE_CALL_BYTES_PER_SESSION``
  (64, 64 MiB);
- ``DISPATCH_REMOTE_CALLS_PER_USER`` / ``DISPATCH_REMOTE_CALL_BYTES_PER_USER``
  (256, 256 MiB) — within one process: memory is per process, and a user's calls made
  through another process are that process's memory;
- ``DISPATCH_REMOTE_CALL_BYTES_PER_PROCESS`` (1 GiB).

A call over a cap is refused at once (``RATE_LIMITED``), nothing is queued. The ledger is
deliberately per process and in memory: it counts this process's memory, not a registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from core.errors import DispatchError

MIB = 1024 * 1024
SESSION = "for this session"


class CallRefused(DispatchError):
    """A remote call refused before it was sent: a cap on calls in flight is reached
    (``RATE_LIMITED``, HTTP 429)."""

    def __init__(self, message: str) -> None:
        super().__init__("RATE_LIMITED", message)


@dataclass
class _Count:
    calls: int = 0
    bytes: int = 0


class CallsInFlight:
    """Counts of the calls in flight by session, by user and in all (one per process).

    Used through ``admit()``; every count comes back to zero when its calls end (entries
    at zero are removed, so the ledger's own size follows the calls in flight).
    """

    def __init__(self) -> None:
        self._sessions: dict[str, _Count] = {}
        self._users: dict[int, _Count] = {}
        self._process = _Count()

    def admit(self, *, user_id: int, session: str | None, size: int) -> Admission:
        """Count one call of ``size`` bytes (its encoded arguments) for its ``session``
        (``None``: a caller without one — REST, MCP, an agent — counts for its user only),
        its user and the process, until the returned ``Admission`` is released (use it as
        a ``with`` block around the call).

        Raises ``CallRefused`` when the call would pass a cap, naming the cap's setting;
        nothing is counted then.
        """
        sessions = self._sessions.get(session) if session is not None else None
        _check(
            sessions,
            size,
            calls=settings.REMOTE_CALLS_PER_SESSION,
            bytes_cap=settings.REMOTE_CALL_BYTES_PER_SESSION,
            where=SESSION,
            names=("DISPATCH_REMOTE_CALLS_PER_SESSION", "DISPATCH_REMOTE_CALL_BYTES_PER_SESSION"),
        )
        _check(
            self._users.get(user_id),
            size,
            calls=settings.REMOTE_CALLS_PER_USER,
            bytes_cap=settings.REMOTE_CALL_BYTES_PER_USER,
            where="for this user in this process",
            names=("DISPATCH_REMOTE_CALLS_PER_USER", "DISPATCH_REMOTE_CALL_BYTES_PER_USER"),
        )
        _check(
            self._process,
            size,
            calls=None,
            bytes_cap=settings.REMOTE_CALL_BYTES_PER_PROCESS,
            where="in this process",
            names=("", "DISPATCH_REMOTE_CALL_BYTES_PER_PROCESS"),
        )
        admission = Admission(self, user_id=user_id, session=session, size=size)
        for count in admission.counts:
            count.calls += 1
            count.bytes += size
        return admission

    def _release(self, admission: Admission) -> None:
        for count in admission.counts:
            count.calls -= 1
            count.bytes -= admission.size
        if admission.user_id in self._users and self._users[admission.user_id].calls <= 0:
            del self._users[admission.user_id]
        session = admission.session
        if session is not None and session in self._sessions and self._sessions[session].calls <= 0:
            del self._sessions[session]

    def counts(self, *, user_id: int | None = None, session: str | None = None) -> tuple[int, int]:
        """``(calls, bytes)`` in flight for a session, else a user, else the whole process."""
        if session is not None:
            count = self._sessions.get(session, _Count())
        elif user_id is not None:
            count = self._users.get(user_id, _Count())
        else:
            count = self._process
        return count.calls, count.bytes


class Admission:
    """One admitted call: released (once) by leaving its ``with`` block or ``release()``."""

    def __init__(self, ledger: CallsInFlight, *, user_id: int, session: str | None, size: int) -> None:
        self.ledger = ledger
        self.user_id = user_id
        self.session = session
        self.size = size
        self.counts = [ledger._process, ledger._users.setdefault(user_id, _Count())]
        if session is not None:
            self.counts.append(ledger._sessions.setdefault(session, _Count()))
        self._released = False

    def release(self) -> None:
        """Uncount the call (a second call does nothing)."""
        if not self._released:
            self._released = True
            self.ledger._release(self)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def too_many_calls(calls: int, where: str, setting: str) -> str:
    """The refusal of a call over a cap of ``calls`` calls in flight ``where``."""
    return f"remote call refused: {calls} calls already in flight {where} ({setting})"


def session_calls_refusal(in_flight: int) -> str | None:
    """The refusal for a session with ``in_flight`` calls running (counted by the session
    itself, before their arguments are even checked), or ``None`` while under the cap."""
    cap = settings.REMOTE_CALLS_PER_SESSION
    if in_flight < cap:
        return None
    return too_many_calls(cap, SESSION, "DISPATCH_REMOTE_CALLS_PER_SESSION")


def _check(
    count: _Count | None,
    size: int,
    *,
    calls: int | None,
    bytes_cap: int,
    where: str,
    names: tuple[str, str],
) -> None:
    """Raise ``CallRefused`` when one more call of ``size`` bytes would pass a cap."""
    in_flight = count or _Count()
    if calls is not None and in_flight.calls >= calls:
        raise CallRefused(too_many_calls(calls, where, names[0]))
    if in_flight.bytes + size > bytes_cap:
        raise CallRefused(
            f"remote call refused: {_mib(in_flight.bytes)} of arguments already in flight {where}, "
            f"and this call's {_mib(size)} would pass {_mib(bytes_cap)} ({names[1]})"
        )


def _mib(size: int) -> str:
    """``size`` bytes for a person: MiB, KiB or bytes."""
    if size >= MIB:
        return f"{size / MIB:.1f} MiB"
    if size >= 1024:
        return f"{size / 1024:.1f} KiB"
    return f"{size} bytes"


CALLS_IN_FLIGHT = CallsInFlight()
"""This process's ledger (``remotes.services.remote_call`` admits every call through it)."""
