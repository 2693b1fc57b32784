"""Every frame the ``/ws`` session sends, one type each (docs/ws-protocol.md#frames).

Three kinds go out: the answer to the first-frame login (``AuthOk``, or an ``ErrorReply``
before the socket closes), a reply to a request (its result's fields at the top level, then
the request's ``nonce`` when it had one: ``reply``), and an event (an ``action`` and never a
``nonce``: docs/ws-protocol.md#events). The consumer sends all of them through one method,
``AuthenticatingConsumer._send`` (``dispatch.ws.auth``).

They are ``TypedDict``\\ s, not pydantic models: a frame is built on every remote call
(twice: the event to the serving session, the reply to the caller), and a model built even
with ``model_construct`` and no validation cost about three times the dict and the
encoding together (measured: ~10 µs against ~3 µs a frame), on a path whose whole server
CPU is ~270 µs a call (bench/README.md). The types are checked by mypy where a frame is
built; the wire is the dict exactly as written, keys in the order they are written here, so
each frame is byte for byte what the consumer wrote before it had types.
"""

# No ``from __future__ import annotations`` here: a TypedDict's ``__required_keys__`` is read
# from its annotations when the class is made, and as strings ``NotRequired[...]`` is not seen
# (every key would count as required to anything that reads the type at run time).
from typing import Any, Literal, NewType, NotRequired, TypeVar

# typing_extensions' TypedDict, not typing's: on Python 3.11 pydantic can read only this one (the
# tests check the frames the session sends against these types with it).
from typing_extensions import TypedDict

from agents.protocol import AgentEventFrame, RunFinishedFrame

Nonce = str | int | float
"""A request's ``nonce`` as the consumer accepted it (never a boolean)."""


# --- replies (docs/ws-protocol.md#actions) ------------------------------------------------


class Reply(TypedDict):
    """What every reply has: the request's ``nonce``, last, when the request had one."""

    nonce: NotRequired[Nonce]


class ErrorReply(Reply):
    """``{"error": "<sentence>", "nonce"?}``: a refused request or a failed action, and the
    answer to a login that failed (then with no ``nonce``; the socket closes after it)."""

    error: str


class PongReply(Reply):
    """``ping``: ``{"pong": true}``."""

    pong: Literal[True]


class RemoteConnectedReply(Reply):
    """``remote-connect``: ``{"message": "remote connected", "remotename"}``."""

    message: Literal["remote connected"]
    remotename: str


class RemoteDisconnectedReply(Reply):
    """``remote-disconnect``: ``{"message": "remote disconnected", "remotename"}``."""

    message: Literal["remote disconnected"]
    remotename: str


class RemoteListReply(Reply):
    """``remote-list``: ``{"remotes": [...]}`` (``remotes.selectors.remote_list_for``)."""

    remotes: list[dict[str, Any]]


class CallResultReply(Reply):
    """``remote-call``: ``{"result": <any JSON value>}``, the remote's answer as it sent it."""

    result: Any


class PromptMessageReply(Reply):
    """``send-agent-prompt`` to a CLI agent: ``{"message": "prompt accepted", "agentId",
    "messageId"}``."""

    message: Literal["prompt accepted"]
    agentId: str
    messageId: int


class PromptRunReply(Reply):
    """``send-agent-prompt`` to an expert agent: ``{"message": "prompt accepted", "agentId",
    "runId"}``."""

    message: Literal["prompt accepted"]
    agentId: str
    runId: str | None


AnyReply = (
    ErrorReply
    | PongReply
    | RemoteConnectedReply
    | RemoteDisconnectedReply
    | RemoteListReply
    | CallResultReply
    | PromptMessageReply
    | PromptRunReply
)
R = TypeVar("R", bound=Reply)


def reply(frame: R, nonce: Nonce | None) -> R:
    """``frame`` with the request's ``nonce`` added last, when there was one (a request
    without one gets a reply without one). Mutates and returns ``frame``."""
    if nonce is not None:
        frame["nonce"] = nonce
    return frame


# --- the first-frame login (docs/ws-protocol.md#authentication) --------------------------


class AuthOk(TypedDict):
    """The answer to a first-frame login: ``{"ok": true, "user": "<username>"}``; no
    ``action``, no ``nonce``."""

    ok: Literal[True]
    user: str


# --- events (docs/ws-protocol.md#events) -------------------------------------------------


class RemoteDisconnectedEvent(TypedDict):
    """``{"action": "remote-disconnected", "remotename", "reason"}``: another session of
    the user disconnected a remote this session serves."""

    action: Literal["remote-disconnected"]
    remotename: str
    reason: str


class RemoteCallEvent(TypedDict):
    """``{"action": "remote-call", "requestId", "remotename", "function", "args"}``: a call
    for a remote this session serves (docs/ws-protocol.md#remote-call-event). The consumer
    sends it as an ``EncodedFrame``."""

    action: Literal["remote-call"]
    requestId: str
    remotename: str
    function: str
    args: dict[str, Any]


EncodedFrame = NewType("EncodedFrame", str)
"""A frame already written as JSON text: the ``RemoteCallEvent``, which
``remotes.protocol.remote_call_event`` encodes before it is sent because its size in bytes
decides whether it may be."""

Frame = AnyReply | AuthOk | RemoteDisconnectedEvent | AgentEventFrame | RunFinishedFrame | RemoteCallEvent
"""Every frame the session sends."""
