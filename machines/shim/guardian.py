"""The guardian: a shim that dies without cleaning up still leaves no command running.

A command runs in its own session (so its own process group) and the shim kills that
group when the command times out, is cancelled, or the connection drops. A shim killed
with SIGKILL (or by the OOM killer, or a crash in the interpreter) runs no cleanup at all,
and a command that prints nothing (``sleep 300``) would then run on as an orphan — while
the platform has already told the caller ``MACHINE_UNREACHABLE``. Nothing may be left
running after a SIGKILLed shim (docs/live-operations.md#when-a-command-ends).

So the shim keeps one small helper process, the guardian (standard library only, started
with the shim's own interpreter on the first command), and tells it over a pipe which
process groups are running (``+<pgid>`` when a command starts, ``-<pgid>`` when it has
ended). The guardian only reads that pipe; when it reads end-of-file — the shim is gone,
however it died, since the kernel closes a dead process's descriptors — it sends SIGKILL
to every group still listed, and exits. It runs in its own session, so a Ctrl-C in the
shim's terminal does not reach it (the shim stops gracefully and kills its commands
itself; the guardian then finds nothing left to kill).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)

GUARDIAN_SOURCE = """
import os, signal, sys
for number in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(number, signal.SIG_IGN)
groups = set()
for line in sys.stdin.buffer:
    line = line.strip()
    try:
        group = int(line[1:])
    except ValueError:
        continue
    if line[:1] == b"+":
        groups.add(group)
    elif line[:1] == b"-":
        groups.discard(group)
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""
"""The guardian program (``python -c``): reads ``+pgid``/``-pgid`` lines until end-of-file,
then SIGKILLs the groups still listed."""


class Guardian:
    """The shim's link to its guardian process (started on first use, restarted if it died).

    ``watch(pgid)`` when a command's process group starts, ``forget(pgid)`` once it has
    ended. Both are a short write to a pipe and never raise: without a guardian the shim
    still kills its groups itself on every exit it lives through (logged once).
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._groups: set[int] = set()  # what a restarted guardian is told again

    def watch(self, pgid: int) -> None:
        """The process group ``pgid`` (a command's session leader's pid) is running."""
        self._groups.add(pgid)
        self._send(b"+%d\n" % pgid)

    def forget(self, pgid: int) -> None:
        """The process group ``pgid`` has ended (or was killed by the shim itself)."""
        self._groups.discard(pgid)
        self._send(b"-%d\n" % pgid, start=False)

    @property
    def pid(self) -> int | None:
        """The guardian's pid, or ``None`` before it started (for tests and ``status``)."""
        return None if self._process is None else self._process.pid

    def _send(self, line: bytes, *, start: bool = True) -> None:
        with self._lock:
            for _attempt in range(2):
                process = self._process
                if process is None or process.poll() is not None:
                    if not start:
                        return  # a new guardian has nothing to forget
                    process = self._start()
                    if process is None:
                        return
                    line = b"".join(b"+%d\n" % group for group in sorted(self._groups)) or line
                assert process.stdin is not None
                try:
                    process.stdin.write(line)
                    process.stdin.flush()
                    return
                except OSError:
                    self._process = None  # it died: start another, told every group again

    def _start(self) -> subprocess.Popen[bytes] | None:
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-c", GUARDIAN_SOURCE],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as error:
            if not self._warned:
                self._warned = True
                logger.warning("could not start the command guardian (%s): commands may outlive a killed shim", error)
            self._process = None
        return self._process


GUARDIAN = Guardian()
"""This shim process's guardian (one per process, shared by every connection in it)."""

__all__ = ["GUARDIAN", "GUARDIAN_SOURCE", "Guardian"]
