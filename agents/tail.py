"""The output tail of the built-in agent's tool calls (docs/live-operations.md#the-built-in-agent).

While a tool call of an expert run streams a command's output, the run's timeline gets a
``system`` event with the last ``TAIL_LINES`` lines of it (at most ``TAIL_BYTES`` of
UTF-8), at most one such event per run every ``TAIL_INTERVAL`` seconds, so a long
``make test`` is visible as it runs without flooding the timeline.

``TailReporter`` (one per run) hands each tool call an ``OutputTail`` whose ``output``
and ``progress`` are the ``core.tools.ToolCall`` sinks of that call. ``output(stream,
text)`` receives the output chunks themselves (``machines.tools`` sends them when the
``ToolCall`` has ``output``); a tool that only reports ``progress(bytes, total,
latest_line)`` still gets a tail, made of the latest lines it reported. When several
calls of the run stream at once, the one whose tail waited longest goes first. What a
call printed after its last tail event is not reported once it has ended: its result
follows as the ``tool result`` event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

TAIL_INTERVAL = 2.0  # seconds between two tail events of one run, at least
TAIL_LINES = 20  # lines in a tail event, at most
TAIL_BYTES = 2048  # bytes of UTF-8 in a tail event's lines, at most
STREAMS = ("stdout", "stderr")

Record = Callable[[str, dict[str, Any]], Awaitable[None]]
"""``await record(message, metadata)``: write one ``system`` event of the run."""


def _last_bytes(text: str, limit: int) -> tuple[str, bool]:
    """The end of ``text`` within ``limit`` bytes of UTF-8 (never a split character),
    and whether anything was cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text, False
    return data[-limit:].decode("utf-8", "ignore"), True


def _visible(line: str) -> str:
    """A line as a terminal leaves it after carriage returns (a progress bar's last state)."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


class OutputTail:
    """The last lines of one tool call's output, in the order they arrived.

    Bounded: ``TAIL_LINES`` complete lines and, per stream, the line still being written
    (its last ``TAIL_BYTES`` bytes), whatever the command prints.
    """

    def __init__(self, reporter: TailReporter, tool: str, call_id: str) -> None:
        self.reporter = reporter
        self.tool = tool
        self.call_id = call_id
        self.lines: deque[str] = deque(maxlen=TAIL_LINES)
        self.partial = dict.fromkeys(STREAMS, "")
        self.bytes = 0  # output seen so far: UTF-8 bytes of the chunks, or the tool's own count
        self.chunks = 0  # output chunks received (0: the tail is made of progress messages)
        self.changed = False
        self.reported_at = 0.0  # monotonic time of this call's latest tail event

    async def output(self, stream: str, text: str) -> None:
        """``ToolCall.output``: a chunk of the command's ``stream`` (``stdout``/``stderr``)."""
        if not text:
            return
        key = stream if stream in self.partial else "stdout"
        self.chunks += 1
        self.bytes += len(text.encode("utf-8", "replace"))
        pieces = (self.partial[key] + text).split("\n")
        for line in pieces[-TAIL_LINES - 1 : -1]:
            self.lines.append(_last_bytes(_visible(line), TAIL_BYTES)[0])
        self.partial[key] = _last_bytes(pieces[-1], TAIL_BYTES)[0]
        self._changed()

    async def progress(self, progress: float, total: float | None, message: str | None) -> None:
        """``ToolCall.progress``: ``progress`` bytes so far; ``message`` the latest line,
        kept as a line of the tail only when no output chunks arrive (a tool that reports
        at most a few lines a second gives a sampled tail; a message equal to the line
        before it, e.g. a final report, is not repeated)."""
        self.bytes = max(self.bytes, int(progress))
        if self.chunks == 0 and message:
            if not self.lines or self.lines[-1] != message:
                self.lines.append(_last_bytes(_visible(message), TAIL_BYTES)[0])
                self._changed()

    def _changed(self) -> None:
        self.changed = True
        self.reporter.wake()

    def text(self) -> tuple[str, int]:
        """The tail as text (lines joined by newlines, at most ``TAIL_LINES`` of them and
        ``TAIL_BYTES`` bytes, the end kept) and how many lines it holds."""
        lines = list(self.lines) + [_visible(line) for line in self.partial.values() if line]
        lines = lines[-TAIL_LINES:]
        text, cut = _last_bytes("\n".join(lines), TAIL_BYTES)
        if cut:  # the first line is a piece of one: drop it unless it is all there is
            head, newline, rest = text.partition("\n")
            text = rest if newline else head
        return text, text.count("\n") + 1 if text else 0

    def report(self) -> tuple[str, dict[str, Any]]:
        """The event to write now (message, metadata); the tail counts as reported."""
        text, count = self.text()
        self.changed = False
        self.reported_at = time.monotonic()
        message = f"output of {self.tool} so far (last {count} lines):\n{text}"
        return message, {"tool": self.tool, "tool_call_id": self.call_id, "tail": True, "bytes": self.bytes}


class TailReporter:
    """One run's tail events: at most one every ``interval`` seconds, written by a task
    of its own (started at the first output, ended by ``close``), so a tool's output sink
    never waits on the database."""

    def __init__(self, record: Record, *, interval: float | None = None) -> None:
        self.record = record
        self.interval = TAIL_INTERVAL if interval is None else interval
        self.tails: list[OutputTail] = []
        self.reported_at: float | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, tool: str, call_id: str) -> OutputTail:
        """A tail for one tool call; ``end`` it when the call returns."""
        tail = OutputTail(self, tool, call_id)
        self.tails.append(tail)
        return tail

    def end(self, tail: OutputTail) -> None:
        """The call returned: what it printed since its last event is not reported."""
        if tail in self.tails:
            self.tails.remove(tail)

    def wake(self) -> None:
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._report(), name="tail events")

    async def close(self) -> None:
        """Stop reporting (the run's tool calls are over)."""
        self.tails.clear()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def _due(self) -> OutputTail | None:
        changed = [tail for tail in self.tails if tail.changed]
        return min(changed, key=lambda tail: tail.reported_at) if changed else None

    async def _report(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.reported_at is not None:
                wait = self.reported_at + self.interval - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            tail = self._due()
            if tail is None:
                continue
            self.reported_at = time.monotonic()
            message, metadata = tail.report()
            try:
                await self.record(message, metadata)
            except Exception:
                logger.exception("could not record an output tail")
            if self._due() is not None:
                self._wake.set()
