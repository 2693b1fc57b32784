"""Streamed command output (docs/live-operations.md): a command run streamed on a 2.1 shim,
each ``Output`` handed on as it arrives and assembled into a 2.0-shaped ``COMMAND_RESULT``."""

from __future__ import annotations

import base64
import codecs
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from machines.protocol import DEFAULT_LIMITS
from machines.services.arguments import LIVE_PAYLOAD_FIELDS
from machines.services.errors import MachineError
from machines.services.relay import Failed, LiveCommand, Output
from machines.services.router import Candidate

OutputSink = Callable[[Output], Awaitable[None] | None]
"""``on_output(output)``: called with each ``Output`` of a streamed command (it may be async)."""


async def execute_streamed(
    candidate: Candidate,
    *,
    session_id: str,
    payload: dict[str, Any],
    request_id: str,
    timeout: float,
    on_output: OutputSink,
    register: Callable[[str], Awaitable[None]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run a command streamed (2.1), handing each ``Output`` to ``on_output`` and assembling
    stdout/stderr up to ``max_file_size_bytes`` together (``output_truncated``). Returns the
    response ``{machine_id, type, payload}`` (a 2.0-shaped ``COMMAND_RESULT`` plus
    ``cancelled``) and what the audit record adds (``exit_code``, ``cancelled``, ``timed_out``, ``bytes``).
    Raises ``MachineError`` (the shim's ``ERROR``, ``OUTPUT_LOST``, ``MACHINE_UNREACHABLE``,
    ``TIMEOUT``); cancelled, it sends ``CANCEL`` first."""
    command = LiveCommand(
        candidate,
        request_id=request_id,
        session_id=session_id,
        payload={k: v for k, v in payload.items() if k not in LIVE_PAYLOAD_FIELDS},
        timeout=timeout,
    )
    cap = int(candidate.limits.get("max_file_size_bytes", DEFAULT_LIMITS["max_file_size_bytes"]))
    assembled = OutputAssembly(cap)
    try:
        await command.open()
        await register(command.channel)
        failure = await command.send()
        while failure is None:
            event = await command.next_event()
            if isinstance(event, Output):
                assembled.add(event)
                outcome = on_output(event)
                if inspect.isawaitable(outcome):
                    await outcome
                await command.consumed(event)
                continue
            if isinstance(event, Failed):
                failure = event
                break
            answer = assembled.result(event.payload)
            audited = {
                "exit_code": answer.get("exit_code"),
                "cancelled": bool(answer.get("cancelled")),
                "timed_out": bool(answer.get("timed_out")),
                "bytes": {"stdout": command.bytes["stdout"], "stderr": command.bytes["stderr"]},
            }
            return {"machine_id": candidate.machine_id, "type": event.type, "payload": answer}, audited
        raise MachineError(failure.code, failure.message, failure.details)
    except BaseException:
        if not command.finished:
            await command.cancel()
        raise
    finally:
        await command.close()


class OutputAssembly:
    """Streamed stdout/stderr put back together for a result, at most ``cap`` bytes of the
    two together (the rest dropped, ``truncated``); base64 frames are decoded as UTF-8
    with replacement."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = 0
        self.truncated = False
        self.parts: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.decoders = {stream: codecs.getincrementaldecoder("utf-8")("replace") for stream in self.parts}

    def add(self, output: Output) -> None:
        """Keep what fits of ``output``."""
        room = self.cap - self.kept
        if output.encoding == "base64":
            raw = base64.b64decode(output.data)
            if len(raw) > room:
                raw, self.truncated = raw[: max(room, 0)], True
            text = self.decoders[output.stream].decode(raw)
        else:
            raw = output.data.encode("utf-8", "surrogatepass")
            if len(raw) > room:
                raw, self.truncated = raw[: max(room, 0)], True
            text = raw.decode("utf-8", "ignore")  # a character the cap split is dropped whole
        self.kept += len(raw)
        if text:
            self.parts[output.stream].append(text)

    def result(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` (a streamed ``COMMAND_RESULT``) as a 2.0 ``COMMAND_RESULT`` plus
        ``cancelled``: the assembled ``stdout``/``stderr``, ``output_truncated`` when the cap
        or the shim's ``max_stream_bytes`` cut anything."""
        answer = dict(payload)
        stream_truncated = bool(answer.pop("stream_truncated", False))
        answer.pop("stdout_bytes", None)
        answer.pop("stderr_bytes", None)
        answer["stdout"] = "".join(self.parts["stdout"])
        answer["stderr"] = "".join(self.parts["stderr"])
        answer["output_truncated"] = bool(answer.get("output_truncated")) or stream_truncated or self.truncated
        answer["cancelled"] = bool(answer.get("cancelled"))
        return answer
