"""One running command of shim protocol 2.1: streamed output, streamed stdin, flow credit
and cancel (docs/shim-protocol.md#live-operations-21; the 2.0 rules it keeps:
docs/shim-protocol.md#operations).

:class:`LiveCommand` is created for every ``EXECUTE_COMMAND`` before its task starts, so
``CANCEL``, ``FLOW`` and ``COMMAND_INPUT`` frames that arrive right behind the request find
it. :meth:`LiveCommand.run` then drives the started process to its end and builds the
``COMMAND_RESULT`` payload:

- **Streamed output** (``stream: true``): ``COMMAND_OUTPUT {stream, data, encoding, seq}``
  frames. The first output of the operation goes at once; after that a stream's buffer goes
  when it holds ``STREAM_FLUSH_BYTES`` (64 KiB, and a frame carries at most that many raw
  bytes) or ``STREAM_FLUSH_SECONDS`` (100 ms) after the previous frame of that stream (of the
  operation, for a stream that has sent none yet). ``seq`` counts from 0 per operation
  across both streams. UTF-8 text goes through one incremental decoder per stream (a
  character is never split; invalid bytes become U+FFFD); ``binary: true`` sends base64 of
  the raw bytes.
- **Flow control**: a stream never sends more raw bytes than its latest ``FLOW``
  ``credit_total`` (initially ``stream_window_bytes``); out of credit, its pipe is not read
  (but for one byte held back, to notice the end of the output), so the command blocks
  writing and nothing grows. Streamed output of one operation (both
  streams) stops at ``max_stream_bytes`` (the rest is read and dropped,
  ``stream_truncated``) unless ``pipe: true``.
- **Streamed stdin** (``stdin: "stream"``): ``COMMAND_INPUT`` data is written to the
  command's stdin in order; ``eof`` closes it. The shim grants ``FLOW {stream: "stdin",
  credit_total = bytes taken + window}`` each time half a window was taken.
- **Cancel**: SIGTERM to the process group, SIGKILL ``CANCEL_GRACE_SECONDS`` later; output
  beyond the credit already granted is then read and dropped (a cancelled command must end
  even if nobody grants credit any more). The result says ``cancelled: true`` and the exit
  code is the process's (−signal).

Standard library only, like the rest of the shim package.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .protocol import CANCEL_GRACE_SECONDS, STREAM_FLUSH_BYTES, STREAM_FLUSH_SECONDS, ErrorCode, MessageType, ShimError

logger = logging.getLogger("machines.shim")

KILL_GRACE_SECONDS = 5.0
"""Seconds to wait for a killed command's pipes to close before answering anyway (a process
that left the group may hold them open for ever)."""

PIPE_CHUNK = 64 * 1024
"""Bytes: the largest single read from a command's stdout/stderr pipe."""

OUTPUT_STREAMS = ("stdout", "stderr")
"""``stream`` values of ``COMMAND_OUTPUT`` and of the ``FLOW`` frames the platform sends."""

STDIN_MODES = ("null", "stream")
"""``EXECUTE_COMMAND.stdin`` values: /dev/null (the default) or ``COMMAND_INPUT`` frames."""

FrameSender = Callable[[str, dict[str, Any]], Awaitable[None]]
"""``await send(message_type, payload)``: sends a ``COMMAND_OUTPUT`` (under the request's id)
or a ``FLOW`` (under a fresh id; the sender adds the operation's ``request_id``)."""


@dataclass(frozen=True)
class CommandOptions:
    """The 2.1 fields of an ``EXECUTE_COMMAND`` payload, all optional.

    ``stream``: send ``COMMAND_OUTPUT`` frames while it runs; ``binary``: their ``data`` is
    base64 instead of UTF-8 text (meaningful only with ``stream``); ``stdin_stream``: the
    payload said ``stdin: "stream"`` (a pipe fed by ``COMMAND_INPUT``); ``pipe``: the output
    feeds a cross-machine pipe, so ``max_stream_bytes`` does not bound it.
    """

    stream: bool = False
    binary: bool = False
    stdin_stream: bool = False
    pipe: bool = False

    @property
    def live_fields(self) -> list[str]:
        """The 2.1 features this request asks for, as named in refusals of a 2.0 connection."""
        asked = [("stream", self.stream), ('stdin: "stream"', self.stdin_stream)]
        asked += [("binary", self.binary), ("pipe", self.pipe)]
        return [name for name, on in asked if on]


