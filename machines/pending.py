"""What the ``/ws/shim/`` consumer (``machines.consumers.ShimConsumer``) keeps of one
operation it sent to its shim, and the accounting of a relayed operation's output against
the credit its caller granted (docs/shim-protocol.md#live-operations-21): the consumer
holds no output, but a shim ignoring FLOW cannot flood the caller."""

from __future__ import annotations

from dataclasses import dataclass, field

from machines.protocol import MachineOutputMessage
from machines.services.relay import base64_length
from machines.shim.protocol import STREAM_FLUSH_BYTES


@dataclass
class PendingOperation:
    """An operation sent to this shim, awaiting its response."""

    op: str
    reply_channel: str
    expires_at: float
    relay: bool = False  # 2.1: COMMAND_OUTPUT and stdin FLOW go to reply_channel too
    # 2.1, relayed: the stdout/stderr credit granted so far (cumulative, the window first),
    # the raw bytes received of each stream, and max_stream_bytes (None: a pipe, unbounded).
    credit: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    max_stream_bytes: int | None = None
    # 2.1, stdin (a pipe's destination): the credit the shim granted (cumulative), the
    # credit relayed to the caller, and the raw bytes of COMMAND_INPUT handed to the socket.
    # What is relayed is capped by what the socket took (``ShimConsumer._grant_stdin``).
    stdin_claimed: int = 0
    stdin_relayed: int = 0
    stdin_written: int = 0

    def count_output(self, output: MachineOutputMessage, name: str) -> str | None:
        """Count ``output`` against this operation's credit: what is wrong with it (a frame
        over 64 KiB raw, a stream past the credit granted or the output past
        ``max_stream_bytes``, each with one frame of slack), or ``None``; ``name`` names the
        machine in that message."""
        raw = raw_bytes(output.data, output.encoding)
        # A text frame may carry the last character begun in the frame before (the shim's
        # incremental decoder holds up to 3 bytes back).
        if raw > STREAM_FLUSH_BYTES + (0 if output.encoding == "base64" else 3):
            return f"machine '{name}' sent an output frame of {raw} bytes, over the {STREAM_FLUSH_BYTES}-byte maximum"
        stream = output.stream
        self.received[stream] = self.received.get(stream, 0) + raw
        credit = self.credit.get(stream, 0)
        if self.received[stream] > credit + STREAM_FLUSH_BYTES:
            return f"machine '{name}' sent {stream} output past the credit it was granted ({credit} bytes)"
        total = sum(self.received.values())
        if self.max_stream_bytes is not None and total > self.max_stream_bytes + STREAM_FLUSH_BYTES:
            return f"machine '{name}' sent output past max_stream_bytes ({self.max_stream_bytes} bytes)"
        return None


def raw_bytes(data: str, encoding: str) -> int:
    """The raw bytes an output frame stands for, counted low: the decoded base64, or the
    UTF-8 text with each U+FFFD counted as the one invalid byte it replaced."""
    if encoding == "base64":
        return base64_length(data)
    return len(data.encode("utf-8", "surrogatepass")) - 2 * data.count("\ufffd")