class _Output:
    """One of a command's output pipes and what has been done with its bytes."""

    def __init__(self, name: str, reader: asyncio.StreamReader, credit_total: int, binary: bool) -> None:
        self.name = name
        self.reader = reader
        self.credit_total = credit_total
        self.read = 0  # raw bytes read from the pipe
        self.accepted = 0  # raw bytes taken for streaming (framed or still buffered); never above credit_total
        self.buffer = bytearray()  # taken, not yet framed
        self.kept = bytearray()  # not streamed: what the result carries
        self.decoder = None if binary else codecs.getincrementaldecoder("utf-8")("replace")
        self.last_frame: float | None = None
        self.credit = asyncio.Event()
        self.timer: asyncio.Task[None] | None = None


class LiveCommand:
    """The live side of one ``EXECUTE_COMMAND``: cancel, credit, stdin, streaming.

    ``window`` is the negotiated ``stream_window_bytes`` (initial credit of every stream, and
    the stdin window the shim grants ahead); ``max_stream_bytes`` bounds the streamed output
    of both streams together (not with ``pipe``); ``send`` sends the ``COMMAND_OUTPUT`` and
    stdin ``FLOW`` frames (``None``: they are dropped — for callers without a connection).

    Thread model: one event loop; :meth:`cancel`, :meth:`grant` and :meth:`feed` are called
    from the connection's receive loop, :meth:`run` from the operation's task.
    """

    def __init__(
        self, options: CommandOptions, *, window: int, max_stream_bytes: int, send: FrameSender | None = None
    ) -> None:
        self.options = options
        self.window = window
        self.max_stream_bytes = max_stream_bytes
        self._send = send
        self._cancelled = False
        self._draining = False  # cancelled or timed out: read everything, send only what credit allows
        self._process: asyncio.subprocess.Process | None = None
        self._outputs: dict[str, _Output] = {}
        self._credit = dict.fromkeys(OUTPUT_STREAMS, window)  # grants that came before the process started
        self._streamed = 0  # raw bytes taken for streaming, both streams
        self._stream_truncated = False
        self._seq = 0
        self._last_frame: float | None = None
        self._send_lock = asyncio.Lock()
        # stdin
        self._input: deque[bytes] = deque()
        self._input_ready = asyncio.Event()
        self._input_eof = False
        self._input_received = 0  # raw bytes the platform sent (COMMAND_INPUT data)
        self._input_taken = 0  # raw bytes taken off the queue (written, or dropped after the pipe broke)
        self._input_written = 0  # raw bytes that reached the command's stdin
        self._stdin_credit = window  # the latest stdin credit_total granted

    # -- control (from the receive loop) ----------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """Whether a ``CANCEL`` arrived while this command ran (or before it started)."""
        return self._cancelled

    @property
    def byte_counts(self) -> dict[str, int]:
        """``{stdout, stderr, stdin}``: raw bytes the command wrote to stdout and stderr (as
        read by the shim, including any a cap dropped) and bytes written to its stdin."""
        counts = {name: output.read for name, output in self._outputs.items()}
        return {"stdout": counts.get("stdout", 0), "stderr": counts.get("stderr", 0), "stdin": self._input_written}

    @property
    def buffered_bytes(self) -> int:
        """Raw output bytes the shim holds for this command right now: its own stream buffers
        and what the pipe readers read ahead. Bounded whatever the command writes."""
        total = 0
        for output in self._outputs.values():
            total += len(output.buffer) + len(output.kept)
            total += len(getattr(output.reader, "_buffer", b""))  # asyncio's read-ahead (≤ 2 × its limit)
        return total + sum(len(chunk) for chunk in self._input)

    def cancel(self) -> None:
        """``CANCEL``: SIGTERM the process group now (or as soon as it starts),
        SIGKILL it ``CANCEL_GRACE_SECONDS`` later. Repeated cancels change nothing."""
        if self._cancelled:
            return
        self._cancelled = True
        self._drain()
        if self._process is not None:
            self._terminate(self._process.pid)

    def grant(self, stream: str, credit_total: int) -> None:
        """``FLOW`` from the platform: ``stream`` (stdout/stderr) may have sent up to
        ``credit_total`` raw bytes since the start. A smaller total than known is ignored."""
        if credit_total <= self._credit.get(stream, 0):
            return
        self._credit[stream] = credit_total
        output = self._outputs.get(stream)
        if output is not None:
            output.credit_total = credit_total
            output.credit.set()

    def feed(self, data: bytes, eof: bool) -> None:
        """``COMMAND_INPUT``: queue ``data`` for the command's stdin, then close it if ``eof``.

        Raises ``ShimError(INVALID_REQUEST)`` (the frame is dropped) when the command did not
        ask ``stdin: "stream"``, when its stdin was already closed, or when ``data`` goes
        past the stdin credit granted so far.
        """
        if not self.options.stdin_stream:
            raise ShimError(ErrorCode.INVALID_REQUEST, 'COMMAND_INPUT for a command that did not ask stdin: "stream"')
        if self._input_eof:
            raise ShimError(ErrorCode.INVALID_REQUEST, "COMMAND_INPUT after eof: the command's stdin is closed")
        if self._input_received + len(data) > self._stdin_credit:
            raise ShimError(
                ErrorCode.INVALID_REQUEST,
                f"COMMAND_INPUT goes past the stdin credit ({self._stdin_credit} bytes); wait for FLOW",
                {"credit_total": self._stdin_credit, "received": self._input_received, "size_bytes": len(data)},
            )
        self._input_received += len(data)
        if data:
            self._input.append(data)
        self._input_eof = eof
        self._input_ready.set()

    # -- the run (from the operation's task) ------------------------------------------------

    async def run(
        self,
        process: asyncio.subprocess.Process,
        transport: asyncio.SubprocessTransport,
        *,
        timeout: float,
        output_limit: int,
        started: float,
    ) -> dict[str, Any]:
        """Drive ``process`` (started in its own session, stdout/stderr pipes, stdin a pipe
        when ``stdin_stream``) to its end and return the ``COMMAND_RESULT`` payload:

        ``{stdout, stderr, exit_code, timed_out, duration_seconds, output_truncated,
        cancelled}``, plus ``stdout_bytes``, ``stderr_bytes`` (raw bytes streamed) and
        ``stream_truncated`` when streamed (``stdout``/``stderr`` are then ``""``). Not
        streamed, stdout + stderr together keep at most ``output_limit`` bytes
        (``output_truncated``). On ``timeout`` (seconds) the group gets SIGKILL and the result
        says ``timed_out: true, exit_code: -1``. Cancelling the calling task (the connection
        went away) SIGKILLs the group and re-raises.
        """
        assert process.stdout is not None and process.stderr is not None
        self._process = process
        self._outputs = {
            "stdout": _Output("stdout", process.stdout, self._credit["stdout"], self.options.binary),
            "stderr": _Output("stderr", process.stderr, self._credit["stderr"], self.options.binary),
        }
        if self._cancelled:  # the CANCEL came while the process was being started
            self._terminate(process.pid)
        budget = _OutputBudget(output_limit)
        pumps = [asyncio.create_task(self._pump(output, budget)) for output in self._outputs.values()]
        writer = asyncio.create_task(self._write_stdin(process.stdin)) if process.stdin is not None else None
        timed_out = False
        try:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.wait(pumps)
                    await process.wait()
            except TimeoutError:
                # The leader may have exited while a background child holds the pipes open:
                # kill the group either way, and stop waiting for credit.
                timed_out = True
                self._drain()
                kill_group(process.pid)
                # a process that left the group (setsid) may hold the pipes for ever: bound it
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(KILL_GRACE_SECONDS):
                        await asyncio.wait(pumps)
                        await process.wait()
        except BaseException:  # cancelled (the connection went away): leave nothing behind
            kill_group(process.pid)
            raise
        finally:
            for task in [*pumps, writer]:
                if task is not None and not task.done():
                    task.cancel()
            await asyncio.gather(*(task for task in [*pumps, writer] if task is not None), return_exceptions=True)
            transport.close()
        for pump in pumps:  # a failure inside a pump (not a cancel) is the shim's bug: surface it
            failure = None if pump.cancelled() else pump.exception()
            if failure is not None:
                raise failure
        async with self._send_lock:  # what a timer or a stopped pump still holds goes out, in order
            for output in self._outputs.values():
                if output.timer is not None:
                    output.timer.cancel()  # sleeping or waiting for the lock: never mid-send
                await self._flush_locked(output, final=True)
        stdout, stderr = self._outputs["stdout"], self._outputs["stderr"]
        result: dict[str, Any] = {
            "stdout": stdout.kept.decode("utf-8", "replace"),
            "stderr": stderr.kept.decode("utf-8", "replace"),
            "exit_code": -1 if timed_out else process.returncode,
            "timed_out": timed_out,
            "duration_seconds": round(time.monotonic() - started, 3),
            "output_truncated": budget.truncated,
            "cancelled": self._cancelled,
        }
        if self.options.stream:
            result["stdout_bytes"] = stdout.accepted
            result["stderr_bytes"] = stderr.accepted
            result["stream_truncated"] = self._stream_truncated
        return result

    def _terminate(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        asyncio.get_running_loop().call_later(CANCEL_GRACE_SECONDS, kill_group, pid)

    def _drain(self) -> None:
        self._draining = True
        for output in self._outputs.values():
            output.credit.set()

    # -- output ---------------------------------------------------------------------------

    def _room(self, output: _Output) -> int:
        """Bytes the next read may take from ``output``'s pipe."""
        if not self.options.stream or self._draining or self._budget_room() == 0:
            return PIPE_CHUNK  # everything read is kept within the budget or dropped: never stall
        return min(PIPE_CHUNK, output.credit_total - output.accepted)

    def _budget_room(self) -> int | None:
        if self.options.pipe:
            return None
        return max(0, self.max_stream_bytes - self._streamed)

    async def _pump(self, output: _Output, budget: _OutputBudget) -> None:
        held = b""  # one byte read past the credit, so that the end of the output is seen
        while True:
            room = self._room(output)
            if room <= 0:
                if not held:
                    held = await output.reader.read(1)
                    if not held:
                        break
                    output.read += len(held)
                    continue
                output.credit.clear()
                if self._room(output) <= 0:
                    await output.credit.wait()
                continue
            if held:
                chunk, held = held, b""
                if room > 1:  # join what the reader already holds, so no 1-byte frame — never wait for more
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0):
                            more = await output.reader.read(room - 1)
                            output.read += len(more)
                            chunk += more
            else:
                chunk = await output.reader.read(room)
                if not chunk:
                    break
                output.read += len(chunk)
            if not self.options.stream:
                output.kept += chunk[: budget.take(len(chunk))]
                continue
            credit_room = max(0, output.credit_total - output.accepted)
            budget_room = self._budget_room()
            take = min(len(chunk), credit_room, len(chunk) if budget_room is None else budget_room)
            if budget_room is not None and budget_room < len(chunk) and budget_room <= credit_room:
                self._stream_truncated = True
            if take:
                output.accepted += take
                self._streamed += take
                output.buffer += chunk[:take]
                await self._buffered(output)
        async with self._send_lock:
            await self._flush_locked(output, final=True)

    def _deadline(self, output: _Output) -> float:
        """Loop time at which ``output``'s buffer is due (``-inf``: at once)."""
        previous = output.last_frame if output.last_frame is not None else self._last_frame
        return float("-inf") if previous is None else previous + STREAM_FLUSH_SECONDS

    async def _buffered(self, output: _Output) -> None:
        loop = asyncio.get_running_loop()
        if len(output.buffer) >= STREAM_FLUSH_BYTES or self._deadline(output) <= loop.time():
            async with self._send_lock:
                await self._flush_locked(output)
        elif output.timer is None:
            output.timer = asyncio.create_task(self._flush_later(output))

    async def _flush_later(self, output: _Output) -> None:
        loop = asyncio.get_running_loop()
        try:
            while output.buffer:
                delay = self._deadline(output) - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                    continue
                async with self._send_lock:
                    await self._flush_locked(output)
        finally:
            output.timer = None

    async def _flush_locked(self, output: _Output, *, final: bool = False) -> None:
        """Send ``output``'s buffer as frames of at most ``STREAM_FLUSH_BYTES`` raw bytes
        (the caller holds the send lock, so ``seq`` follows the order on the wire)."""
        while output.buffer:
            raw = bytes(output.buffer[:STREAM_FLUSH_BYTES])
            del output.buffer[: len(raw)]
            if output.decoder is None:
                await self._emit(output, base64.b64encode(raw).decode("ascii"))
            else:
                text = output.decoder.decode(raw)
                if text:  # nothing when the bytes only started a character
                    await self._emit(output, text)
        if final and output.decoder is not None:
            tail = output.decoder.decode(b"", final=True)  # an unfinished character → U+FFFD
            if tail:
                await self._emit(output, tail)

    async def _emit(self, output: _Output, data: str) -> None:
        payload = {
            "stream": output.name,
            "data": data,
            "encoding": "utf-8" if output.decoder is not None else "base64",
            "seq": self._seq,
        }
        self._seq += 1
        output.last_frame = self._last_frame = asyncio.get_running_loop().time()
        if self._send is not None:
            await self._send(MessageType.COMMAND_OUTPUT, payload)

    # -- stdin ----------------------------------------------------------------------------

    async def _write_stdin(self, stdin: asyncio.StreamWriter) -> None:
        """Write queued input in order; close stdin at eof. A command that closed its stdin
        (a broken pipe) gets nothing more: later input is taken and dropped, and credit keeps
        coming, so the platform's side never stalls on it."""
        broken = False
        granted_at = 0  # _input_taken when the last grant was sent
        try:
            while True:
                if not self._input:
                    if self._input_eof:
                        break
                    self._input_ready.clear()
                    await self._input_ready.wait()
                    continue
                chunk = self._input.popleft()
                if not broken:
                    try:
                        stdin.write(chunk)
                        await stdin.drain()
                        self._input_written += len(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        broken = True
                        logger.debug("the command closed its stdin; dropping further input")
                self._input_taken += len(chunk)
                if self._input_taken - granted_at >= max(1, self.window // 2):
                    granted_at = self._input_taken
                    await self._grant_stdin()
        finally:
            with contextlib.suppress(OSError):
                stdin.close()

    async def _grant_stdin(self) -> None:
        self._stdin_credit = self._input_taken + self.window
        if self._send is not None:
            await self._send(MessageType.FLOW, {"stream": "stdin", "credit_total": self._stdin_credit})


class _OutputBudget:
    """The combined stdout + stderr allowance of one command's result, in bytes."""

    def __init__(self, limit: int) -> None:
        self.remaining = limit
        self.truncated = False

    def take(self, size: int) -> int:
        granted = min(size, self.remaining)
        self.remaining -= granted
        if granted < size:
            self.truncated = True
        return granted


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (the command started its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


__all__ = [
    "KILL_GRACE_SECONDS",
    "OUTPUT_STREAMS",
    "PIPE_CHUNK",
    "STDIN_MODES",
    "CommandOptions",
    "FrameSender",
    "LiveCommand",
    "kill_group",
]
